"""The Ray Serve app on a local Ray (CPU, `tiny`): two engine replicas behind Ray Serve's proxy,
driven with the official openai client and raw HTTP on 127.0.0.1.

Which replica answered is read off the X-Ringleader-Replica header the ingress sets from the
replica's own Reply; a replica's engine process is found by its socket's name, which holds the
replica's id.  The test that kills an engine runs last: Ray replaces that replica.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from ringleader.hostctl.gateway.app import BackgroundGateway  # noqa: E402
from ringleader.hostctl.ray_serve.app import build_app  # noqa: E402
from ringleader.hostctl.ray_serve.ingress import REPLICA_HEADER  # noqa: E402
from ringleader.ipc.client import Client  # noqa: E402
from tests.conftest import running_server, wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# a chat template for `tiny` (it has none), passed through to every replica's engine
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
APP_ARGS = {
    "model": "tiny",
    "device": "cpu",
    "slots": 8,
    "max-ctx": 512,
    "token-budget": 64,
    "threads": 1,
    "chat-template": CHAT_TEMPLATE,
    "replicas": 2,
    "routing": "prefix",
    "health_check_period_s": 1.0,
    "health_check_timeout_s": 5.0,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SEEN_REPLICAS: set[str] = set()  # every replica id an answer named
REPLICA = REPLICA_HEADER.lower()  # headers as post() returns them


def post(url: str, path: str, body: dict | bytes, timeout: float = 60.0) -> tuple[int, dict, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            status, headers, raw = r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()
    if REPLICA in headers:
        SEEN_REPLICAS.add(headers[REPLICA])
    return status, headers, raw


def sse_events(raw: bytes) -> list:
    """The events of an SSE body: parsed JSON objects, and "[DONE]"."""
    events = []
    for block in raw.split(b"\n\n"):
        block = block.strip(b"\n")  # a stream read from its middle starts with a line's end
        if block.startswith(b"data: "):
            payload = block[6:]
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def engine_pids(replica: str) -> list[int]:
    """The `ringleader serve` processes whose socket is named for `replica`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmdline and any(arg.endswith(f"/{replica}.sock".encode()) for arg in cmdline):
            pids.append(int(proc.name))
    return pids


def live_replicas() -> set[str]:
    """The replica ids of the engines running now (each engine's socket is named for its replica)."""
    ids = set()
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmdline:
            ids.update(Path(arg.decode(errors="replace")).stem for arg in cmdline if arg.endswith(b".sock"))
    return ids


def engine_address(replica: str) -> str:
    """The ZeroMQ address `replica`'s engine serves at (its --bind)."""
    (pid,) = engine_pids(replica)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("--bind") + 1]


def open_stream(url: str, body: dict) -> http.client.HTTPResponse:
    """A streamed completion whose answer has begun (status and headers read)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(
        "POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    assert response.status == 200
    return response


def running_engine_replicas() -> int:
    """How many EngineReplica replicas Ray Serve reports RUNNING."""
    status = serve.status().applications["ringleader"].deployments["EngineReplica"]
    return sum(
        n for state, n in status.replica_states.items() if str(getattr(state, "value", state)) == "RUNNING"
    )


# ---------------------------------------------------------------- the command


def readme_ray_block() -> list[str]:
    """The README's two Ray Serve commands: install the extra, start the app."""
    section = (ROOT / "README.md").read_text().split("## Past one engine: Ray Serve", 1)[1]
    block = section.split("```\n", 2)[1]
    return [line.split("#")[0].strip() for line in block.strip().splitlines()]


