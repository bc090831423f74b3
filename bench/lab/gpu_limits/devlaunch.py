"""Probe 8, devlaunch: CUDA graphs launched from the device (cudaGraphLaunch in a kernel).

The bubble's design question: could the scheduler start each step graph itself, with no host and
no WHILE/SWITCH node between steps? Measured here, each part on its own so one failure leaves
the others:
  * launch -> first kernel: a host-launched one-node graph whose kernel launches a one-node
    target graph, in each named mode (fire-and-forget, tail, sibling); the launcher's clock just
    before cudaGraphLaunch against the target's first read;
  * a tail self-loop: a graph that tail-launches itself n times (a step loop with no WHILE node),
    per iteration, beside probe 3's WHILE figure;
  * a persistent launcher: a kernel that never returns between steps launches the target
    fire-and-forget n times, waiting for each to run; launched as a graph's node, then plainly.
    Whether a launch succeeds, whether the launched graph runs while its launcher still spins,
    how soon, and how many launches one run of the launcher's graph allows (the first error).
The plain launch runs last: it is the one the CUDA documentation leaves least certain.
"""

from __future__ import annotations

import numpy as np

from ringleader.bench.lab.gpu_limits.common import PTR, U32, U64, Timeout, sub, summarize, trow
from ringleader.bench.lab.gpu_limits.device import Graphs, Probe
from ringleader.bench.lab.gpu_limits.kernels import CTL_DONE0
from ringleader.device.backends import cuda_driver as drv

MODES = {"fire_and_forget": 0, "tail": 1, "sibling": 2}  # RL_MODE_* in kernels.cu
WAIT_NS = 20_000_000  # how long the persistent launcher waits for one launch to run


