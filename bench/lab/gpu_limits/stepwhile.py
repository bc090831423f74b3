"""Probe 10, stepwhile: a WHILE graph (no SWITCH) around the real 1-row decode step graph.

The step is the one the server replays and `roofline` times (bench/roofline.py decode_step: the
model's StaticStep for one row at context B.step_ctx, captured by torch, sampling included). It is
run n times three ways: host replays back to back (the host-scheduled mode's best case), one
replay at a time with a sync (the step's own device time), and as the body of a WHILE graph with
rl_while_body counting the iterations (the device-scheduled mode without the SWITCH). The gap
between the WHILE's per-iteration time and the step's device time is what the loop itself costs
around a real step; the sampled token must be the same either way.
"""

from __future__ import annotations

import numpy as np

from ringleader.bench.lab.gpu_limits.common import summarize, trow
from ringleader.bench.lab.gpu_limits.conditional import counted_while_around, run_counted_graph
from ringleader.bench.lab.gpu_limits.device import Graphs, Probe
from ringleader.device.backends import cuda_driver as drv


def probe_stepwhile(P: Probe) -> dict:
    torch = P.need_torch()
    P.require_clean()
    from ringleader.bench.roofline import decode_step
    from ringleader.device.model.llama import LlamaModel

    B = P.B
    tdev = torch.device("cuda", P.args.device)
    model = LlamaModel.from_spec(P.args.step_model, torch.bfloat16, tdev)
    step = decode_step(model, 1, B.step_ctx, "triton", keep_graph=True)
    out: dict = {
        "what": f"{P.args.step_model} bf16 1-row decode step graph (ctx {B.step_ctx}) replayed from the host "
        "and run as the body of a WHILE graph",
        "model": P.args.step_model,
        "ctx": B.step_ctx,
        "table": [],
    }
    try:
        return _measure(P, torch, step, out)
    finally:
        del step, model
        torch.cuda.empty_cache()


def _replays(torch, run, n: int) -> tuple[float, list[float]]:
    """(ms for n back-to-back replays, ms of each of 10 single replays with a sync between)."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    e0.record()
    for _ in range(n):
        run()
    e1.record()
    e1.synchronize()
    back_to_back = e0.elapsed_time(e1)
    single = []
    for _ in range(10):
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        single.append(e0.elapsed_time(e1))
    return back_to_back, single


def _measure(P: Probe, torch, step, out: dict) -> dict:
    dev, B = P.dev, P.B
    n = B.step_iters
    tg = drv.cu.CUgraph(int(step.graph.raw_cuda_graph()))
    out["step_graph_nodes"] = len(drv.node_types(tg))
    next_token = step.layout.next_token
    torch.cuda.synchronize()
    b2b_ms, single_ms = _replays(torch, step.run, n)
    token_host = int(next_token[0].item())
    next_token.fill_(-1)
    torch.cuda.synchronize()
    G = Graphs()
    state = dev.malloc(256)
    stamps = dev.malloc(8 * n)
    s = P.work_stream
    try:
        ge = counted_while_around(P, G, tg, state, stamps, n)
        drv.upload_graph(ge, s)
        run_counted_graph(P, ge, state, 1, s)  # warm-up
        while_ms, count = run_counted_graph(P, ge, state, n, s)
        token_while = int(next_token[0].item())
        st = dev.read_u64(stamps, min(count, n), s).astype(np.int64)
    finally:
        if not P.tainted:
            G.destroy()
            dev.free(state)
            dev.free(stamps)
    d = np.diff(st)
    step_us = float(np.median(single_ms)) * 1e3
    while_us = while_ms * 1e3 / max(count, 1)
    ok = count == n and token_host >= 0 and token_while == token_host
    out.update(
        {
            "iterations": n,
            "count": count,
            "host_back_to_back_per_step_us": b2b_ms * 1e3 / n,
            "single_replay_us": summarize(np.array(single_ms) * 1e6),
            "while_per_iteration_us": while_us,
            "while_per_iteration_from_stamps": summarize(d[min(5, d.size // 2) :]),
            "while_minus_single_replay_us": while_us - step_us,
            "while_minus_back_to_back_us": while_us - b2b_ms * 1e3 / n,
            "token_host_replay": token_host,
            "token_while": token_while,
            "check": {"ok": ok, "what": "n iterations, and the WHILE's sampled token == the host replay's"},
            "status": "ok" if ok else "failed_check",
        }
    )
    t = out["table"]
    t.append(
        ["step: host replays back to back, per step", out["host_back_to_back_per_step_us"], None, "us", ""]
    )
    t.append(trow("step: one replay + sync (device time)", out["single_replay_us"]))
    t.append(
        trow(
            "step in a WHILE: per iteration (stamps)",
            out["while_per_iteration_from_stamps"],
            note=out["status"],
        )
    )
    t.append(["WHILE per iteration - one replay", out["while_minus_single_replay_us"], None, "us", ""])
    return out
