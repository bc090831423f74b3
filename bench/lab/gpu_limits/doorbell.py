"""Probe 1, doorbell: host -> device round trip through pinned host words, the device polling
by spinning and with __nanosleep 0/100/1000 ns."""

from __future__ import annotations

import time

import numpy as np

from ringleader.bench.lab.gpu_limits.common import PTR, U32, U64, Timeout, sub, summarize, trow, wait_until
from ringleader.bench.lab.gpu_limits.device import Ctl, Probe
from ringleader.bench.lab.gpu_limits.kernels import (
    CTL_ANSWER,
    CTL_DOORBELL,
    CTL_HANDLED,
    CTL_POLLS_HI,
    CTL_POLLS_LO,
    CTL_STARTED,
)
from ringleader.device.backends import cuda_driver as drv


def _doorbell_floor(ctl: Ctl, n: int) -> dict:
    """The Python host loop alone: answer already equal, no device involved."""
    w = ctl.w
    pc = time.perf_counter_ns
    out = np.empty(n, np.int64)
    for i in range(n):
        seq = (i + 1) & 0x7FFFFFFF
        w[CTL_ANSWER] = seq
        t0 = pc()
        w[CTL_DOORBELL] = seq
        dl = t0 + 1_000_000_000
        while w[CTL_ANSWER] != seq:
            if pc() > dl:
                break
        out[i] = pc() - t0
    return summarize(out)


def _doorbell_variant(P: Probe, f, sleep_ns: int, use_sleep: int) -> dict:
    dev, B = P.dev, P.B
    s = P.sched_stream
    ctl = dev.new_ctl(f"doorbell sleep={sleep_ns if use_sleep else 'none'}")
    w = ctl.w
    total = B.db_warm + B.db_reps
    res: dict = {"device_poll": f"__nanosleep({sleep_ns})" if use_sleep else "spin (no sleep)"}
    samples = np.zeros(total, np.int64)
    done = 0
    drv.launch(
        f, drv.KernelArgs(PTR(ctl.dptr), U32(sleep_ns), U32(use_sleep), U32(0), U64(B.kernel_budget_ns)), s
    )
    try:
        if not wait_until(lambda: w[CTL_STARTED] == 1, B.t(20)):
            raise Timeout("persistent kernel did not start within 20 s")
        pc = time.perf_counter_ns
        limit = int(B.t(0.5) * 1e9)
        for i in range(total):
            seq = i + 1
            t0 = pc()
            w[CTL_DOORBELL] = seq
            dl = t0 + limit
            while w[CTL_ANSWER] != seq:
                if pc() > dl:
                    break
            t1 = pc()
            if w[CTL_ANSWER] != seq:
                res["status"] = "timeout"
                res["where"] = f"no answer to doorbell {seq} within {limit / 1e9:.2f} s"
                break
            samples[i] = t1 - t0
            done += 1
    finally:
        exited = P.stop_and_wait(ctl, s, "doorbell")
    handled = int(w[CTL_HANDLED])
    polls = int(w[CTL_POLLS_LO]) | (int(w[CTL_POLLS_HI]) << 32)
    res["round_trip"] = summarize(samples[B.db_warm : done]) if done > B.db_warm else {"n": 0}
    res["warmup_discarded"] = B.db_warm
    res["device_polls"] = polls
    res["kernel_exit"] = ctl.exit_reason if exited else "did_not_exit"
    ok = done == total and handled == total and ctl.exit_reason in ("stop_word", "shutdown_word")
    res["check"] = {
        "ok": ok,
        "echoed": done,
        "expected": total,
        "kernel_handled": handled,
        "what": "each doorbell sequence number echoed back exactly once",
    }
    if "status" not in res:
        res["status"] = "ok" if ok else "failed_check"
    return res


def probe_doorbell(P: Probe) -> dict:
    f = P.fn("rl_doorbell")
    out: dict = {
        "what": "host writes a pinned word, a 1-thread persistent kernel (ld.acquire.sys) echoes it "
        "into another pinned word, host polls it; host-side perf_counter_ns round trip",
        "variants": {},
        "table": [],
    }
    ctl = P.dev.new_ctl("doorbell floor")
    out["host_loop_floor"] = _doorbell_floor(ctl, P.B.db_reps)
    out["table"].append(trow("host loop floor (no device)", out["host_loop_floor"]))
    for label, ns, use in (
        ("spin", 0, 0),
        ("nanosleep_0", 0, 1),
        ("nanosleep_100", 100, 1),
        ("nanosleep_1000", 1000, 1),
    ):
        if P.tainted:
            r = {"status": "skipped", "reason": P.tainted}
        else:
            r = sub(_doorbell_variant, P, f, ns, use)
        out["variants"][label] = r
        ok = (r.get("check") or {}).get("ok")
        out["table"].append(
            trow(
                f"doorbell RTT, device {label}",
                r.get("round_trip"),
                note=r["status"] if not ok else "echo ok",
            )
        )
    out["status"] = "ok" if all(v.get("status") == "ok" for v in out["variants"].values()) else "partial"
    return out
