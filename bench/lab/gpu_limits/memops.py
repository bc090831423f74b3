"""Probe 7, memops: cuStreamWaitValue32/WriteValue32 handoff latency across two streams (and the
same with events); does stream capture turn them into graph nodes."""

from __future__ import annotations

import threading

import numpy as np

from ringleader.bench.lab.gpu_limits.common import (
    PTR,
    U32,
    Timeout,
    add_rescuer,
    remove_rescuer,
    sub,
    summarize,
    trow,
)
from ringleader.bench.lab.gpu_limits.conditional import counted_while_around, run_counted_graph
from ringleader.bench.lab.gpu_limits.device import Graphs, Probe
from ringleader.bench.lab.gpu_limits.kernels import CTL_DOORBELL
from ringleader.device.backends import cuda_driver as drv
from ringleader.device.backends.cuda_driver import CudaError


def _memop_handoff(P: Probe, use_events: bool) -> dict:
    """Ping-pong between two streams through cuStreamWriteValue32/WaitValue32
    on device flags (or through events), stamped by tiny kernels."""
    dev, B = P.dev, P.B
    f = P.fn("rl_stamp")
    sa, sb, s = P.stream_a, P.stream_b, P.work_stream
    nb, bs = B.memop_batches, B.memop_batch
    n = nb * bs
    flags = dev.malloc(256)
    fa, fb = flags, flags + 128
    t_send = dev.malloc(8 * n)
    t_recv = dev.malloc(8 * n)
    go_ctl = dev.new_ctl("memops gate")
    go_ptr = go_ctl.word_dptr(CTL_DOORBELL)
    GEQ = drv.cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    WDEF = drv.cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    release = 0x7FFFFFF0
    rescue_stream = P.aux_stream

    def rescue():
        go_ctl.w[CTL_DOORBELL] = release
        drv.memset_d32(flags, release, 64, rescue_stream)

    add_rescuer(rescue)
    events: list = []
    res: dict = {
        "iterations": n,
        "batches": nb,
        "gate_forced": 0,
        "mechanism": "events (cuEventRecord/cuStreamWaitEvent)"
        if use_events
        else "cuStreamWriteValue32 / cuStreamWaitValue32 (GEQ) on device flags",
    }
    try:
        drv.memset_d32(flags, 0, 64, s)
        drv.memset_d32(t_send, 0, 2 * n, s)
        drv.memset_d32(t_recv, 0, 2 * n, s)
        if not dev.wait_stream(s, B.t(10)):
            raise Timeout("memset")
        if use_events:
            ev_a = [drv.create_event(timing=False) for _ in range(bs)]
            ev_b = [drv.create_event(timing=False) for _ in range(bs)]
            events = ev_a + ev_b
        use_gate = True
        for b in range(nb):
            gate = b + 1
            # both streams wait on a pinned host word until the whole batch is
            # enqueued, so the handoff runs at device speed, not enqueue speed
            if use_gate:
                try:
                    drv.call(drv.cu.cuStreamWaitValue32, sa, go_ptr, gate, GEQ)
                except CudaError as e:
                    use_gate = False
                    res["gate"] = f"waiting on a pinned host word failed, running ungated: {e}"
            if use_gate:
                drv.call(drv.cu.cuStreamWaitValue32, sb, go_ptr, gate, GEQ)
            # if enqueueing ever blocked (a full queue), open the gate anyway
            timer = threading.Timer(B.t(3.0), lambda g=gate: go_ctl.w.__setitem__(CTL_DOORBELL, g))
            timer.daemon = True
            timer.start()
            for j in range(bs):
                i = b * bs + j
                if use_events:
                    if j > 0:
                        drv.call(drv.cu.cuStreamWaitEvent, sa, ev_b[j - 1], 0)
                    drv.launch(f, drv.KernelArgs(PTR(t_send), U32(i)), sa)
                    drv.record_event(ev_a[j], sa)
                    drv.call(drv.cu.cuStreamWaitEvent, sb, ev_a[j], 0)
                    drv.launch(f, drv.KernelArgs(PTR(t_recv), U32(i)), sb)
                    drv.record_event(ev_b[j], sb)
                else:
                    drv.call(drv.cu.cuStreamWaitValue32, sa, fb, i, GEQ)
                    drv.launch(f, drv.KernelArgs(PTR(t_send), U32(i)), sa)
                    drv.call(drv.cu.cuStreamWriteValue32, sa, fa, i + 1, WDEF)
                    drv.call(drv.cu.cuStreamWaitValue32, sb, fa, i + 1, GEQ)
                    drv.launch(f, drv.KernelArgs(PTR(t_recv), U32(i)), sb)
                    drv.call(drv.cu.cuStreamWriteValue32, sb, fb, i + 1, WDEF)
            timer.cancel()
            if use_gate and int(go_ctl.w[CTL_DOORBELL]) >= gate:
                res["gate_forced"] += 1
            go_ctl.w[CTL_DOORBELL] = gate
            ok = dev.wait_stream(sa, B.t(10)) and dev.wait_stream(sb, B.t(10))
            if not ok:
                rescue()
                if not (dev.wait_stream(sa, B.t(5)) and dev.wait_stream(sb, B.t(5))):
                    P.taint("stream memory-op handoff did not drain after rescue")
                raise Timeout(f"handoff batch {b} did not finish")
        ts = dev.read_u64(t_send, n, s).astype(np.int64)
        tr = dev.read_u64(t_recv, n, s).astype(np.int64)
        fl = dev.read_u32(flags, 64, s) if not use_events else None
    finally:
        remove_rescuer(rescue)
        for ev in events:
            try:
                drv.destroy_event(ev)
            except Exception:
                pass
        if not P.tainted:
            for p in (flags, t_send, t_recv):
                dev.free(p)
    a2b, b2a = [], []
    for b in range(1, nb):  # the first batch is warm-up
        for j in range(2, bs):
            i = b * bs + j
            a2b.append(tr[i] - ts[i])
            if j + 1 < bs:
                b2a.append(ts[i + 1] - tr[i])
    a2b_a, b2a_a = np.array(a2b), np.array(b2a)
    written = bool(np.all(ts > 0) and np.all(tr > 0))
    ordered = bool(np.all(a2b_a >= 0) and np.all(b2a_a >= 0)) if a2b_a.size else False
    ok = written and ordered
    if fl is not None:
        ok = ok and int(fl[0]) == n and int(fl[32]) == n
        res["final_flags"] = [int(fl[0]), int(fl[32])]
    res.update(
        {
            "a_to_b": summarize(a2b_a),
            "b_to_a": summarize(b2a_a),
            "one_way_both": summarize(np.concatenate([a2b_a, b2a_a])) if a2b_a.size else {"n": 0},
            "check": {"ok": ok, "stamps_written": written, "stamps_ordered": ordered},
            "status": "ok" if ok else "failed_check",
            "note": "one way = stamp kernel on A -> signal -> wait on B -> stamp kernel on B starts",
        }
    )
    return res


