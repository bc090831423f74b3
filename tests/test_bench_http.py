"""`ringleader bench --http` and `--compare gateway`: the HTTP load generator (bench/http_loadgen.py)
against a real gateway in front of a real server, and against a hand-written SSE server, all on
127.0.0.1 sockets; the gateway/native overhead table."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from ringleader.bench import cli
from ringleader.bench.http_loadgen import (
    TEXT_CHUNKS,
    TOKEN_IDS,
    HttpLoadGenerator,
    base_url,
    error_code_for,
    list_models,
    measure_http,
)
from ringleader.bench.loadgen import Load, SendOptions
from ringleader.bench.options import check_options
from ringleader.bench.report import make_run_entry
from ringleader.bench.report_comparisons import gateway_overhead
from ringleader.bench.report_markdown import markdown_summary
from ringleader.bench.report_tables import format_overhead
from ringleader.bench.servers import plan_variants
from ringleader.bench.workloads import RequestSpec, WorkloadConfig, arrival_times, make_requests
from tests.conftest import running_server

REPO = Path(__file__).resolve().parent.parent
IGNORE_EOS = SendOptions(ignore_eos=True)


@pytest.fixture(scope="module")
def gateway():
    """(server, gateway): a tiny CPU server and a BackgroundGateway in front of it."""
    from ringleader.hostctl.gateway.app import BackgroundGateway

    with running_server() as server, BackgroundGateway(server.address, host="127.0.0.1", port=0) as gw:
        yield server, gw


def _specs(n, input_len=8, output_len=8, seed=0, dist="fixed"):
    return make_requests(WorkloadConfig(n, input_len, output_len, dist, seed=seed))


def _check_streams(records, specs):
    assert len(records) == len(specs)
    for rec, spec in zip(records, specs):
        assert rec.ok, (rec.finish_reason, rec.error_code, rec.error_message)
        assert rec.finish_reason == "length" and rec.error_code is None
        # ignore_eos: exactly max_tokens, counted from token_ids and reported by usage alike
        assert rec.output_tokens == spec.max_tokens == rec.completion_tokens
        times = rec.token_times()
        assert len(times) >= 1 and times[0] > rec.send_t
        assert all(b >= a for a, b in zip(rec.chunk_t, rec.chunk_t[1:]))  # in arrival order
        assert rec.done_t >= rec.chunk_t[-1]
        assert rec.ttft() > 0 and rec.e2e() >= rec.ttft()


# ---------------------------------------------------------------- against the real gateway


def test_closed_loop_through_the_gateway(gateway):
    server, gw = gateway
    specs = _specs(8, dist="uniform")
    assert list_models(gw.url) == [server.server.backend.model.name]
    result = measure_http(
        gw.url + "/v1/",  # the base URL, with or without /v1
        specs,
        Load(concurrency=3),
        warmup=_specs(2, seed=1),
        options=IGNORE_EOS,
        stats_address=server.address,
    )
    _check_streams(result.records, specs)
    assert result.token_count == TOKEN_IDS and result.model == list_models(gw.url)[0]
    assert result.warmup_failed == 0 and result.send_lag_ms == {}
    assert result.loadgen_cpu_s > 0 and result.wall_s > 0
    # stats from the server behind the gateway, around the measured requests only
    done = result.stats_after["output_tokens"] - result.stats_before["output_tokens"]
    assert done == sum(s.max_tokens for s in specs)
    entry = make_run_entry(
        scheduler="gateway",
        device="cpu",
        model="tiny",
        load=Load(concurrency=3),
        result=result,
        burstiness=None,
    )
    assert entry["completed"] == 8 and entry["failed"] == 0 and entry["cpu_s_per_1k_tokens"] > 0
    assert entry["output_tokens"] == sum(s.max_tokens for s in specs)


def test_open_loop_through_the_gateway(gateway):
    _, gw = gateway
    specs = _specs(6)
    load = Load(request_rate=40.0, arrival_s=arrival_times(6, 40.0, 1.0, seed=3).tolist())
    result = measure_http(gw.url, specs, load, options=IGNORE_EOS)
    _check_streams(result.records, specs)
    assert result.stats_before == {} and result.stats_after == {}  # HTTP alone has no stats
    assert result.send_lag_ms["p50"] is not None and len(result.records) == 6
    sends = [r.send_t for r in result.records]
    assert sends == sorted(sends)  # sent in arrival order


def test_errors_through_the_gateway_are_recorded_with_their_code(gateway):
    _, gw = gateway
    ok = _specs(1)[0]
    too_long = dataclasses.replace(ok, max_tokens=600)  # beyond the 512-token context
    result = measure_http(gw.url, [too_long, ok], Load(concurrency=1), options=IGNORE_EOS)
    bad, good = result.records
    assert not bad.ok and bad.finish_reason == "error" and bad.error_code == "http_400"
    assert "max_tokens" in bad.error_message and "HTTP 400" in bad.error_message
    assert bad.output_tokens == 0 and bad.done_t is not None
    assert good.ok and good.output_tokens == 8  # the connection goes on serving
    m = make_run_entry(
        scheduler="http", device="?", model="tiny", load=Load(concurrency=1), result=result, burstiness=None
    )
    assert m["errors"] == {"http_400": 1} and m["completed"] == 1
    other = measure_http(gw.url, [ok], Load(concurrency=1), model="not-served")
    assert other.records[0].error_code == "http_404"


def test_bench_http_option_against_a_running_gateway(gateway, tmp_path):
    _, gw = gateway
    path = tmp_path / "r.json"
    args = ["--http", gw.url, "--concurrency", "2", "--requests", "4", "--input-len", "6"]
    args += ["--output-len", "5", "--ignore-eos", "--warmup", "1", "--json", str(path), "--quiet"]
    assert cli.main(args) == 0
    doc = json.loads(path.read_text())
    (run,) = doc["runs"]
    assert run["scheduler"] == "http" and run["completed"] == 4 and run["output_tokens"] == 20
    assert run["transport"] == "http" and run["token_count"] == TOKEN_IDS
    assert run["model"] == doc["model"] == "tiny" and run["cpu_s_per_1k_tokens"] is None
    assert doc["gateway_overhead"] == [] and any("token_ids" in n for n in doc["notes"])
    assert cli.main([*args[:2], "--label", "mine", "--http-model", "tiny", *args[2:]]) == 0
    assert json.loads(path.read_text())["runs"][0]["scheduler"] == "mine"


# ---------------------------------------------------------------- a hand-written SSE server


def _chunk(text, finish=None, ids=None):
    choice = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "x", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]}


async def _sse(request: web.Request) -> web.StreamResponse:
    """The scenario is the request's `model`."""
    body = await request.json()
    scenario = body["model"]
    if scenario == "busy":
        return web.json_response({"error": {"message": "queue full", "code": "overloaded"}}, status=429)
    if scenario == "dead":
        return web.json_response({"error": {"message": "engine died", "code": "engine_dead"}}, status=503)
    if scenario == "teapot":
        return web.Response(status=418, text="no")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)

    async def event(obj, sep=b"\n\n"):
        await resp.write(b"data: " + json.dumps(obj).encode() + sep)
        await asyncio.sleep(0.002)

    if scenario == "text":  # no token_ids, CRLF line ends, an event split across two writes
        await event(_chunk("He"), b"\r\n\r\n")
        raw = b"data: " + json.dumps(_chunk("llo")).encode() + b"\r\n\r\n"
        await resp.write(raw[:9])
        await asyncio.sleep(0.01)
        await resp.write(
            raw[9:] + b": a comment\n\nevent: x\ndata: " + json.dumps(_chunk("")).encode() + b"\n\n"
        )
        await event(_chunk(" you", ids=[7, 8]))  # token_ids on one chunk: counted from them
        await event(_chunk("", "stop"))
        await event({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
    elif scenario == "midstream":
        await event(_chunk("a", ids=[1]))
        await event({"error": {"message": "engine died", "type": "server_error", "code": "engine_dead"}})
    elif scenario == "cut":
        await event(_chunk("a", ids=[1]))
        return resp  # ends with neither finish_reason nor [DONE]
    elif scenario == "garbage":
        await resp.write(b"data: {not json\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


def _against_sse_server(models: list[str]) -> dict:
    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", _sse)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        out = {}
        try:
            for model in models:
                async with HttpLoadGenerator(f"http://127.0.0.1:{port}", model=model, connections=1) as gen:
                    (rec,) = await gen.run(_specs(1), Load(concurrency=1))
                    out[model] = (rec, gen.chunks_with_ids, gen.chunks_by_text)
        finally:
            await runner.cleanup()
        return out

    return asyncio.run(go())


def test_sse_parsing_and_error_mapping():
    got = _against_sse_server(["text", "busy", "dead", "teapot", "midstream", "cut", "garbage"])
    rec, with_ids, by_text = got["text"]
    assert rec.ok and rec.finish_reason == "stop" and rec.completion_tokens == 5
    assert rec.chunk_n == [1, 1, 0, 2, 0] and rec.output_tokens == 4  # text chunks count once each
    assert (with_ids, by_text) == (1, 2)
    assert len(set(rec.chunk_t[:2])) == 2  # the split event is stamped when its end arrived
    assert got["busy"][0].error_code == "overloaded" and "queue full" in got["busy"][0].error_message
    assert got["dead"][0].error_code == "engine_dead"
    assert got["teapot"][0].error_code == "http_418" and "no" in got["teapot"][0].error_message
    mid = got["midstream"][0]
    assert (mid.finish_reason, mid.error_code, mid.output_tokens) == ("error", "engine_dead", 1)
    assert got["cut"][0].error_code == "incomplete_stream" and got["cut"][0].output_tokens == 1
    assert got["garbage"][0].error_code == "bad_reply"
    assert all(r.done_t is not None for r, _, _ in got.values())


def test_http_helpers():
    assert base_url("http://h:1/v1/") == base_url("http://h:1/") == "http://h:1"
    with pytest.raises(ValueError):
        base_url("tcp://127.0.0.1:5555")
    assert [error_code_for(s, c) for s, c in [(429, None), (503, "shutdown"), (503, None), (400, "x")]] == [
        "overloaded",
        "shutdown",
        "http_503",
        "http_400",
    ]
    assert TEXT_CHUNKS != TOKEN_IDS
    parse = cli.build_parser().parse_args
    assert check_options(parse(["--http", "http://h:1", "--compare", "host"]))
    assert check_options(parse(["--http", "http://h:1", "--connect", "tcp://h:2"]))
    assert check_options(parse(["--http-model", "m"]))
    assert cli.main(["--http", "ftp://h:1"]) == 2
    assert [v.name for v in plan_variants(["gateway"], "cpu")[0]] == ["gateway"]


def test_text_prompts_for_servers_that_take_no_ids():
    """--http-prompt-text sends the decoded text; --http-min-tokens adds min_tokens beside
    ignore_eos (llama-cpp-python's stand-in), and neither is sent otherwise."""
    spec = RequestSpec(prompt_ids=[5, 6, 7], max_tokens=9)

    def body(**kw) -> dict:
        gen = HttpLoadGenerator("http://h:1", options=IGNORE_EOS, **kw)
        return json.loads(gen._body(spec, 0))

    plain = body()
    assert plain["prompt"] == [5, 6, 7] and plain["ignore_eos"] and "min_tokens" not in plain
    text = body(decode=lambda ids: "-".join(map(str, ids)), min_tokens=True)
    assert text["prompt"] == "5-6-7" and text["min_tokens"] == 9 and text["ignore_eos"]


# ---------------------------------------------------------------- the overhead table


def _run(scheduler, c, tok_s, ttft, tpot, itl, loadgen, tokens=1000):
    stat = lambda v: {"mean": v, "p50": v, "p90": v, "p99": 2 * v}  # noqa: E731
    return {
        "scheduler": scheduler,
        "concurrency": c,
        "request_rate": None,
        "cpu_interference": 0,
        "completed": 4,
        "failed": 0,
        "request_throughput": 1.0,
        "output_tokens_per_s": tok_s,
        "output_tokens": tokens,
        "ttft_ms": stat(ttft),
        "tpot_ms": stat(tpot),
        "itl_ms": stat(itl),
        "e2e_ms": stat(ttft + 10 * tpot),
        "queue_ms": stat(0.0),
        "cpu_s_per_1k_tokens": 1.5,
        "loadgen_cpu_s": loadgen,
        "loadgen_cpu_frac": 0.1,
    }


def test_gateway_overhead_rows():
    runs = [
        _run("native", 1, 100.0, 10.0, 5.0, 5.0, 0.2),
        _run("gateway", 1, 90.0, 12.5, 5.5, 5.25, 0.6),
        _run("native", 8, 400.0, 20.0, 8.0, 8.0, 0.5, tokens=2000),
        _run("gateway", 8, 380.0, 24.0, 8.2, 8.1, 1.5, tokens=2000),
        _run("gateway", 32, 1.0, 1.0, 1.0, 1.0, 1.0),  # no native run at c=32: no row
    ]
    rows = gateway_overhead(runs)
    assert [(r["scheduler"], r["baseline"], r["concurrency"]) for r in rows] == [
        ("gateway", "native", 1),
        ("gateway", "native", 8),
    ]
    one, eight = rows
    assert one["output_tokens_per_s"] == [90.0, 100.0] and one["output_tokens_per_s_ratio"] == pytest.approx(
        0.9
    )
    assert one["ttft_ms_p50_diff"] == pytest.approx(2.5) and one["ttft_ms_p99_diff"] == pytest.approx(5.0)
    assert one["tpot_ms_p50_diff"] == pytest.approx(0.5) and one["itl_ms_p99_diff"] == pytest.approx(0.5)
    assert one["loadgen_cpu_s_per_1k_tokens"] == pytest.approx([0.6, 0.2])
    assert eight["loadgen_cpu_s_per_1k_tokens"] == pytest.approx([0.75, 0.25])
    assert eight["itl_ms_p50_diff"] == pytest.approx(0.1) and eight["server_cpu_s_per_1k_tokens"] == [
        1.5,
        1.5,
    ]
    text = format_overhead(rows)
    assert "gateway - native" in text and "x0.900" in text and "+2.50" in text and "+0.500" in text
    assert (
        format_overhead([]) == "" and gateway_overhead([r for r in runs if r["scheduler"] != "native"]) == []
    )
    doc = {
        "model": "tiny",
        "device": "cpu",
        "created": "now",
        "command": ["--compare", "gateway"],
        "environment": {"git": {}},
        "settings": {},
        "runs": runs,
        "degradation": [],
        "ratios_vs_hf": [],
        "gateway_overhead": rows,
        "notes": [],
    }
    md = markdown_summary(doc, [])
    assert "## gateway / native" in md
    assert "| c=1 | 90.0 / 100.0 | x0.900 | +2.50 | +5.00 | +0.500 | +0.250 | +0.500 | 0.600 / 0.200 |" in md


# ---------------------------------------------------------------- the CLI end to end


def test_compare_gateway_end_to_end(tmp_path):
    """`ringleader bench --compare gateway`: one server with --http, each load point measured
    natively and through the gateway, and the overhead table in the JSON, summary and console."""
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "ringleader.hostctl.cli", "bench", "--compare", "gateway", "--model", "tiny"]
    cmd += ["--device", "cpu", "--concurrency", "1,4", "--requests", "4", "--input-len", "8"]
    cmd += ["--output-len", "8", "--warmup", "1", "--no-plots", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    runs = doc["runs"]
    assert [(r["scheduler"], r["concurrency"]) for r in runs] == [
        ("native", 1),
        ("gateway", 1),
        ("native", 4),
        ("gateway", 4),
    ]
    for r in runs:
        assert r["completed"] == 4 and r["failed"] == 0 and r["output_tokens"] > 0
        assert r["output_tokens_per_s"] > 0 and r["ttft_ms"]["p50"] > 0
        assert r["cpu_s_per_1k_tokens"] > 0  # the server's stats, over ZeroMQ, for both
        assert r["loadgen_cpu_s"] > 0 and r["model"] == "tiny" and r["device"] == "cpu"
    assert [r.get("token_count") for r in runs] == [None, TOKEN_IDS, None, TOKEN_IDS]
    rows = doc["gateway_overhead"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    for row in rows:
        assert row["output_tokens_per_s_ratio"] > 0
        for key in ("ttft_ms_p50_diff", "ttft_ms_p99_diff", "tpot_ms_p50_diff", "itl_ms_p50_diff"):
            assert isinstance(row[key], float), key
        assert all(x > 0 for x in row["loadgen_cpu_s_per_1k_tokens"])
    assert doc["settings"]["variants"] == ["gateway"] and any("gateway:" in n for n in doc["notes"])
    assert "## gateway / native" in (out / "summary.md").read_text()
    assert "gateway - native" in proc.stdout and "gateway - native" in (out / "console.txt").read_text()
