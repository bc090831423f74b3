"""Issue 55, the HTTP gateway's part ("a newcomer's second hour"), over real sockets on 127.0.0.1
(free ports only): a malformed --upstream or a busy --listen is one line, not a hang or a
traceback; the port of `serve --http` answers 503 "loading" at once while the model loads; every
request leaves a log line that names the ids the client and the server see; the API port's
/metrics carries the engine's series, and one address for --http and --metrics binds once;
GET /v1/models/{id}; an upstream known to be down is a 503 at once.  The request fields of the
issue (messages without content, max_tokens' range, vLLM's extensions): test_gateway_options_55.py."""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ringleader.hostctl.commands.http_fronts import HttpFronts
from ringleader.hostctl.gateway.app import CONNECT_GRACE_S, BackgroundGateway
from tests.conftest import running_server, wait_until

RL = [sys.executable, "-m", "ringleader.hostctl.cli"]
PROMPT_IDS = list(range(40, 60))


def free_port() -> int:
    """A port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, method: str = "GET", body: dict | None = None, headers=None, timeout: float = 30):
    """(status, parsed JSON or text, headers) of one request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw, got = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, raw, got = e.code, e.read(), e.headers
    try:
        return status, json.loads(raw), got
    except ValueError:
        return status, raw.decode(), got


# ---------------------------------------------------------------- 1. the command's mistakes