class _Buffers:
    """state (u32 launches made, runs seen), stamps (2 per launch) and errs (1 per launch)."""

    def __init__(self, P: Probe, n: int):
        self.P, self.n = P, n
        self.state = P.dev.malloc(256)
        self.stamps = P.dev.malloc(16 * n)
        self.errs = P.dev.malloc(4 * n)
        s = P.work_stream
        drv.memset_d32(self.state, 0, 64, s)
        drv.memset_d32(self.stamps, 0, 4 * n, s)
        drv.memset_d32(self.errs, 0, n, s)
        if not P.dev.wait_stream(s, P.B.t(10)):
            raise Timeout("memset")

    def read(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        dev, s = self.P.dev, self.P.work_stream
        state = dev.read_u32(self.state, 2, s)
        errs = dev.read_u32(self.errs, self.n, s).view(np.int32)
        stamps = dev.read_u64(self.stamps, 2 * self.n, s).astype(np.int64)
        return state, errs, stamps

    def free(self) -> None:
        if not self.P.tainted:
            for p in (self.state, self.stamps, self.errs):
                self.P.dev.free(p)


def _target(P: Probe, G: Graphs, buf: _Buffers):
    g = G.create()
    drv.add_kernel_node(
        g, [], P.fn("rl_dl_target"), drv.KernelArgs(PTR(buf.state), PTR(buf.stamps), U32(buf.n))
    )
    ge = G.instantiate(g, device_launch=True)
    drv.upload_graph(ge, P.work_stream)  # a device launch needs the graph on the device already
    return ge


def _errors(errs: np.ndarray) -> dict:
    codes, counts = np.unique(errs[errs != 0], return_counts=True)
    return {str(int(c)): int(k) for c, k in zip(codes, counts)}


def _first_error(errs: np.ndarray, made: int) -> dict | None:
    bad = np.flatnonzero(errs[:made] != 0)
    return None if bad.size == 0 else {"index": int(bad[0]), "code": int(errs[bad[0]])}


def _launch_latency(P: Probe, G: Graphs, mode: int) -> dict:
    n = P.B.dl_reps
    buf = _Buffers(P, n)
    try:
        target = _target(P, G, buf)
        g = G.create()
        args = drv.KernelArgs(
            U64(int(target)), U32(mode), PTR(buf.state), PTR(buf.stamps), PTR(buf.errs), U32(n)
        )
        drv.add_kernel_node(g, [], P.fn("rl_dl_launch"), args)
        launcher = G.instantiate(g)
        s = P.work_stream
        for _ in range(n):
            drv.launch_graph(launcher, s)
        if not P.dev.wait_stream(s, P.B.t(10 + n * 1e-3)):
            raise Timeout(f"{n} device launches did not finish")
        state, errs, stamps = buf.read()
        made, ran = int(state[0]), int(state[1])
        # the j-th target run stamps slot 2j + 1 and belongs to the j-th launch that returned 0
        launched = np.flatnonzero(errs[:made] == 0)[:ran]
        runs = np.arange(launched.size)
        lat = stamps[2 * runs + 1] - stamps[2 * launched]
        warm = min(10, lat.size // 2)
        return {
            "launches": made,
            "targets_ran": ran,
            "errors": _errors(errs[:made]),
            "launch_to_first_kernel": summarize(lat[warm:]),
            "check": {
                "ok": made == n and ran == n and not np.any(errs[:made]),
                "what": "every device launch returned 0 and its graph ran once",
            },
        }
    finally:
        buf.free()


def _tail_loop(P: Probe, G: Graphs) -> dict:
    n = P.B.dl_loop_n
    buf = _Buffers(P, n)
    s = P.work_stream
    try:
        drv.memset_d32(buf.state + 4, n, 1, s)  # the loop's length
        g = G.create()
        args = drv.KernelArgs(PTR(buf.state), PTR(buf.stamps), PTR(buf.errs), U32(n))
        drv.add_kernel_node(g, [], P.fn("rl_dl_tail_loop"), args)
        ge = G.instantiate(g, device_launch=True)
        drv.upload_graph(ge, s)
        drv.record_event(P.ev0, s)
        drv.launch_graph(ge, s)  # the first run from the host; each run relaunches the next
        drv.record_event(P.ev1, s)
        if not P.dev.wait_event(P.ev1, P.B.t(10 + n * 1e-4)):
            raise Timeout(f"tail self-loop of {n} did not finish")
        ms = drv.elapsed_ms(P.ev0, P.ev1)
        count = int(P.dev.read_u32(buf.state, 1, s)[0])
        errs = P.dev.read_u32(buf.errs, 2, s).view(np.int32)
        st = P.dev.read_u64(buf.stamps, min(count, n), s).astype(np.int64)
        d = np.diff(st)
        skip = min(10, d.size // 2)
        return {
            "iterations": n,
            "count": count,
            "first_relaunch_error": None
            if errs[0] == 0
            else {"code": int(errs[0]), "iteration": int(errs[1])},
            "per_iteration_from_stamps": summarize(d[skip:]),
            "per_iteration_from_events_us": ms * 1e3 / max(count, 1),
            "check": {"ok": count == n and errs[0] == 0, "what": "the graph relaunched itself n - 1 times"},
        }
    finally:
        buf.free()


def _persistent(P: Probe, G: Graphs, in_graph: bool) -> dict:
    n = P.B.dl_persistent_n
    buf = _Buffers(P, n)
    ctl = P.dev.new_ctl("devlaunch-persistent")
    s = P.sched_stream
    try:
        targets = [_target(P, G, buf) for _ in range(4)]  # taking turns: see rl_dl_persistent
        args = drv.KernelArgs(
            *(U64(int(t)) for t in targets),
            U32(n),
            PTR(buf.state),
            PTR(buf.stamps),
            PTR(buf.errs),
            PTR(ctl.dptr),
            U64(WAIT_NS),
            U64(int(P.B.t(5) * 1e9)),
        )
        f = P.fn("rl_dl_persistent")
        if in_graph:
            g = G.create()
            drv.add_kernel_node(g, [], f, args)
            drv.launch_graph(G.instantiate(g), s)
        else:
            drv.launch(f, args, s)
        if not P.dev.wait_stream(s, P.B.t(10)):
            P.stop_and_wait(ctl, s, "devlaunch persistent launcher")
            raise Timeout("persistent launcher did not end by its own deadline")
        ran_by_exit = int(ctl.w[CTL_DONE0])
        state, errs, stamps = buf.read()  # after the launcher's stream drained: late runs show here
        made, ran = int(state[0]), int(state[1])
        idx = np.arange(min(ran_by_exit, n))
        lat = stamps[2 * idx + 1] - stamps[2 * idx]
        return {
            "launched_as": "graph node" if in_graph else "plain kernel",
            "requested": n,
            "launches_made": made,
            "ran_while_launcher_waited": ran_by_exit,
            "ran_by_the_end": ran,
            "exit": ctl.exit_reason,
            "first_error": _first_error(errs, made),
            "launch_to_first_kernel": summarize(lat[min(5, lat.size // 2) :]),
            "check": {
                # a finding either way: this records what the driver allows, it does not require it
                "ok": made >= 1 and ctl.exit_reason != "still_running",
                "what": "the launcher ended by itself and its answer was read",
            },
        }
    finally:
        buf.free()


def probe_devlaunch(P: Probe) -> dict:
    out: dict = {
        "what": "graphs launched from the device: launch-to-first-kernel per mode, a tail self-loop, "
        "a persistent launcher in a graph and plain",
        "table": [],
    }
    G = Graphs()
    try:
        for name, mode in MODES.items():
            out[f"launch_{name}"] = sub(_launch_latency, P, G, mode)
        out["tail_self_loop"] = sub(_tail_loop, P, G)
        out["persistent_in_graph"] = sub(_persistent, P, G, True)
        out["persistent_plain"] = sub(_persistent, P, G, False)
    finally:
        if not P.tainted:
            G.destroy()
    t = out["table"]
    for name in MODES:
        r = out[f"launch_{name}"]
        note = r.get("status", "") + (f" errors {r['errors']}" if r.get("errors") else "")
        t.append(trow(f"device launch ({name}) -> first kernel", r.get("launch_to_first_kernel"), note=note))
    tl = out["tail_self_loop"]
    t.append(
        trow(
            "tail self-loop, per iteration (stamps)",
            tl.get("per_iteration_from_stamps"),
            note=tl.get("status", ""),
        )
    )
    for key in ("persistent_in_graph", "persistent_plain"):
        r = out[key]
        note = f"{r.get('ran_while_launcher_waited')}/{r.get('requested')} ran, exit {r.get('exit')}"
        if r.get("first_error"):
            note += f", first error {r['first_error']}"
        t.append(
            trow(
                f"persistent launcher ({r.get('launched_as', key)}) -> first kernel",
                r.get("launch_to_first_kernel"),
                note=note if r.get("status") == "ok" else r.get("status", ""),
            )
        )
    parts = [out[f"launch_{m}"] for m in MODES] + [tl, out["persistent_in_graph"], out["persistent_plain"]]
    out["status"] = "ok" if all(r.get("status") == "ok" for r in parts) else "partial"
    return out
