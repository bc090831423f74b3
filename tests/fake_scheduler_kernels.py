"""The scheduler module's kernels (device/sched/kernel.cu) as FakeDriver (tests/fake_cuda_driver.py)
runs them, for DeviceScheduled's host side (tests/test_device_scheduled_simulated.py).

Each kernel is a Python method on a fake stream's thread, over the real arrays of an RlContext
(ipc/layout.py, passed by value as the real kernels take it): the persistent scheduler checks the
control block's magic and version as sched_init does (else FAILED with its error code), reports
RUNNING, hands steps to the step graph through `turn` (SCHED -> COMPUTE, the bucket in the step
header, a trace row) and publishes one CQ tail advance per step; it exits (exit reason, state
EXITED, then turn EXIT) on shutdown, on its run budget, or when compute keeps the turn past the
stop grace.  rl_step_wait/rl_step_begin/rl_step_signal follow sched_loop.h: the wait ends on
COMPUTE or EXIT (or when no scheduler is left: EXITED, FAILED), picks the SWITCH branch of the
step's bucket and ends the WHILE loop on exit.

Not simulated: the scheduler's real work (SQ, slots, pages, CQ event contents: only the tail
moves), its block of threads, the device's memory model.  Steps are handed out only while the
test allows (`allow_steps`, None: always), so an idle scheduler is simulated too.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
from typing import ClassVar

import numpy as np

from ringleader.device.sched.build import KERNEL_NAME
from ringleader.ipc import layout
from tests.fake_cuda_driver import FakeDriver
from tests.fake_gpu_kernels import now_ns, read_u32, write_u32

TEST_STEP = "rl_test_step"  # the stand-in step graph's one kernel: counts the steps of a bucket
# A module holding only that kernel, as FakeDriver's module loading reads an image
TEST_STEP_IMAGE = b"\x7fELF\0.text." + TEST_STEP.encode() + b"\0"
N_CONTEXT = len(layout.ARRAYS)  # RlContext: one pointer per array
POLL_S = 50e-6  # a fake kernel's pause between two polls of a word

S, T, X = layout.SchedulerState, layout.Turn, layout.ExitReason
F = layout.TraceField


def _struct_at(address: int, struct: layout.Struct) -> np.ndarray:
    """A one-element structured array over the struct at `address`."""
    raw = (ctypes.c_uint8 * struct.size).from_address(address)
    return np.frombuffer(raw, dtype=struct.numpy_dtype())


class _Context:
    """The arrays of one RlContext (its pointers, by value), viewed where they lie."""

    def __init__(self, words: tuple[int, ...]):
        addr = dict(zip((name for name, _, _ in layout.ARRAYS), words))
        self.cfg = _struct_at(addr["cfg"], layout.CONFIG)[0]
        self.ctl = _struct_at(addr["ctl"], layout.CONTROL)
        self.step = _struct_at(addr["step"], layout.STEP)
        self._turn = addr["turn"]
        n = int(self.cfg["trace_len"])
        trace = (ctypes.c_uint64 * (n * layout.TRACE_FIELDS)).from_address(addr["trace"])
        self.trace = np.ctypeslib.as_array(trace).reshape(n, layout.TRACE_FIELDS)

    def get(self, field: str) -> int:
        return int(self.ctl[field][0])

    def put(self, field: str, value: int) -> None:
        self.ctl[field][0] = value

    @property
    def turn(self) -> int:
        return read_u32(self._turn)

    @turn.setter
    def turn(self, value: int) -> None:
        write_u32(self._turn, value)

    def row(self) -> np.ndarray:
        """The trace row of the step in the step header."""
        return self.trace[int(self.step["seq"][0]) % len(self.trace)]


class FakeSchedulerDriver(FakeDriver):
    """FakeDriver with the scheduler module's kernels, and what the tests steer and count.

    Steering: allow_steps (steps the scheduler may still hand out; None: unbounded),
    ignore_shutdown (the kernel never reads shutdown: a hung kernel), step_period_s (a step's
    pause in the scheduler), refuse_scheduler_launch (cuLaunchKernel of the scheduler fails
    with that CUresult), unsupported (driver features refused with
    CUDA_ERROR_NOT_SUPPORTED: "CU_GRAPH_COND_TYPE_WHILE" at cuGraphAddNode, "instantiate WHILE"
    at cuGraphInstantiate of a graph holding a WHILE node), halt (the test's teardown: every fake
    kernel ends, as a device reset would end them).
    Counts: scheduler launches and blocks, steps handed out and signalled, steps run per bucket
    index, graph launches per exec, destroyed graphs and execs."""

    SIGS: ClassVar[dict[str, str]] = {
        **FakeDriver.SIGS,
        KERNEL_NAME: "R",
        "rl_step_wait": "RQQI",
        "rl_step_begin": "R",
        "rl_step_signal": "R",
        TEST_STEP: "QI",
    }
    MAX_BLOCK: ClassVar[dict[str, int]] = {KERNEL_NAME: 1024}

    def __init__(self):
        super().__init__(None)  # the gpu_limits layout: none of its kernels run here
        self.allow_steps: int | None = None
        self.ignore_shutdown = False
        self.step_period_s = 0.002
        self.unsupported: set[str] = set()
        self.refuse_scheduler_launch: str | None = None  # a CUresult name the launch returns
        self.halt = threading.Event()
        self.scheduler_blocks: list[int] = []
        self.steps_handed = 0
        self.steps_signalled = 0
        self.graph_launches: collections.Counter = collections.Counter()
        self.destroyed_graphs: set[int] = set()
        self.destroyed_execs: set[int] = set()

    def _decode_arg(self, ch, p):
        if ch == "R":  # RlContext by value
            return tuple((ctypes.c_uint64 * N_CONTEXT).from_address(p))
        return super()._decode_arg(ch, p)

    # -- driver calls the device-scheduled engine adds to the probe's
    def f_cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, s, kp, extra):
        if self._funcs[int(f)] == KERNEL_NAME:
            self.scheduler_blocks.append(int(bx))
            if self.refuse_scheduler_launch:
                return (getattr(self._real.CUresult, self.refuse_scheduler_launch),)
        return super().f_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, smem, s, kp, extra)

    def f_cuEventSynchronize(self, ev):
        e = self._events[int(ev)]
        while e["done"] < e["gen"]:
            time.sleep(POLL_S)
        return (self.S,)

    def f_cuGraphLaunch(self, ge, s):
        self.graph_launches[int(ge)] += 1
        return super().f_cuGraphLaunch(ge, s)

    def f_cuGraphDestroy(self, g):
        assert int(g) in self._graphs, "cuGraphDestroy of an unknown graph"
        self.destroyed_graphs.add(int(g))
        return super().f_cuGraphDestroy(g)

    def f_cuGraphExecDestroy(self, ge):
        assert int(ge) in self._execs, "cuGraphExecDestroy of an unknown exec"
        self.destroyed_execs.add(int(ge))
        return super().f_cuGraphExecDestroy(ge)

    def f_cuGraphAddNode(self, g, deps, dep_data, ndeps, p):
        if p.conditional.type.name in self.unsupported:
            return (self._real.CUresult.CUDA_ERROR_NOT_SUPPORTED, None)
        return super().f_cuGraphAddNode(g, deps, dep_data, ndeps, p)

    def f_cuGraphInstantiate(self, g, flags):
        WHILE = int(self._real.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE)
        nodes = self._graphs[int(g)].nodes
        if "instantiate WHILE" in self.unsupported and any(
            n.kind == "CONDITIONAL" and int(n.ctype) == WHILE for n in nodes
        ):
            return (self._real.CUresult.CUDA_ERROR_NOT_SUPPORTED, None)
        return super().f_cuGraphInstantiate(g, flags)

    # -- the persistent scheduler (kernel.cu: sched_persistent)
    def k_rl_scheduler_persistent(self, ctx):
        c = _Context(ctx)
        err = self._init_error(c)
        if err != layout.InitError.NONE:
            c.put("error_code", err)
            c.put("state", S.FAILED)
            c.turn = T.EXIT  # a step graph already launched must not wait for it
            return
        started = now_ns()
        grace, budget = c.get("stop_grace_ns"), c.get("run_budget_ns")
        c.put("state", S.RUNNING)
        seq, stop = 0, X.NONE
        while True:
            late = self._wait_for_turn(c, started, budget, grace)
            if late != X.NONE or stop != X.NONE:
                self._mark_exited(c, late if late != X.NONE else stop)
                break
            built = self._take_step()
            if built:  # the critical phase: the step's bucket and seq, its trace row
                self._build_step(c, seq)
                c.turn = T.COMPUTE
                self.steps_handed += 1
            # the overlapped phase: the step's CQ event published, the stop looked for
            if built:
                c.row()[F.OVERLAP_END] = now_ns()
                c.put("cq_tail", c.get("cq_tail") + 1)
                seq += 1
            c.put("heartbeat_ns", now_ns())
            stop = self._stop_reason(c, started, budget)
            if stop != X.NONE and not built:
                self._mark_exited(c, stop)
                break
            time.sleep(self.step_period_s)
        c.turn = T.EXIT

    def _init_error(self, c: _Context) -> int:
        if c.get("magic") != layout.MAGIC or int(c.cfg["magic"]) != layout.MAGIC:
            return layout.InitError.BAD_MAGIC
        if c.get("version") != layout.LAYOUT_VERSION:
            return layout.InitError.BAD_VERSION
        if not 0 < int(c.cfg["n_buckets"]) <= layout.MAX_BUCKETS:
            return layout.InitError.BAD_CONFIG
        return layout.InitError.NONE

    def _take_step(self) -> bool:
        if self.allow_steps is None:
            return True
        if self.allow_steps > 0:
            self.allow_steps -= 1
            return True
        return False

    def _build_step(self, c: _Context, seq: int) -> None:
        n = int(c.cfg["n_buckets"])
        c.step["bucket"][0] = int(c.cfg["buckets"][seq % n])
        c.step["seq"][0] = seq
        row = c.row()
        row[:] = 0
        row[F.SCHED_BEGIN] = now_ns()
        row[F.SEQ] = seq + 1
        row[F.FLAGS] = layout.TraceFlag.CHAINED if seq else 0
        row[F.SCHED_END] = row[F.OVERLAP_BEGIN] = now_ns()

    def _stop_reason(self, c: _Context, started: int, budget: int) -> int:
        if self.halt.is_set() or (not self.ignore_shutdown and c.get("shutdown")):
            return X.SHUTDOWN
        if budget and now_ns() - started > budget:
            return X.BUDGET
        return X.NONE

    def _wait_for_turn(self, c: _Context, started: int, budget: int, grace: int) -> int:
        """NONE once compute handed the turn back; DEADLINE when it kept it past the grace
        after a stop (sched_loop.h: rl_wait_for_turn)."""
        stop_seen = None
        while c.turn != T.SCHED:
            if self._stop_reason(c, started, budget) != X.NONE:
                now = now_ns()
                if stop_seen is None:
                    stop_seen = now
                elif now - stop_seen > grace or self.halt.is_set():
                    return X.DEADLINE
            time.sleep(POLL_S)
        return X.NONE

    @staticmethod
    def _mark_exited(c: _Context, reason: int) -> None:
        c.put("exit_reason", reason)  # before state = EXITED
        c.put("state", S.EXITED)

    # -- the launch graph's kernels (kernel.cu: rl_step_wait, rl_step_begin, rl_step_signal)
    def k_rl_step_wait(self, ctx, switch_handle, while_handle, use_while):
        c = _Context(ctx)
        turn = self._wait_for_step(c)
        if turn != T.COMPUTE and use_while:
            self._set_cond(while_handle, 0)
        self._set_cond(switch_handle, self._branch(c, turn))

    def _wait_for_step(self, c: _Context) -> int:
        while True:
            turn = c.turn
            if turn != T.SCHED:
                return turn
            state = c.get("state")
            if state in (S.EXITED, S.FAILED) or (state != S.RUNNING and c.get("shutdown")):
                return T.EXIT
            if self.halt.is_set():
                return T.EXIT
            time.sleep(POLL_S)

    @staticmethod
    def _branch(c: _Context, turn: int) -> int:
        """The SWITCH branch of the step's bucket; n_buckets (no branch) when not COMPUTE."""
        n = int(c.cfg["n_buckets"])
        if turn != T.COMPUTE:
            return n
        buckets = [int(b) for b in c.cfg["buckets"][:n]]
        bucket = int(c.step["bucket"][0])
        return buckets.index(bucket) if bucket in buckets else n

    def k_rl_step_begin(self, ctx):
        c = _Context(ctx)
        c.row()[F.STEP_BEGIN] = now_ns()

    def k_rl_step_signal(self, ctx):
        c = _Context(ctx)
        if c.turn != T.COMPUTE:  # the exit path: the wait already ended the loop
            return
        c.row()[F.STEP_END] = now_ns()
        self.steps_signalled += 1
        c.turn = T.SCHED

    def k_rl_test_step(self, counters, index):
        write_u32(counters + 4 * index, read_u32(counters + 4 * index) + 1)
