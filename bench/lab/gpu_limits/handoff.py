"""Probe 2, handoff: %globaltimer resolution, and the device -> device one-way latency between
two resident kernels on two streams through a device-memory flag."""

from __future__ import annotations

import time

import numpy as np

from ringleader.bench.lab.gpu_limits.common import PTR, U32, U64, Timeout, sub, summarize, trow
from ringleader.bench.lab.gpu_limits.device import Probe
from ringleader.bench.lab.gpu_limits.kernels import CTL_DONE0, CTL_DONE1
from ringleader.device.backends import cuda_driver as drv


def _timer_resolution(P: Probe) -> dict:
    f = P.fn("rl_timer_res")
    s = P.work_stream
    buf = P.dev.malloc(64)
    try:
        drv.memset_d32(buf, 0, 16, s)
        drv.launch(f, drv.KernelArgs(PTR(buf), U32(P.B.timer_reads)), s)
        if not P.dev.wait_stream(s, P.B.t(20)):
            raise Timeout("rl_timer_res did not finish")
        v = P.dev.read_u64(buf, 3, s)
    finally:
        P.dev.free(buf)
    minstep, changes, span = int(v[0]), int(v[1]), int(v[2])
    return {
        "reads": P.B.timer_reads,
        "min_step_ns": minstep if changes else None,
        "changes": changes,
        "span_ns": span,
        "mean_step_ns": (span / changes) if changes else None,
        "check": {"ok": changes > 0 and span > 0},
    }


def _pingpong(P: Probe) -> dict:
    dev, B = P.dev, P.B
    f = P.fn("rl_pingpong")
    n = B.pp_n
    warm = min(B.pp_warm, n // 2)
    sa, sb, s = P.stream_a, P.stream_b, P.work_stream
    flag = dev.malloc(256)
    stamps = dev.malloc(4 * 8 * n)
    ping_send, ping_recv, pong_send, pong_recv = (stamps + k * 8 * n for k in range(4))
    ctl = dev.new_ctl("pingpong")
    res: dict = {"iterations": n, "warmup_discarded": warm}
    try:
        drv.memset_d32(flag, 0, 64, s)
        drv.memset_d32(stamps, 0, 4 * 2 * n, s)
        if not dev.wait_stream(s, B.t(10)):
            raise Timeout("memset")
        budget = U64(int(B.t(20) * 1e9))
        drv.launch(
            f,
            drv.KernelArgs(PTR(flag), U32(1), U32(n), PTR(pong_send), PTR(pong_recv), PTR(ctl.dptr), budget),
            sb,
        )
        drv.launch(
            f,
            drv.KernelArgs(PTR(flag), U32(0), U32(n), PTR(ping_send), PTR(ping_recv), PTR(ctl.dptr), budget),
            sa,
        )
        t0 = time.monotonic()
        ok_a = dev.wait_stream(sa, B.t(25))
        ok_b = ok_a and dev.wait_stream(sb, B.t(5))
        res["host_wall_s"] = round(time.monotonic() - t0, 4)
        if not (ok_a and ok_b):
            ctl.stop()
            ea, eb = dev.wait_stream(sa, B.t(10)), dev.wait_stream(sb, B.t(10))
            if not (ea and eb):
                P.taint("ping-pong kernels did not exit")
            res.update(
                status="timeout",
                where="ping-pong did not finish",
                done=[int(ctl.w[CTL_DONE0]), int(ctl.w[CTL_DONE1])],
                kernel_exit=ctl.exit_reason,
            )
            return res
        ps = dev.read_u64(ping_send, n, s).astype(np.int64)
        pr = dev.read_u64(ping_recv, n, s).astype(np.int64)
        qs = dev.read_u64(pong_send, n, s).astype(np.int64)
        qr = dev.read_u64(pong_recv, n, s).astype(np.int64)
        final_flag = int(dev.read_u32(flag, 1, s)[0])
    finally:
        dev.free(flag)
        dev.free(stamps)
    d0, d1 = int(ctl.w[CTL_DONE0]), int(ctl.w[CTL_DONE1])
    a2b = qr - ps  # ping -> pong
    b2a = pr - qs  # pong -> ping
    rtt = pr - ps
    sl = slice(warm, n)
    monotone = bool(np.all(a2b >= 0) and np.all(b2a >= 0))
    nonzero = bool(np.all(ps > 0) and np.all(pr > 0) and np.all(qs > 0) and np.all(qr > 0))
    ok = d0 == n and d1 == n and final_flag == 2 * n and monotone and nonzero
    res["ping_to_pong"] = summarize(a2b[sl])
    res["pong_to_ping"] = summarize(b2a[sl])
    res["one_way_both"] = summarize(np.concatenate([a2b[sl], b2a[sl]]))
    res["round_trip"] = summarize(rtt[sl])
    span = float(pr[n - 1] - ps[warm])
    res["one_way_mean_from_total_ns"] = span / (2 * (n - warm)) if n > warm else None
    res["kernel_exit"] = ctl.exit_reason
    res["check"] = {
        "ok": ok,
        "done": [d0, d1],
        "expected": n,
        "final_flag": final_flag,
        "expected_flag": 2 * n,
        "stamps_ordered": monotone,
        "stamps_written": nonzero,
    }
    res["status"] = "ok" if ok else "failed_check"
    return res


def probe_handoff(P: Probe) -> dict:
    out: dict = {
        "what": "two 1-thread kernels resident on two streams hand a device-memory flag back and forth "
        "(st.release.gpu / ld.acquire.gpu); one-way latency from %globaltimer stamps",
        "table": [],
    }
    out["globaltimer"] = sub(_timer_resolution, P)
    out["pingpong"] = pp = sub(_pingpong, P)
    gt = out["globaltimer"]
    ok = (pp.get("check") or {}).get("ok")
    note = "ok" if ok else pp.get("status", "")
    if gt.get("min_step_ns"):
        note += f"; globaltimer step {gt['min_step_ns']} ns (mean {gt['mean_step_ns']:.0f})"
    out["table"].append(trow("d2d handoff one-way (both dirs)", pp.get("one_way_both"), note=note))
    out["table"].append(trow("d2d handoff round trip", pp.get("round_trip")))
    m = pp.get("one_way_mean_from_total_ns")
    out["table"].append(["d2d one-way, mean from total span", m / 1e3 if m else None, None, "us", ""])
    out["status"] = "ok" if gt.get("status") == "ok" and pp.get("status") == "ok" else "partial"
    return out