def gateway_command(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(RL + ["gateway", *args], capture_output=True, text=True, timeout=timeout)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("upstream", ["127.0.0.1:{port}", "tcp://127.0.0.1", "inproc://server"])
def test_a_malformed_upstream_is_one_line_naming_the_flag(upstream):
    """It hung for ever before (a socket left open kept ZeroMQ's Context.term waiting)."""
    started = time.monotonic()
    out = gateway_command(
        "--upstream", upstream.format(port=free_port()), "--listen", "127.0.0.1:0", "--startup-timeout", "2"
    )
    assert out.returncode == 2 and time.monotonic() - started < 20
    line = one_line(out.stderr)
    assert line.startswith("ringleader gateway: --upstream: ")
    if upstream.startswith("127"):
        assert "it needs a transport, e.g. tcp://127.0.0.1:" in line


def test_the_startup_timeout_ends_a_gateway_whose_upstream_never_answers():
    started = time.monotonic()
    out = gateway_command(
        "--upstream", f"tcp://127.0.0.1:{free_port()}", "--listen", "127.0.0.1:0", "--startup-timeout", "1"
    )
    assert out.returncode == 2 and time.monotonic() - started < 20
    assert "no ringleader server answered at tcp://127.0.0.1:" in one_line(out.stderr)


def test_a_busy_listen_port_is_one_line_naming_the_flag():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = gateway_command("--upstream", f"tcp://127.0.0.1:{free_port()}", "--listen", f"127.0.0.1:{port}")
    assert out.returncode == 2
    assert one_line(out.stderr) == (
        f"ringleader gateway: --listen 127.0.0.1:{port}: cannot bind: the port is in use "
        "(another server there?); choose another port"
    )


# ---------------------------------------------------------------- 2. the port while the model loads


def test_the_http_port_answers_loading_at_once_until_the_server_exists():
    """serve binds --http before the model loads (HttpFronts); that port answered nothing until
    the load ended (/health waited ~50 s for SmolLM2 on a GPU).  Now every route answers at once."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    fronts = HttpFronts(f"127.0.0.1:{port}", None)
    try:
        started = time.monotonic()
        status, body, _ = http(url + "/health", timeout=2)
        assert time.monotonic() - started < 2
        assert status == 503 and body["status"] == "loading"
        assert body["error"]["code"] == "loading" and "loading" in body["error"]["message"]
        for method, path, payload in (
            ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("GET", "/v1/models", None),
        ):
            status, body, _ = http(url + path, method, payload, timeout=2)
            assert status == 503, path
            assert body["error"]["message"] == "the model is loading"
            assert body["error"]["type"] == "service_unavailable"
        assert http(url + "/metrics", timeout=2)[0] == 200  # the gateway's own series, meanwhile
        with running_server("tiny", n_slots=4, max_ctx=512) as bg:  # the load ends: the server exists
            fronts.start(bg.server, served_model_name=None, api_key=None)
            status, body, _ = http(url + "/health", timeout=10)
            assert status == 200 and body["status"] == "ok"
            status, body, _ = http(url + "/v1/completions", "POST", {"prompt": PROMPT_IDS, "max_tokens": 3})
            assert status == 200 and body["model"] == "tiny" and body["usage"]["prompt_tokens"] == 20
            fronts.close()
    finally:
        fronts.close()


def test_serve_http_answers_health_at_once_while_the_real_model_loads(smollm2_gguf):
    """`serve --http` on the real model (a load of seconds): from the moment its port is bound,
    /health answers within 2 s, 503 loading, until it answers 200."""
    port = free_port()
    proc = subprocess.Popen(
        RL
        + [
            "serve",
            "--model",
            str(smollm2_gguf),
            "--bind",
            "tcp://127.0.0.1:0",
            "--http",
            f"127.0.0.1:{port}",
        ],
        stderr=subprocess.DEVNULL,
    )
    answers: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and answers[-1:] != [200]:
            try:
                status, body, _ = http(f"http://127.0.0.1:{port}/health", timeout=2)
            except urllib.error.URLError as exc:  # not bound yet
                assert isinstance(exc.reason, ConnectionRefusedError), exc
                assert proc.poll() is None
                time.sleep(0.05)
                continue
            assert status == 200 or (status == 503 and body["status"] == "loading"), body
            answers.append(status)
            time.sleep(0.1)
        assert answers[-1] == 200 and 503 in answers, answers
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


# ---------------------------------------------------------------- 3. log lines that match


def gateway_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ringleader.gateway"]


def test_a_request_line_names_the_response_id_and_the_request_id(server, gateway, caplog):
    caplog.set_level(logging.INFO)
    status, body, headers = http(
        gateway.url + "/v1/completions",
        "POST",
        {"prompt": PROMPT_IDS, "max_tokens": 4, "ignore_eos": True},
        {"X-Request-Id": "newcomer-55"},
    )
    assert status == 200 and headers["X-Request-Id"] == "newcomer-55"
    rid = body["id"]
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", rid)
    # the gateway's line: method, path, status, both ids, how it ended
    assert wait_until(lambda: any(rid in line for line in gateway_lines(caplog)), 5)
    line = next(line for line in gateway_lines(caplog) if rid in line)
    assert line.startswith(
        f"POST /v1/completions 200 {rid} (X-Request-Id newcomer-55): length, 20 prompt + 4"
    )
    # the server's line names the same id: it is the upstream request's
    assert wait_until(lambda: any(f"request {rid!r}" in r.getMessage() for r in caplog.records), 5)


def test_several_choices_are_told_by_index_and_a_stream_echoes_the_id(gateway, caplog):
    caplog.set_level(logging.INFO)
    r = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    raw = r.completions.with_raw_response.create(
        model="tiny", prompt=PROMPT_IDS, n=2, max_tokens=3, seed=1, extra_body={"ignore_eos": True}
    )
    whole = raw.parse()
    assert raw.headers["x-request-id"]  # made by the gateway: the client sent none
    assert wait_until(lambda: any(whole.id in line for line in gateway_lines(caplog)), 5)
    line = next(line for line in gateway_lines(caplog) if whole.id in line)
    assert f"(X-Request-Id {raw.headers['x-request-id']}): choice 0 length, choice 1 length;" in line
    stream = r.completions.with_raw_response.create(
        model="tiny", prompt=PROMPT_IDS, max_tokens=2, stream=True, extra_headers={"X-Request-Id": "s-1"}
    )
    assert stream.headers["x-request-id"] == "s-1"
    chunks = list(stream.parse())
    assert wait_until(
        lambda: any(chunks[0].id in line and "TTFT" in line for line in gateway_lines(caplog)), 5
    )


def test_a_refused_request_is_logged_at_info_with_its_reason(gateway, caplog):
    caplog.set_level(logging.INFO)
    status, body, headers = http(
        gateway.url + "/v1/completions", "POST", {"prompt": "x", "max_tokens": 0}, {"X-Request-Id": "bad-1"}
    )
    assert status == 400 and headers["X-Request-Id"] == "bad-1"
    records = [r for r in caplog.records if r.name == "ringleader.gateway" and "bad-1" in r.getMessage()]
    assert records and records[0].levelno == logging.INFO
    assert (
        records[0]
        .getMessage()
        .startswith(f"POST /v1/completions 400 (X-Request-Id bad-1): {body['error']['message']}, total ")
    )


def _read_lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)


def test_the_gateway_command_logs_a_line_per_request_at_info(server):
    """`--log-level`'s help promised a line per request for `gateway` too: it logged none."""
    proc = subprocess.Popen(
        RL + ["gateway", "--upstream", server.address, "--listen", "127.0.0.1:0"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True).start()

    def wait_for(pattern: str, timeout: float = 60) -> str:
        deadline, seen = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.append(line)
            if re.search(pattern, line):
                return line
        pytest.fail(f"no line matching {pattern!r} in:\n{''.join(seen)}")

    try:
        url = re.search(r"openai gateway at (http://\S+)", wait_for("openai gateway at")).group(1)
        _, body, _ = http(
            url + "/v1/completions", "POST", {"prompt": [1, 2, 3], "max_tokens": 2}, {"X-Request-Id": "cli-1"}
        )
        line = wait_for(re.escape(body["id"]))
        assert " INFO ringleader.gateway: POST /v1/completions 200 " in line and "X-Request-Id cli-1" in line
        status, _, _ = http(
            url + "/v1/completions", "POST", {"prompt": "x", "n": 0}, {"X-Request-Id": "cli-2"}
        )
        assert status == 400
        assert "n: must be an int" in wait_for(r"POST /v1/completions 400 \(X-Request-Id cli-2\)")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


# ---------------------------------------------------------------- 4. the engine's metrics on the API port


def families(url: str) -> dict[str, list]:
    status, text, _ = http(url + "/metrics")
    assert status == 200
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in out, f"{family.name} twice in one exposition"
        out[family.name] = family.samples
    return out


def test_the_api_ports_metrics_carry_the_engines_beside_the_gateways():
    api, metrics = free_port(), free_port()
    fronts = HttpFronts(f"127.0.0.1:{api}", f"127.0.0.1:{metrics}")
    try:
        with running_server("tiny", n_slots=4, max_ctx=512) as bg:
            fronts.start(bg.server, served_model_name=None, api_key=None)
            status, _, _ = http(
                f"http://127.0.0.1:{api}/v1/completions", "POST", {"prompt": [1, 2], "max_tokens": 2}
            )
            assert status == 200
            on_api = families(f"http://127.0.0.1:{api}")
            assert "ringleader:gateway_requests" in on_api  # the gateway's own stay
            for engine in (
                "ringleader:num_requests_running",
                "ringleader:kv_cache_usage_perc",
                "process_cpu_seconds",
            ):
                assert engine in on_api, engine
            on_metrics = families(f"http://127.0.0.1:{metrics}")
            assert (
                "ringleader:num_requests_running" in on_metrics
                and "ringleader:gateway_requests" not in on_metrics
            )
            fronts.close()
    finally:
        fronts.close()


def test_one_address_for_http_and_metrics_is_bound_once():
    port = free_port()
    fronts = HttpFronts(f"127.0.0.1:{port}", f"127.0.0.1:{port}")  # bound twice before: EADDRINUSE
    try:
        with running_server("tiny", n_slots=4, max_ctx=512) as bg:
            fronts.start(bg.server, served_model_name="tiny", api_key=None)
            url = f"http://127.0.0.1:{port}"
            assert http(url + "/v1/completions", "POST", {"prompt": [1, 2], "max_tokens": 2})[0] == 200
            both = families(url)
            assert "ringleader:gateway_requests" in both and "ringleader:requests_accepted" in both
            fronts.close()
    finally:
        fronts.close()


# ---------------------------------------------------------------- 5. GET /v1/models/{id}


def test_a_model_is_retrieved_by_its_id(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
    model = client.models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "ringleader")
    assert model.model_extra["max_model_len"] == 512
    for other in ("gpt-4", "org/tiny"):  # an id may hold a "/"
        status, body, _ = http(f"{gateway.url}/v1/models/{other}")
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert body["error"]["param"] == "model" and repr(other) in body["error"]["message"]


def test_a_served_name_with_a_slash_is_retrieved(server):
    with BackgroundGateway(server.address, served_model_name="org/tiny-55") as gw:
        status, body, _ = http(gw.url + "/v1/models/org/tiny-55")
        assert status == 200 and body["id"] == "org/tiny-55"


# ---------------------------------------------------------------- 7. an upstream known to be down


def test_a_generation_on_a_known_down_upstream_is_503_at_once():
    """It waited out the client's connect timeout (10 s) before its 503."""
    options = dict(served_model_name="m", max_model_len=64, has_tokenizer=True)  # connect_timeout_s: 10
    with BackgroundGateway(f"tcp://127.0.0.1:{free_port()}", **options) as gw:
        time.sleep(CONNECT_GRACE_S)
        started = time.monotonic()
        status, body, _ = http(gw.url + "/health", timeout=5)
        assert status == 503 and "no connection" in body["error"]["message"]
        for path, payload in (
            ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}),
        ):
            status, body, _ = http(gw.url + path, "POST", payload, timeout=5)
            assert status == 503 and body["error"]["code"] == "disconnected", body
        assert time.monotonic() - started < 2


def test_a_server_that_goes_away_is_503_at_once():
    with running_server("tiny", n_slots=4, max_ctx=512) as bg:
        gw = BackgroundGateway(bg.server.address).start()
        assert http(gw.url + "/v1/completions", "POST", {"prompt": [1], "max_tokens": 1})[0] == 200
    try:  # the server stopped: its connection is gone, and the gateway knows it
        started = time.monotonic()
        status, body, _ = http(
            gw.url + "/v1/completions", "POST", {"prompt": [1], "max_tokens": 1}, timeout=5
        )
        assert status == 503 and body["error"]["code"] == "disconnected"
        assert time.monotonic() - started < 2
    finally:
        gw.stop()
