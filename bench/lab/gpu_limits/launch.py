"""Probe 3, launch: empty kernel launch, one-node graph launch and the per-node cost of a graph
chain; the per-iteration cost of WHILE and WHILE + 4-way SWITCH graphs (conditional.py)."""

from __future__ import annotations

import time

import numpy as np

from ringleader.bench.lab.gpu_limits.common import Timeout, sub, summarize, trow
from ringleader.bench.lab.gpu_limits.conditional import switch_graph, while_graph
from ringleader.bench.lab.gpu_limits.device import Graphs, Probe
from ringleader.device.backends import cuda_driver as drv


def _time_launches(P: Probe, launch, label: str) -> dict:
    """Host call cost, launch+sync latency, back-to-back device rate."""
    dev, B = P.dev, P.B
    s = P.work_stream
    pc = time.perf_counter_ns
    for _ in range(B.launch_warm):
        launch()
    if not dev.wait_stream(s, B.t(10)):
        raise Timeout(f"{label}: warm-up launches did not finish")
    host = np.empty(B.launch_reps, np.int64)
    for i in range(B.launch_reps):
        t0 = pc()
        launch()
        host[i] = pc() - t0
        if (i & 63) == 63 and not dev.wait_stream(s, B.t(10)):
            raise Timeout(f"{label}: launches did not drain")
    if not dev.wait_stream(s, B.t(10)):
        raise Timeout(f"{label}: launches did not drain")
    sync = np.empty(B.sync_reps, np.int64)
    for i in range(B.sync_reps):
        t0 = pc()
        launch()
        drv.synchronize(s)
        sync[i] = pc() - t0
    drv.record_event(P.ev0, s)
    t0 = pc()
    for _ in range(B.b2b):
        launch()
    drv.record_event(P.ev1, s)
    t_enq = pc() - t0
    if not dev.wait_event(P.ev1, B.t(20)):
        raise Timeout(f"{label}: back-to-back launches did not finish")
    ms = drv.elapsed_ms(P.ev0, P.ev1)
    return {
        "host_call": summarize(host),
        "launch_plus_sync": summarize(sync),
        "back_to_back": {
            "n": B.b2b,
            "device_us_per_launch": ms * 1e3 / B.b2b,
            "host_enqueue_us_per_launch": t_enq / 1e3 / B.b2b,
        },
    }


def _cuda_python_floor(P: Probe) -> dict:
    s = P.work_stream
    pc = time.perf_counter_ns
    out = np.empty(2000, np.int64)
    for i in range(out.size):
        t0 = pc()
        drv.stream_done(s)
        out[i] = pc() - t0
    return summarize(out)


def _empty_kernel(P: Probe) -> dict:
    f = P.fn("rl_empty")
    s = P.work_stream
    no_args = drv.KernelArgs()

    def launch():
        drv.launch(f, no_args, s)

    return _time_launches(P, launch, "empty kernel")


def _one_node_graph(P: Probe, G: Graphs) -> dict:
    f = P.fn("rl_empty")
    s = P.work_stream
    g = G.create()
    drv.add_kernel_node(g, [], f, drv.KernelArgs())
    ge = G.instantiate(g)
    drv.upload_graph(ge, s)

    def launch():
        drv.launch_graph(ge, s)

    r = _time_launches(P, launch, "one-node graph")
    # a chain of empty kernel nodes: the per-node cost inside one graph
    B = P.B
    g2 = G.create()
    prev: list = []
    for _ in range(B.chain_nodes):
        prev = [drv.add_kernel_node(g2, prev, f, drv.KernelArgs())]
    ge2 = G.instantiate(g2)
    times = []
    for _ in range(B.chain_reps + 2):
        drv.record_event(P.ev0, s)
        drv.launch_graph(ge2, s)
        drv.record_event(P.ev1, s)
        if not P.dev.wait_event(P.ev1, B.t(10)):
            raise Timeout("chain graph")
        times.append(drv.elapsed_ms(P.ev0, P.ev1) * 1e6 / B.chain_nodes)
    r["chain_per_node"] = summarize(times[2:])
    r["chain_nodes"] = B.chain_nodes
    return r


def probe_launch(P: Probe) -> dict:
    out: dict = {
        "what": "host launch costs (cuda-python call included) and device-side per-iteration cost of "
        "conditional graphs",
        "table": [],
    }
    G = Graphs()
    try:
        out["cuda_python_call_floor"] = sub(_cuda_python_floor, P)
        out["empty_kernel"] = ek = sub(_empty_kernel, P)
        out["one_node_graph"] = og = sub(_one_node_graph, P, G)
        out["while_graph"] = wg = sub(while_graph, P, G)
        out["switch_graph"] = sg = sub(switch_graph, P, G)
    finally:
        G.destroy()
    t = out["table"]
    t.append(trow("cuda-python call floor (cuStreamQuery)", out["cuda_python_call_floor"]))
    for label, r in (("empty kernel", ek), ("1-node graph", og)):
        t.append(trow(f"{label}: host launch call", r.get("host_call"), note=r.get("status", "")))
        t.append(trow(f"{label}: launch + stream sync", r.get("launch_plus_sync")))
        b = r.get("back_to_back") or {}
        t.append([f"{label}: back-to-back, device per launch", b.get("device_us_per_launch"), None, "us", ""])
    if og.get("chain_per_node"):
        t.append(trow("graph chain of 100 empty nodes, per node", og["chain_per_node"]))
    for label, r in (("WHILE", wg), ("WHILE+SWITCH(4)", sg)):
        note = r.get("status", "")
        t.append(trow(f"{label} per iteration (stamps)", r.get("per_iteration_from_stamps"), note=note))
        t.append(trow(f"{label} per iteration (events)", r.get("per_iteration_from_events")))
    if wg.get("host_launch_plus_sync_n1"):
        t.append(trow("WHILE graph (1 iter): launch + sync", wg["host_launch_plus_sync_n1"]))
    subs = [ek, og, wg, sg]
    out["status"] = "ok" if all(r.get("status") == "ok" for r in subs) else "partial"
    return out
