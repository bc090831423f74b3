"""Probe 9, graphpair: two resident WHILE graphs on two streams taking turns (ping-pong), against
one WHILE graph running the same steps back to back.

In one WHILE graph, each step boundary costs the loop's re-arm plus the edge to the body's first
kernel. With two graphs alternating, the next step's graph is already waiting on the device (its
gate kernel spins on a flag), so a boundary is a flag handover, and each graph re-arms its loop
while the other one steps. Each body is gate -> work -> release (kernels.cu, rl_pp_*); work holds
the SM for work_ns as a stand-in step: 0 (bare boundaries) and B.pair_work_ns (long enough to
hide a re-arm). The figure: the idle time from one step's release to the next step's work start,
on the device clock, per variant.
"""

from __future__ import annotations

import numpy as np

from ringleader.bench.lab.gpu_limits.common import PTR, U32, U64, Timeout, sub, summarize, trow
from ringleader.bench.lab.gpu_limits.conditional import new_while
from ringleader.bench.lab.gpu_limits.device import Graphs, Probe
from ringleader.device.backends import cuda_driver as drv

SOLO = 2  # RL_PP_SOLO in kernels.cu: no gate, no flag
WAIT_NS = 50_000_000  # a gate gives up after this long without its turn
STAMPS = 3  # per iteration: gate wake, work start, release
WAKE, WORK, RELEASE = range(STAMPS)


def _body_graph(
    P: Probe, G: Graphs, role: int, flag: int, state: int, stamps: int, n: int, work_ns: int, ctl
):
    g, h, body = new_while(P, G)
    deps: list = []
    if role != SOLO:
        gate_args = drv.KernelArgs(
            PTR(flag), U32(role), PTR(state), PTR(stamps), U32(n), PTR(ctl.dptr), U64(WAIT_NS)
        )
        deps = [drv.add_kernel_node(body, [], P.fn("rl_pp_gate"), gate_args)]
    work_args = drv.KernelArgs(PTR(state), PTR(stamps), U32(n), U64(work_ns))
    work = drv.add_kernel_node(body, deps, P.fn("rl_pp_work"), work_args)
    rel_args = drv.KernelArgs(U64(int(h)), PTR(flag), U32(role), PTR(state), PTR(stamps), U32(n))
    drv.add_kernel_node(body, [work], P.fn("rl_pp_release"), rel_args)
    ge = G.instantiate(g)
    drv.upload_graph(ge, P.work_stream)
    return ge


def idle_gaps(stamps: list[np.ndarray]) -> np.ndarray:
    """The idle time before each step after the first, in step order: one role's stamps [n, 3]
    (solo), or two roles' taking turns (role 0's step i, role 1's step i, role 0's step i + 1...)."""
    if len(stamps) == 1:
        st = stamps[0]
        return st[1:, WORK] - st[:-1, RELEASE]
    a, b = stamps
    order = np.empty((a.shape[0] + b.shape[0], STAMPS), np.int64)
    order[0::2], order[1::2] = a, b
    return order[1:, WORK] - order[:-1, RELEASE]


def _run(P: Probe, G: Graphs, pair: bool, work_ns: int) -> dict:
    dev, B = P.dev, P.B
    n = B.pair_n
    roles = (0, 1) if pair else (SOLO,)
    streams = (P.stream_a, P.stream_b)
    flag = dev.malloc(256)
    ctl = dev.new_ctl("graphpair")
    states = [dev.malloc(256) for _ in roles]
    stamp_bufs = [dev.malloc(8 * STAMPS * n) for _ in roles]
    s = P.work_stream
    try:
        drv.memset_d32(flag, 0, 64, s)
        for st, sb in zip(states, stamp_bufs):
            drv.memset_d32(st, 0, 64, s)
            drv.memset_d32(st + 4, n, 1, s)
            drv.memset_d32(sb, 0, 2 * STAMPS * n, s)
        if not dev.wait_stream(s, B.t(10)):
            raise Timeout("memset")
        execs = [
            _body_graph(P, G, role, flag, st, sb, n, work_ns, ctl)
            for role, st, sb in zip(roles, states, stamp_bufs)
        ]
        for ge, stream in zip(execs, streams):
            drv.launch_graph(ge, stream)
        limit = B.t(10 + n * (work_ns * 1e-9 + 100e-6))
        if not all(dev.wait_stream(stream, limit) for stream in streams[: len(roles)]):
            ctl.stop()
            if not all(dev.wait_stream(stream, B.t(10)) for stream in streams[: len(roles)]):
                P.taint("graphpair: a WHILE graph did not end after its shutdown word was set")
            raise Timeout(f"{len(roles)} WHILE graph(s) of {n} steps did not finish")
        done, gave_up, stamps = [], [], []
        for st, sb in zip(states, stamp_bufs):
            w = dev.read_u32(st, 3, s)
            done.append(int(w[0]))
            gave_up.append(int(w[2]))
            stamps.append(dev.read_u64(sb, STAMPS * n, s).astype(np.int64).reshape(n, STAMPS))
        complete = all(d == n for d in done) and not any(gave_up)
        gaps = idle_gaps(stamps) if complete else np.zeros(0, np.int64)
        skip = min(10, gaps.size // 2)
        steps = n * len(roles)
        first = min(x[0, WORK] for x in stamps)
        last = max(x[-1, RELEASE] for x in stamps)
        r = {
            "graphs": len(roles),
            "work_ns": work_ns,
            "steps": steps,
            "done": done,
            "gate_gave_up": gave_up,
            "idle_between_steps": summarize(gaps[skip:]),
            "cadence_per_step_us": (last - first) / 1e3 / steps if complete else None,
            "check": {
                "ok": complete and bool(np.all(gaps >= 0)),
                "what": "every step ran once, in turn, none before the previous one's release",
            },
        }
        r["status"] = "ok" if r["check"]["ok"] else "failed_check"
        if pair and complete:
            a, b = stamps
            r["flag_handover"] = summarize(
                np.concatenate([b[:, WAKE] - a[:, RELEASE], a[1:, WAKE] - b[:-1, RELEASE]])[skip:]
            )
        return r
    finally:
        if not P.tainted:
            for p in (flag, *states, *stamp_bufs):
                dev.free(p)


def probe_graphpair(P: Probe) -> dict:
    out: dict = {
        "what": "idle time between steps: one WHILE graph vs two resident WHILE graphs on two streams "
        "taking turns through a device flag, with bare and stand-in steps",
        "table": [],
    }
    G = Graphs()
    variants = []
    try:
        for work_ns in (0, P.B.pair_work_ns):
            for pair in (False, True):
                key = f"{'pair' if pair else 'one'}_work_{work_ns // 1000}us"
                out[key] = r = sub(_run, P, G, pair, work_ns)
                variants.append(r)
                label = (
                    f"{'two graphs, ping-pong' if pair else 'one WHILE graph'}, {work_ns // 1000} us steps"
                )
                out["table"].append(
                    trow(
                        f"{label}: idle between steps", r.get("idle_between_steps"), note=r.get("status", "")
                    )
                )
    finally:
        if not P.tainted:
            G.destroy()
    out["status"] = "ok" if all(r.get("status") == "ok" for r in variants) else "partial"
    return out
