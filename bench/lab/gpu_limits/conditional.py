"""WHILE / SWITCH conditional graphs: a WHILE graph counting to n (also used by probes 4 and 7),
its per-iteration statistics, and the WHILE and WHILE + SWITCH(4) graphs of probe 3."""

from __future__ import annotations

import time

import numpy as np

from ringleader.bench.lab.gpu_limits.common import PTR, U32, U64, Timeout, summarize
from ringleader.bench.lab.gpu_limits.device import Graphs, Probe
from ringleader.device.backends import cuda_driver as drv


def new_while(P: Probe, G: Graphs):
    """A graph holding one WHILE node (its handle reset to 1 at each launch): (graph, handle, body)."""
    g = G.create()
    h = drv.conditional_handle(g, P.dev.ctx, 1, True)
    WHILE = drv.cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
    _, (body,) = drv.add_conditional_node(g, [], h, WHILE, 1, P.dev.ctx)
    return g, h, body


def counted_while_around(P: Probe, G: Graphs, child, state: int, stamps: int, cap: int):
    """Instantiated: a WHILE whose body runs `child` (a graph, cloned) then rl_while_body, which
    counts the iterations in state (run_counted_graph sets how many) and stamps up to cap."""
    g, h, body = new_while(P, G)
    node = drv.add_child_graph_node(body, [], child)
    counter = drv.KernelArgs(U64(int(h)), PTR(state), PTR(stamps), U32(cap))
    drv.add_kernel_node(body, [node], P.fn("rl_while_body"), counter)
    return G.instantiate(g)


def run_counted_graph(P: Probe, ge, state: int, n: int, stream, extra=None) -> tuple[float, int]:
    """Launch a WHILE graph whose body counts to n; returns (ms, count)."""
    dev, B = P.dev, P.B
    drv.memset_d32(state, 0, 1, stream)
    drv.memset_d32(state + 4, n, 1, stream)
    drv.memset_d32(state + 8, n + 16, 1, stream)  # hard cap: the kernel traps beyond it
    if extra:
        extra()
    drv.record_event(P.ev0, stream)
    drv.launch_graph(ge, stream)
    drv.record_event(P.ev1, stream)
    if not dev.wait_event(P.ev1, B.t(10 + n * 20e-6)):
        raise Timeout(f"WHILE graph with {n} iterations did not finish")
    ms = drv.elapsed_ms(P.ev0, P.ev1)
    count = int(dev.read_u32(state, 1, stream)[0])
    return ms, count


def while_stats(P: Probe, ge, state: int, stamps: int, cap: int, stream, extra=None, after=None) -> dict:
    B = P.B
    small = []
    bad: list = []
    for _ in range(B.while_small_reps + 1):
        ms, c = run_counted_graph(P, ge, state, 1, stream, extra)
        small.append(ms)
        if c != 1:
            bad.append(("n=1", c))
        if after:
            after(1, bad)
    big = []
    for _ in range(B.while_reps + 1):
        ms, c = run_counted_graph(P, ge, state, B.while_n, stream, extra)
        big.append(ms)
        if c != B.while_n:
            bad.append((f"n={B.while_n}", c))
        if after:
            after(B.while_n, bad)
    small_ms = float(np.median(small[1:]))
    per_iter_ns = [(b - small_ms) * 1e6 / (B.while_n - 1) for b in big[1:]]
    st = P.dev.read_u64(stamps, min(cap, B.while_n), stream).astype(np.int64)
    d = np.diff(st)
    skip = min(10, d.size // 2)
    return {
        "iterations": B.while_n,
        "graph_time_n1": summarize(np.array(small[1:]) * 1e6),
        "graph_time_n": summarize(np.array(big[1:]) * 1e6),
        "per_iteration_from_events": summarize(per_iter_ns),
        "per_iteration_from_stamps": summarize(d[skip:]),
        "stamps_ordered": bool(np.all(d >= 0)) if d.size else None,
        "check": {
            "ok": not bad and (bool(np.all(d >= 0)) if d.size else False),
            "bad_counts": bad[:8],
            "what": "iteration counter == requested iterations",
        },
    }


def while_graph(P: Probe, G: Graphs) -> dict:
    dev, B = P.dev, P.B
    f = P.fn("rl_while_body")
    s = P.work_stream
    state = dev.malloc(256)
    cap = B.while_n
    stamps = dev.malloc(8 * cap)
    try:
        g, h, body = new_while(P, G)
        drv.add_kernel_node(body, [], f, drv.KernelArgs(U64(int(h)), PTR(state), PTR(stamps), U32(cap)))
        ge = G.instantiate(g)
        r = while_stats(P, ge, state, stamps, cap, s)
        # the whole WHILE graph (1 iteration) launched and waited for from the host
        pc = time.perf_counter_ns
        host = []
        for _ in range(B.sync_reps // 4 + 5):
            drv.memset_d32(state, 0, 1, s)
            drv.memset_d32(state + 4, 1, 1, s)
            drv.memset_d32(state + 8, 17, 1, s)
            if not dev.wait_stream(s, B.t(10)):
                raise Timeout("memset")
            t0 = pc()
            drv.launch_graph(ge, s)
            drv.synchronize(s)
            host.append(pc() - t0)
        r["host_launch_plus_sync_n1"] = summarize(host[5:])
        r["status"] = "ok" if r["check"]["ok"] else "failed_check"
        return r
    finally:
        if not P.tainted:
            dev.free(state)
            dev.free(stamps)


def switch_graph(P: Probe, G: Graphs) -> dict:
    dev, B = P.dev, P.B
    f_ctl, f_br = P.fn("rl_switch_ctl"), P.fn("rl_branch")
    s = P.work_stream
    state = dev.malloc(256)
    counters = dev.malloc(256)
    cap = B.while_n
    stamps = dev.malloc(8 * cap)
    CT = drv.cu.CUgraphConditionalNodeType
    try:
        g, hw, body = new_while(P, G)
        hs = drv.conditional_handle(body, dev.ctx, 0, False)
        k = drv.add_kernel_node(
            body, [], f_ctl, drv.KernelArgs(U64(int(hw)), U64(int(hs)), PTR(state), PTR(stamps), U32(cap))
        )
        _, branches = drv.add_conditional_node(body, [k], hs, CT.CU_GRAPH_COND_TYPE_SWITCH, 4, dev.ctx)
        for i, bg in enumerate(branches):
            drv.add_kernel_node(bg, [], f_br, drv.KernelArgs(PTR(counters), U32(i)))
        ge = G.instantiate(g)
        branch_bad: list = []

        def reset():
            drv.memset_d32(counters, 0, 4, s)

        def after(n, bad):
            c = dev.read_u32(counters, 4, s)
            want = [n // 4 + (1 if i < n % 4 else 0) for i in range(4)]
            if [int(x) for x in c] != want:
                branch_bad.append({"n": n, "got": [int(x) for x in c], "want": want})

        r = while_stats(P, ge, state, stamps, cap, s, extra=reset, after=after)
        r["branch_check"] = {
            "ok": not branch_bad,
            "bad": branch_bad[:4],
            "what": "branch k ran exactly for iterations c with (c-1)%4 == k",
        }
        r["check"]["ok"] = r["check"]["ok"] and not branch_bad
        r["status"] = "ok" if r["check"]["ok"] else "failed_check"
        return r
    finally:
        if not P.tainted:
            for p in (state, counters, stamps):
                dev.free(p)