def _memop_capture(P: Probe) -> dict:
    dev, B = P.dev, P.B
    s = dev.stream()
    f = P.fn("rl_stamp")
    buf = dev.malloc(256)
    res: dict = {}
    G = Graphs()
    EQ = drv.cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
    try:
        drv.memset_d32(buf, 0, 64, s)
        if not dev.wait_stream(s, B.t(10)):
            raise Timeout("memset")
        drv.call(
            drv.cu.cuStreamBeginCapture, s, drv.cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        )
        cap_err = None
        try:
            drv.call(drv.cu.cuStreamWriteValue32, s, buf, 42, 0)
            drv.call(drv.cu.cuStreamWaitValue32, s, buf, 42, EQ)
            drv.launch(f, drv.KernelArgs(PTR(buf + 64), U32(0)), s)
        except Exception as e:
            cap_err = f"{type(e).__name__}: {e}"
        finally:
            r = drv.cu.cuStreamEndCapture(s)
        if cap_err:
            res.update(
                status="ok",
                captured=False,
                capture_error=cap_err,
                end_capture="ok" if int(r[0]) == 0 else drv.err_text(r[0]),
            )
            return res
        graph = drv.check(r, "cuStreamEndCapture")
        G.graphs.append(graph)
        types = drv.node_types(graph)
        res["captured"] = True
        res["node_types"] = types
        res["mem_ops_became_nodes"] = any("MEM_OP" in t for t in types)
        ge = G.instantiate(graph)
        drv.launch_graph(ge, s)
        if not dev.wait_stream(s, B.t(10)):
            raise Timeout("captured graph did not finish")
        v = dev.read_u32(buf, 1, s)[0]
        st = dev.read_u64(buf + 64, 1, s)[0]
        res["captured_graph_runs"] = {
            "ok": int(v) == 42 and int(st) > 0,
            "flag": int(v),
            "stamp_written": int(st) > 0,
        }

        # can such a graph sit inside a WHILE body (as a child graph)?
        def in_while():
            state = dev.malloc(256)
            stamps = dev.malloc(64)
            try:
                ge2 = counted_while_around(P, G, graph, state, stamps, 8)
                drv.memset_d32(buf, 0, 1, s)
                ms, cnt = run_counted_graph(P, ge2, state, 3, s)
                return {"ok": cnt == 3, "count": cnt, "status": "ok"}
            finally:
                if not P.tainted:
                    dev.free(state)
                    dev.free(stamps)

        res["mem_op_graph_in_while_body"] = sub(in_while)
        res["status"] = "ok"
        return res
    finally:
        G.destroy()
        if not P.tainted:
            dev.free(buf)


def probe_memops(P: Probe) -> dict:
    out: dict = {
        "what": "stream memory operations as a cross-stream handoff, and whether stream capture "
        "records them as graph nodes",
        "table": [],
    }
    out["handoff_memops"] = hm = sub(_memop_handoff, P, False)
    out["handoff_events"] = he = sub(_memop_handoff, P, True)
    out["capture"] = cap = sub(_memop_capture, P)
    out["table"].append(
        trow("write->wait handoff one-way (memops)", hm.get("one_way_both"), note=hm.get("status", ""))
    )
    out["table"].append(
        trow("record->wait handoff one-way (events)", he.get("one_way_both"), note=he.get("status", ""))
    )
    note = cap.get("status", "")
    if "node_types" in cap:
        note = "nodes: " + ",".join(t.replace("CU_GRAPH_NODE_TYPE_", "") for t in cap["node_types"])
        runs = (cap.get("captured_graph_runs") or {}).get("ok")
        note += f"; runs={'yes' if runs else 'NO'}"
        wb = cap.get("mem_op_graph_in_while_body") or {}
        note += f"; in WHILE body: {'yes' if wb.get('ok') else wb.get('status')}"
    elif cap.get("capture_error"):
        note = "capture failed: " + cap["capture_error"][:60]
    out["table"].append(["capture of write/wait value", None, None, "", note])
    out["status"] = "ok" if all(r.get("status") == "ok" for r in (hm, he, cap)) else "partial"
    return out
