"""The OpenAI-compatible gateway with the official `openai` client, over real sockets on 127.0.0.1:
HTTP in front of a real server, streaming and not, chat on the real model, errors in OpenAI's
shape, a disconnect that frees its slot, the gateway's own metrics, and the CLI."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ringleader.hostctl.gateway.app import BackgroundGateway
from ringleader.ipc.client import Client
from tests.conftest import RawPeer, running_server, wait_until

PROMPT_IDS = list(range(40, 60))


def api(gw: BackgroundGateway, **options) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gw.url + "/v1", api_key=options.pop("api_key", "none"), max_retries=0, **options
    )


def native(server, **kwargs):
    with Client(server.address, timeout=60) as c:
        stream = c.generate(**kwargs)
        ids, text = [], []
        for chunk in stream:
            ids += chunk.token_ids
            text.append(chunk.text or "")
        return ids, "".join(text), stream.done


def http(gw: BackgroundGateway, method: str, path: str, body: bytes | None = None, headers=None):
    req = urllib.request.Request(gw.url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape(gw: BackgroundGateway) -> dict[tuple[str, tuple], float]:
    status, text = http(gw, "GET", "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


GREEDY = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


def test_completion_is_the_native_clients(server, gateway):
    ids, text, done = native(server, prompt_ids=PROMPT_IDS, max_tokens=12, ignore_eos=True)
    r = api(gateway).completions.create(model="tiny", prompt=PROMPT_IDS, **GREEDY)
    choice = r.choices[0]
    assert choice.text == text and choice.model_extra["token_ids"] == ids
    assert choice.finish_reason == "length" and r.object == "text_completion" and r.model == "tiny"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (20, 12, 32)
    assert done.prompt_tokens == 20


def test_streamed_completion_with_usage(server, gateway):
    ids, text, _ = native(server, prompt="Hello there", max_tokens=12, ignore_eos=True)
    stream = api(gateway).completions.create(
        model="tiny", prompt="Hello there", stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    *tokens, finish, last = chunks
    assert "".join(c.choices[0].text for c in tokens) == text
    assert [t for c in tokens for t in c.choices[0].model_extra["token_ids"]] == ids
    assert all(c.choices[0].finish_reason is None for c in tokens)
    assert finish.choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 12 and last.usage.prompt_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_the_gateway_carries_its_streams_in_batch_frames(server, gateway):
    """The gateway is one connection carrying many streams: it says hello (protocol 1.7), and
    concurrent requests through it end as the native client's."""
    ids, text, _ = native(server, prompt_ids=PROMPT_IDS, max_tokens=12, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(
            pool.map(
                lambda _: api(gateway).completions.create(model="tiny", prompt=PROMPT_IDS, **GREEDY), range(6)
            )
        )
    assert all(r.choices[0].text == text and r.choices[0].model_extra["token_ids"] == ids for r in results)
    upstream = gateway.gateway._client
    assert upstream is not None and upstream.batched  # the server answered its hello


def test_stream_without_usage_ends_with_finish(gateway):
    stream = api(gateway).completions.create(
        model="tiny", prompt=PROMPT_IDS, max_tokens=5, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert all(c.usage is None for c in chunks)


def test_a_stop_string_cuts_the_text_and_ends_upstream_as_a_stop(server, gateway):
    client = api(gateway)
    full = client.completions.create(model="tiny", prompt=PROMPT_IDS, **{**GREEDY, "max_tokens": 40})
    text = full.choices[0].text
    k = next(i for i in range(3, len(text) - 2) if text.find(text[i : i + 2]) == i)
    stop = text[k : k + 2]
    before = server.server.stats()["finished"]
    cut = client.completions.create(
        model="tiny", prompt=PROMPT_IDS, stop=[stop], **{**GREEDY, "max_tokens": 40}
    )
    assert cut.choices[0].text == text[:k] and cut.choices[0].finish_reason == "stop"
    assert 0 < cut.usage.completion_tokens < 40 and cut.usage.prompt_tokens == 20
    streamed = list(
        client.completions.create(
            model="tiny", prompt=PROMPT_IDS, stop=stop, stream=True, **{**GREEDY, "max_tokens": 40}
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == text[:k]
    assert streamed[-1].choices[0].finish_reason == "stop"
    # the server stopped both on the gateway's word: counted as stops, not as aborts
    assert wait_until(lambda: server.server.stats()["in_flight"] == 0)
    after = server.server.stats()["finished"]
    assert after.get("stop", 0) == before.get("stop", 0) + 2
    assert after.get("abort", 0) == before.get("abort", 0)


def test_validation_errors_are_400_naming_the_field(gateway):
    client = api(gateway)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=10_000)
    assert info.value.status_code == 400 and info.value.body["param"] == "max_tokens"
    assert info.value.body["code"] == "bad_request"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", best_of=2)
    assert info.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as info:  # the server's check, through the gateway
        client.completions.create(model="tiny", prompt=[1, 10**9])
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:  # tiny has no chat template
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    status, body = http(
        gateway, "POST", "/v1/completions", b"{not json", {"Content-Type": "application/json"}
    )
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    status, body = http(gateway, "GET", "/v1/nothing")
    assert status == 404 and "error" in json.loads(body)


def test_float_fields_fit_float32_with_the_protocols_range(server, gateway):
    client = api(gateway)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=2, temperature=1e308)
    body = info.value.body
    assert body["param"] == "temperature"
    assert body["message"] == "temperature: must be a finite number in [0, 3.4028235e+38], got 1e+308"
    # the native protocol refuses it with the same words (a raw peer: the bundled client refuses
    # it before sending)
    peer = RawPeer(server.address)
    try:
        peer.send(
            {"op": "generate", "id": 1, "prompt_ids": PROMPT_IDS, "max_tokens": 2, "temperature": 1e308}
        )
        done = peer.recv_until(lambda m: m["op"] == "done")[-1]
    finally:
        peer.close()
    assert done["error"] == {"code": "bad_request", "message": body["message"]}
    # vLLM's range, not OpenAI's 0..2: a hot temperature is served
    hot = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=3, temperature=5, seed=1)
    assert hot.usage.completion_tokens >= 1


def test_new_sampling_fields_are_served_and_unknown_ones_refused(gateway):
    """Protocol 1.4 through the official client: min_p (vLLM's, in extra_body) and the penalties
    are honoured; a knob of another server is a 400 naming it, not silently dropped."""
    client = api(gateway)
    penalized = client.completions.create(
        model="tiny",
        prompt=PROMPT_IDS,
        max_tokens=6,
        temperature=0.8,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        extra_body={"min_p": 0.1, "repetition_penalty": 1.3, "top_k": -1, "ignore_eos": True},
        user="someone",
    )
    assert penalized.usage.completion_tokens == 6
    for name, value in (("mirostat", 2), ("typical_p", 0.9), ("min_p", 1.5)):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=2, extra_body={name: value})
        assert info.value.status_code == 400 and info.value.body["param"] == name
    # Python's JSON parser takes NaN, which the official client never sends: still a 400
    body = b'{"model": "tiny", "prompt": [1, 2], "max_tokens": 2, "presence_penalty": NaN}'
    status, reply = http(gateway, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 400 and json.loads(reply)["error"]["param"] == "presence_penalty"


# each new field through the official client, as its users write it: OpenAI's own parameters as
# keywords, vLLM's extensions in extra_body
NEW_FIELDS = {
    "min_p": ({}, {"min_p": 0.2}),
    "presence_penalty": ({"presence_penalty": 1.5}, {}),
    "frequency_penalty": ({"frequency_penalty": -1.0}, {}),
    "repetition_penalty": ({}, {"repetition_penalty": 1.5}),
}


@pytest.mark.parametrize("name", sorted(NEW_FIELDS))
def test_each_new_field_through_the_official_client_equals_the_native_client(server, gateway, name):
    """Honoured, not only accepted: a seeded request with the field gives the native client's
    tokens for the same settings, streamed and not, and differs from the same seed without it."""
    keywords, extra = NEW_FIELDS[name]
    settings = {**keywords, **extra}
    want, _, _ = native(
        server, prompt_ids=PROMPT_IDS, max_tokens=10, temperature=1.2, seed=5, ignore_eos=True, **settings
    )
    without, _, _ = native(
        server, prompt_ids=PROMPT_IDS, max_tokens=10, temperature=1.2, seed=5, ignore_eos=True
    )
    assert want != without, f"{name} must change the seeded tokens to be a real test"
    client = api(gateway)
    body = dict(model="tiny", prompt=PROMPT_IDS, max_tokens=10, temperature=1.2, seed=5, **keywords)
    extra_body = {**extra, "ignore_eos": True, "return_token_ids": True}
    whole = client.completions.create(**body, extra_body=extra_body)
    assert whole.choices[0].model_extra["token_ids"] == want
    chunks = list(client.completions.create(**body, extra_body=extra_body, stream=True))
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []] == want


