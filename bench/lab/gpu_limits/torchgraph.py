"""Probe 4, torchgraph: a torch CUDA graph as a child node inside a WHILE body: does it run,
does its output match eager torch."""

from __future__ import annotations

import numpy as np

from ringleader.bench.lab.gpu_limits.common import sub, summarize
from ringleader.bench.lab.gpu_limits.conditional import counted_while_around, run_counted_graph
from ringleader.bench.lab.gpu_limits.device import Graphs, Probe
from ringleader.device.backends import cuda_driver as drv


def probe_torchgraph(P: Probe) -> dict:
    torch = P.need_torch()
    P.require_clean()
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # full float32, for the float64 comparison
    try:
        return _torchgraph(P, torch)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32


def _torchgraph(P: Probe, torch) -> dict:
    dev, B = P.dev, P.B
    P.fn("rl_while_body")  # skip before any capture when the kernel is missing
    out: dict = {
        "what": "torch graph (2 matmuls + tanh, updating x in place) captured with "
        "CUDAGraph(keep_graph=True) on its own stream, embedded as a child node in a WHILE "
        "body that runs it K times; compared with K eager iterations",
        "table": [],
    }
    tdev = torch.device("cuda", P.args.device)
    gen = torch.Generator(device=tdev)
    gen.manual_seed(1234)
    M, K = 256, 1024
    x0 = torch.randn(M, K, device=tdev, generator=gen)
    w1 = torch.randn(K, K, device=tdev, generator=gen) / K**0.5
    w2 = torch.randn(K, K, device=tdev, generator=gen) / K**0.5
    x = x0.clone()

    def body():
        x.copy_(torch.tanh(torch.tanh(x @ w1) @ w2))

    side = torch.cuda.Stream(device=tdev)
    side.wait_stream(torch.cuda.current_stream(tdev))
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.synchronize(tdev)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(side):
        g.capture_begin(capture_error_mode="thread_local")
        try:
            body()
        finally:
            g.capture_end()
    torch.cuda.synchronize(tdev)
    raw = g.raw_cuda_graph()
    tg = drv.cu.CUgraph(int(raw))
    out["torch_graph_node_types"] = sub(drv.node_types, tg)
    iters = B.torch_iters
    state = dev.malloc(256)
    stamps = dev.malloc(8 * 64)
    G = Graphs()
    s = P.work_stream
    try:
        ge = counted_while_around(P, G, tg, state, stamps, 64)
        out["instantiated"] = True
        runs = []
        count = None
        for _ in range(B.torch_reps):
            x.copy_(x0)
            torch.cuda.synchronize(tdev)
            ms, count = run_counted_graph(P, ge, state, iters, s)
            runs.append(ms)
        xg = x.clone()
        # eager reference, same ops on the default stream
        x.copy_(x0)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            body()
        e1.record()
        torch.cuda.synchronize(tdev)
        eager_ms = e0.elapsed_time(e1)
        xe = x.clone()
        # float64 reference on the CPU
        r64 = x0.double().cpu()
        w1d, w2d = w1.double().cpu(), w2.double().cpu()
        for _ in range(iters):
            r64 = torch.tanh(torch.tanh(r64 @ w1d) @ w2d)
        rel = float((xg - xe).norm() / xe.norm())
        rel64_graph = float((xg.double().cpu() - r64).norm() / r64.norm())
        rel64_eager = float((xe.double().cpu() - r64).norm() / r64.norm())
        finite = bool(torch.isfinite(xg).all())
        ok = count == iters and finite and rel < 1e-4 and rel64_graph < 1e-3
        out.update(
            {
                "runs": True,
                "iterations": iters,
                "count": count,
                "graph_ms": summarize(np.array(runs) * 1e6),
                "eager_ms": eager_ms,
                "per_iteration_graph_us": float(np.median(runs)) * 1e3 / iters,
                "per_iteration_eager_us": eager_ms * 1e3 / iters,
                "rel_err_graph_vs_eager": rel,
                "bitwise_equal": bool(torch.equal(xg, xe)),
                "rel_err_graph_vs_fp64": rel64_graph,
                "rel_err_eager_vs_fp64": rel64_eager,
                "check": {"ok": ok, "what": "iteration count, finite output, graph == eager within 1e-4"},
            }
        )
        out["table"].append(
            [
                "torch child graph in WHILE: per iteration",
                out["per_iteration_graph_us"],
                None,
                "us",
                f"{'match' if ok else 'MISMATCH'} rel={rel:.1e}",
            ]
        )
        out["table"].append(["same ops eager: per iteration", out["per_iteration_eager_us"], None, "us", ""])
        out["status"] = "ok" if ok else "failed_check"
    finally:
        G.destroy()
        if not P.tainted:
            dev.free(state)
            dev.free(stamps)
        del g
    return out