def test_the_readmes_ray_serve_command_serves_and_stops_on_sigint(tmp_path):
    """`ringleader ray-serve` as the README starts it (on a port of the test's own): a local Ray,
    the app, a completion through the proxy from each replica, and SIGINT stops it all, no
    engine left behind."""
    install, start = readme_ray_block()
    assert install == 'pip install -e ".[ray]"'
    argv = shlex.split(start)
    assert argv[:2] == ["ringleader", "ray-serve"]
    port = free_port()
    log = tmp_path / "ray-serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringleader.hostctl.cli", *argv[1:], "--listen", f"127.0.0.1:{port}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        assert wait_until(lambda: b"Ray Serve app" in log.read_bytes() or proc.poll() is not None, 120, 0.2)
        assert proc.poll() is None, log.read_text()[-3000:]
        replicas = set()
        # the proxy's handle learns the second replica by long poll, after serve.run returned: on a
        # loaded machine that can take seconds, so ask until both answered or a deadline passes
        deadline, i = time.monotonic() + 90, 0
        while len(replicas) < 2 and time.monotonic() < deadline:
            i += 1
            status, headers, body = post(
                # ignore_eos: tiny's random weights sample its end-of-sequence id now and then
                # (about 1 request in 400 at temperature 1), which would end a completion early
                f"http://127.0.0.1:{port}",
                "/v1/completions",
                {"prompt": f"{i}", "max_tokens": 3, "ignore_eos": True},
            )
            assert status == 200, body
            assert json.loads(body)["usage"]["completion_tokens"] == 3
            replicas.add(headers[REPLICA])
        assert len(replicas) == 2 and all(engine_pids(r) for r in replicas), replicas
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        assert wait_until(lambda: not any(engine_pids(r) for r in replicas), 30), "an engine outlived the app"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_command_refuses_bad_options_before_starting_ray():
    def ray_serve(*argv: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "ringleader.hostctl.cli", "ray-serve", *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    run = ray_serve("--min-replicas", "2")
    assert run.returncode == 2 and "min_replicas and max_replicas" in run.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        run = ray_serve("--listen", f"127.0.0.1:{taken.getsockname()[1]}")
    assert run.returncode == 2 and "--listen" in run.stderr and "cannot bind" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_the_config_file_in_docs_deploys_the_same_app():
    """docs/ray-serve.yaml is a valid Ray Serve config whose import path and args build the app."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from ringleader.hostctl.ray_serve.app import engine_deployment_options
    from ringleader.hostctl.ray_serve.args import RayServeArgs

    config = yaml.safe_load((ROOT / "docs" / "ray-serve.yaml").read_text())
    (app,) = ServeDeploySchema.model_validate(config).applications
    module, name = app.import_path.split(":")
    assert (module, name) == ("ringleader.hostctl.ray_serve.app", "build_app")
    args = RayServeArgs.from_dict(app.args)
    assert args.engine == {"model": "tiny", "n_slots": 128, "max_ctx": 4096, "prefix_caching": True}
    options = engine_deployment_options(args)
    assert options["num_replicas"] == 2 and options["max_ongoing_requests"] == 256
    assert options["request_router_config"]["request_router_class"].endswith("PrefixAffinityRouter")
    assert options["request_router_config"]["request_router_kwargs"] == {"affinity": True}
    pow2 = engine_deployment_options(RayServeArgs.from_dict({**app.args, "routing": "pow2"}))
    assert pow2["request_router_config"]["request_router_kwargs"] == {"affinity": False}
    assert build_app(app.args) is not None
    scaled = engine_deployment_options(
        RayServeArgs.from_dict({**app.args, "min_replicas": 1, "max_replicas": 4})
    )
    assert "num_replicas" not in scaled and scaled["autoscaling_config"]["max_replicas"] == 4


# ---------------------------------------------------------------- the app


@pytest.fixture(scope="module")
def app_url():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(APP_ARGS), name="ringleader", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def gateway():
    """The gateway alone, on an in-process server of the same model and options."""
    with running_server("tiny", n_slots=8, max_ctx=512, token_budget=64) as server:
        with BackgroundGateway(server.address) as gw:
            yield gw


def test_the_official_client_streams_completions_and_chat_through_the_proxy(app_url, gateway):
    client = openai.OpenAI(base_url=app_url + "/v1", api_key="none", max_retries=0)
    kwargs = dict(model="tiny", max_tokens=12, temperature=0.0)
    streamed = client.completions.create(prompt="The ring leads", stream=True, **kwargs)
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    whole = client.completions.create(prompt="The ring leads", **kwargs)
    assert text == whole.choices[0].text and whole.usage.completion_tokens == 12
    # the same greedy text as the gateway alone in front of the same model
    direct = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    assert direct.completions.create(prompt="The ring leads", **kwargs).choices[0].text == text

    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(messages=messages, stream=True, **kwargs)
    chunks = list(chat)
    assert chunks[0].choices[0].delta.role == "assistant"
    reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert client.chat.completions.create(messages=messages, **kwargs).choices[0].message.content == reply
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_both_replicas_serve_requests(app_url):
    """Distinct prompts (no prefix to follow): the router spreads them over both replicas."""
    seen: list[str] = []

    def one(i: int) -> None:
        status, headers, body = post(
            app_url, "/v1/completions", {"prompt": f"{i} distinct prompt number {i * 7919}", "max_tokens": 16}
        )
        assert status == 200, body
        seen.append(headers[REPLICA])

    for round_ in range(8):  # on a loaded 2-core host a replica can lag its first rounds
        threads = [threading.Thread(target=one, args=(round_ * 16 + i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if len(set(seen)) == 2:
            break
        time.sleep(1.0)
    assert len(seen) >= 16 and len(set(seen)) == 2, seen


def test_requests_sharing_a_prefix_stay_on_one_replica(app_url):
    """Prefix affinity: each family of prompts (a long shared start, then its own question)
    is answered by one replica, once the router has seen the family."""
    families = {name: f"System: you are assistant {name}. " + "Rules of the house. " * 20 for name in "AB"}
    served: dict[str, list[str]] = {"A": [], "B": []}
    for i in range(6):
        for name, prefix in families.items():
            status, headers, body = post(
                app_url, "/v1/completions", {"prompt": f"{prefix}Q{i}?", "max_tokens": 2}
            )
            assert status == 200, body
            served[name].append(headers[REPLICA])
    for name, replicas in served.items():
        assert len(set(replicas[1:])) == 1, (name, served)


BAD_BODIES = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}),
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "best_of": 3}),
    ("/v1/completions", {"prompt": "x", "frobnicate": True}),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}),
    ("/v1/completions", {"prompt": "x", "n": 0}),
    ("/v1/chat/completions", {"messages": []}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    ),
    ("/v1/nowhere", {"prompt": "x"}),
]


@pytest.mark.parametrize(("path", "body"), BAD_BODIES)
def test_bad_input_gets_the_gateways_answer(app_url, gateway, path, body):
    ray_status, _, ray_body = post(app_url, path, body)
    gw_status, _, gw_body = post(gateway.url, path, body)
    assert ray_status == gw_status and 400 <= ray_status < 500
    assert json.loads(ray_body) == json.loads(gw_body)


def test_a_client_that_goes_away_aborts_its_request_on_the_engine(app_url):
    """Closing the HTTP stream cancels the ingress's call, the replica's generator closes and
    the engine aborts the request: its in-flight count falls back to zero."""
    response = open_stream(app_url, {"prompt": "to be cut", "max_tokens": 480, "ignore_eos": True})
    replica = response.headers[REPLICA_HEADER]
    assert response.readline().startswith(b"data: ")  # a token arrived
    with Client(engine_address(replica)) as engine:
        assert engine.stats()["in_flight"] == 1
        response.close()
        assert wait_until(lambda: engine.stats()["in_flight"] == 0, 15, 0.1)
        assert engine.stats()["finished"].get("abort", 0) >= 1


def test_metrics_reach_rays_export_with_the_replica_label(app_url):
    """Each replica's gauges in Ray's per-node Prometheus export, labelled by replica."""
    from ray._private.worker import global_worker

    node = global_worker.node
    url = f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"

    def series(name: str) -> dict[str, float]:
        """A series' value by its replica label (summed over the rest)."""
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            return {}
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(name + "{") and 'replica="' in line:
                replica = line.split('replica="')[1].split('"')[0]
                values[replica] = values.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
        return values

    assert wait_until(lambda: len(series("ray_ringleader_kv_cache_usage_perc")) >= 2, 60, 1.0)

    # the label: the id of a replica of this app, one that answered or one running now (Ray may have
    # replaced a replica that failed a health check on a busy machine; its successor may not have answered yet)
    def labels() -> set[str]:
        return set(series("ray_ringleader_kv_cache_usage_perc"))

    assert wait_until(lambda: len(live_replicas()) >= 2, 30, 1.0), live_replicas()  # both engines are found

    assert wait_until(lambda: labels() <= SEEN_REPLICAS | live_replicas(), 30, 1.0), (
        labels(),
        SEEN_REPLICAS,
        live_replicas(),
    )
    # counters follow the engines' totals: every replica generated tokens by now
    assert wait_until(lambda: len(series("ray_ringleader_generation_tokens_total")) >= 2, 30, 1.0)
    assert all(v > 0 for v in series("ray_ringleader_generation_tokens_total").values())
    assert sum(series("ray_ringleader_replica_time_to_first_token_seconds_count").values()) >= 1


def story(i: int) -> str:
    return f"Story {i}: " + "once upon a time there was a ring. " * 4  # two routing blocks, 150 tokens


def test_an_engine_killed_mid_stream_ends_its_streams_once_and_ray_replaces_the_replica(app_url):
    results: dict[int, dict] = {}

    def stream(i: int) -> None:
        body = {"prompt": story(i), "max_tokens": 340, "ignore_eos": True, "stream": True}
        request = urllib.request.Request(
            app_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            results[i] = {"replica": r.headers[REPLICA], "started": time.monotonic()}
            raw = r.read()
        results[i].update(events=sse_events(raw), ended=time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert wait_until(lambda: len(results) == 8, 60), results
    victim = results[0]["replica"]
    pids = engine_pids(victim)
    assert len(pids) == 1, (victim, pids)
    killed = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(120)
    cut = 0  # the victim's streams the kill cut short
    for i, r in results.items():
        events = r["events"]
        assert events[-1] == "[DONE]", (i, events[-3:])
        errors = [e for e in events if "error" in e]
        whole = any(
            e != "[DONE]" and e.get("choices") and e["choices"][0]["finish_reason"] == "length"
            for e in events
        )
        if whole:  # the other replica's streams, or one that finished before the kill
            assert not errors, (i, errors)
        else:  # ended by the kill: exactly one error event, within a bounded time
            cut += 1
            assert r["replica"] == victim, (i, r["replica"], victim)
            assert len(errors) == 1 and errors[0]["error"]["type"] == "service_unavailable", (i, errors)
            assert r["ended"] - killed < 15, r["ended"] - killed
    assert cut >= 1

    # later requests succeed at once, those whose prefix the dead engine held too: the ingress
    # sends them again, and the router steers them past the replica that refused them
    for i in range(8):
        prompt = story(i) + " The end." if i % 2 else f"after {i}"
        status, _, body = post(app_url, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
        assert status == 200, body
    # and Ray replaces the replica: two run again, one of them new, with its own engine
    before = set(SEEN_REPLICAS)
    assert wait_until(lambda: running_engine_replicas() == 2, 90, 0.5)

    def a_new_replica_answers() -> bool:
        post(app_url, "/v1/completions", {"prompt": f"new {time.monotonic()}", "max_tokens": 2})
        return bool(SEEN_REPLICAS - before)

    assert wait_until(a_new_replica_answers, 90, 0.1), (SEEN_REPLICAS, before)
    (new,) = SEEN_REPLICAS - before
    assert len(engine_pids(new)) == 1 and not engine_pids(victim)


def test_a_stalled_engine_fails_the_health_check_and_its_streams_end_once(app_url):
    """An engine that stops answering (SIGSTOP: a hung process): its stream ends with one error
    within the replica's reply timeout, the health check fails and Ray replaces the replica;
    the stopped engine does not outlive it."""
    response = open_stream(app_url, {"prompt": "stalled story", "max_tokens": 480, "ignore_eos": True})
    replica = response.headers[REPLICA_HEADER]
    assert response.readline().startswith(b"data: ")
    (pid,) = engine_pids(replica)
    before = set(SEEN_REPLICAS)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    events = sse_events(response.read())
    ended = time.monotonic() - stopped
    errors = [e for e in events if "error" in e]
    assert events[-1] == "[DONE]" and len(errors) == 1, events[-3:]
    assert ended < 20, ended

    def a_new_replica_answers() -> bool:
        post(app_url, "/v1/completions", {"prompt": f"after stall {time.monotonic()}", "max_tokens": 2})
        return bool(SEEN_REPLICAS - before)

    assert wait_until(a_new_replica_answers, 90, 0.2), (SEEN_REPLICAS, before)
    assert wait_until(lambda: not engine_pids(replica), 60, 0.5), "the stopped engine outlived its replica"