def test_stop_token_ids_through_the_official_client(server, gateway):
    free, _, _ = native(server, prompt_ids=PROMPT_IDS, max_tokens=12, ignore_eos=True)
    stop = free[5]
    client = api(gateway)
    extra = {"stop_token_ids": [stop], "return_token_ids": True}
    for stream in (False, True):
        r = client.completions.create(
            model="tiny", prompt=PROMPT_IDS, max_tokens=12, temperature=0, extra_body=extra, stream=stream
        )
        chunks = list(r) if stream else [r]
        ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
        assert ids == free[: free.index(stop) + 1]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_models_and_health(gateway):
    models = api(gateway).models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].model_extra["max_model_len"] == 512
    status, body = http(gateway, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_overloaded_is_429():
    with running_server("tiny", n_slots=4, max_ctx=512, server_options={"max_inflight_per_client": 1}) as srv:
        with BackgroundGateway(srv.address) as gw:
            client = api(gw)
            long = client.completions.create(
                model="tiny", prompt=PROMPT_IDS, max_tokens=480, stream=True, extra_body={"ignore_eos": True}
            )
            next(iter(long))  # the gateway's one allowed request is in flight
            with pytest.raises(openai.RateLimitError) as info:
                client.completions.create(model="tiny", prompt="x", max_tokens=2)
            assert info.value.status_code == 429 and info.value.body["code"] == "overloaded"
            long.close()


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server, gateway):
    stats = server.server.stats
    before, metrics_before = stats(), scrape(gateway)
    stream = api(gateway).completions.create(
        model="tiny", prompt=PROMPT_IDS, max_tokens=480, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    next(it), next(it)
    stream.close()  # the HTTP connection goes; nothing is read any more
    assert wait_until(lambda: stats()["in_flight"] == 0)
    after = stats()
    assert after["finished"].get("abort", 0) == before["finished"].get("abort", 0) + 1
    assert after["output_tokens"] - before["output_tokens"] < 480  # it did not run to the end
    key = ("ringleader:gateway_client_disconnects_total", ())
    assert wait_until(lambda: scrape(gateway)[key] == metrics_before.get(key, 0) + 1)


def test_gateway_metrics_count_requests_and_tokens(gateway):
    before = scrape(gateway)
    client = api(gateway)
    for _ in range(2):
        client.completions.create(model="tiny", prompt=PROMPT_IDS, **GREEDY)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", n=0)
    after = scrape(gateway)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    route = "/v1/completions"
    assert delta("ringleader:gateway_requests_total", route=route, status="200") == 2
    assert delta("ringleader:gateway_requests_total", route=route, status="400") == 1
    assert delta("ringleader:gateway_generation_tokens_total") == 24
    assert delta("ringleader:gateway_prompt_tokens_total") == 40
    assert delta("ringleader:gateway_request_duration_seconds_count", route=route) == 3
    assert after[("ringleader:gateway_requests_in_progress", (("route", route),))] == 0
    assert ("process_cpu_seconds_total", ()) in after


def test_unrouted_paths_share_one_metrics_label(gateway):
    rng = random.Random(7)
    for i in range(300):
        path = f"/v1/{rng.getrandbits(64):x}/{i}"
        assert http(gateway, "GET", path)[0] == 404
    assert http(gateway, "GET", "/v1/completions")[0] == 405  # a known path, another method
    assert http(gateway, "POST", "/v1/completions/")[0] == 404
    metrics = scrape(gateway)
    routes = {
        dict(labels)["route"]
        for (name, labels) in metrics
        if name.startswith("ringleader:gateway_") and "route" in dict(labels)
    }
    # the registered routes and one label for everything else, however many paths were tried
    assert routes <= {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/metrics",
        "unmatched",
    }
    assert "unmatched" in routes
    unmatched = metrics[("ringleader:gateway_requests_total", (("route", "unmatched"), ("status", "404")))]
    assert unmatched >= 301
    assert metrics[("ringleader:gateway_requests_total", (("route", "unmatched"), ("status", "405")))] >= 1
    series = [key for key in metrics if key[0] == "ringleader:gateway_requests_total"]
    assert len(series) < 20


def test_an_unreachable_upstream_is_503():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens here once closed
    options = dict(served_model_name="m", max_model_len=64, has_tokenizer=True, connect_timeout_s=0.5)
    with BackgroundGateway(f"tcp://127.0.0.1:{port}", **options) as gw:
        with pytest.raises(openai.InternalServerError) as info:
            api(gw).completions.create(model="m", prompt="x", max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "disconnected"
        status, body = http(gw, "GET", "/health")
        assert status == 503


def test_an_api_key_is_required_when_set(server):
    with BackgroundGateway(server.address, api_key="sesame") as gw:
        with pytest.raises(openai.AuthenticationError):
            api(gw, api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
        r = api(gw, api_key="sesame").completions.create(model="tiny", prompt="x", max_tokens=2)
        assert r.usage.completion_tokens <= 2
        assert http(gw, "GET", "/health")[0] == 200  # probes need no key


# ---------------------------------------------------------------- the real model: chat


@pytest.fixture(scope="module")
def smollm2_stack(smollm2_gguf):
    with running_server(str(smollm2_gguf), n_slots=4, max_ctx=512, token_budget=16) as srv:
        with BackgroundGateway(srv.address) as gw:
            yield srv, gw


def test_chat_on_the_real_model_matches_the_native_client(smollm2_stack):
    srv, gw = smollm2_stack
    messages = [{"role": "user", "content": "Name the capital of France."}]
    ids, text, done = native(srv, messages=messages, max_tokens=24)
    client = api(gw)
    name = client.models.list().data[0].id
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == text and "Paris" in text
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.choices[0].finish_reason == done.finish_reason == "stop"
    assert r.usage.prompt_tokens == done.prompt_tokens and r.usage.completion_tokens == len(ids)
    chunks = list(
        client.chat.completions.create(
            model=name,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == len(ids)


def test_chat_with_every_new_field_through_the_official_client(smollm2_stack):
    """Chat, streamed and not, with min_p and the three penalties at once: the native client's
    tokens for the same seeded settings."""
    srv, gw = smollm2_stack
    messages = [{"role": "user", "content": "List five fruits, one per line."}]
    penalties = dict(presence_penalty=0.8, frequency_penalty=0.6)
    extra = {"min_p": 0.1, "repetition_penalty": 1.3}
    want, text, _ = native(
        srv, messages=messages, max_tokens=20, temperature=0.9, seed=11, **penalties, **extra
    )
    plain, _, _ = native(srv, messages=messages, max_tokens=20, temperature=0.9, seed=11)
    assert want != plain
    client = api(gw)
    body = dict(
        model=client.models.list().data[0].id, messages=messages, max_tokens=20, temperature=0.9, seed=11
    )
    r = client.chat.completions.create(**body, **penalties, extra_body={**extra, "return_token_ids": True})
    assert r.choices[0].message.content == text and r.choices[0].model_extra["token_ids"] == want
    chunks = list(client.chat.completions.create(**body, **penalties, extra_body=extra, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(smollm2_stack):
    srv, gw = smollm2_stack
    client = api(gw)
    name = client.models.list().data[0].id
    # a long prompt: with the old default of 256 tokens it did not fit a 512-token context
    question = "Count the words: " + " ".join(["apple"] * 420) + ". How many?"
    messages = [{"role": "user", "content": question}]
    r = client.chat.completions.create(
        model=name, messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    prompt_tokens = r.usage.prompt_tokens
    assert 256 < prompt_tokens < 500
    assert r.usage.completion_tokens == 512 - prompt_tokens and r.choices[0].finish_reason == "length"
    # a prompt that fills the context is refused naming it
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": " ".join(["apple"] * 600)}]
        )
    assert info.value.body["param"] == "messages" and "leaves no room" in info.value.body["message"]


def test_stop_strings_on_real_text(smollm2_stack):
    _, gw = smollm2_stack
    client = api(gw)
    name = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Name the capital of France."}]
    full = client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert " is " in text
    cut = client.chat.completions.create(
        model=name, messages=messages, max_tokens=24, temperature=0, stop=[" is "]
    )
    assert cut.choices[0].message.content == text.split(" is ")[0]
    assert cut.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- the command line


def _start(
    cmd: list[str], wanted: list[str], timeout: float = 120.0
) -> tuple[subprocess.Popen, dict[str, str]]:
    """Starts a ringleader process and reads its stderr until every wanted URL line is seen."""
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    found: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    lines = []
    assert proc.stderr is not None
    while len(found) < len(wanted) and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        for what in wanted:
            m = re.search(rf"{what} at (http://\S+)", line)
            if m:
                found[what] = m.group(1)
    if len(found) < len(wanted):
        proc.kill()
        pytest.fail(f"{cmd} did not print {wanted}:\n{''.join(lines)}")
    return proc, found


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_serve_with_http_and_the_gateway_command(server):
    rl = [sys.executable, "-m", "ringleader.hostctl.cli"]
    serve, urls = _start(
        rl + ["serve", "--model", "tiny", "--bind", "tcp://127.0.0.1:0", "--http", "127.0.0.1:0"],
        ["openai gateway"],
    )
    try:
        out = _post(urls["openai gateway"] + "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
        assert out["usage"]["completion_tokens"] <= 3 and out["model"] == "tiny"
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
    gw, urls = _start(
        rl + ["gateway", "--upstream", server.address, "--listen", "127.0.0.1:0"], ["openai gateway"]
    )
    try:
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}
        out = _post(urls["openai gateway"] + "/v1/completions", body)
        assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    finally:
        gw.send_signal(signal.SIGTERM)
        assert gw.wait(timeout=30) == 0
