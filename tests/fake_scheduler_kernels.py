"""The scheduler module's kernels (device/sched/kernel.cu) as FakeDriver (tests/fake_cuda_driver.py)
runs them, for DeviceScheduled's host side (tests/test_device_scheduled_simulated.py).

Each kernel is a Python method on a fake stream's thread, over the real arrays of an RlContext
(ipc/layout.py, passed by value as the real kernels take it): the persistent scheduler checks the
control block's magic and version as sched_init does (else FAILED with its error code), reports
RUNNING, hands steps to the step graph through `turn` (SCHED -> COMPUTE, the bucket in the step
header, a trace row, then launch.released = seq + 1) and publishes one CQ tail advance per step;
with cfg.plan_ahead (read once, at start) it publishes each next step's bucket ahead
(in the slot of the seq's parity: launch.plan_bucket[seq & 1], then plan_seq[seq & 1] = seq + 1) from
its overlapped phase when no stop is seen, and
hands over exactly the planned step; it exits (exit reason, state EXITED, a plan still out made
void, then turn EXIT) on shutdown, on its run budget, or when compute keeps the turn past the stop
grace.  The launch graphs' kernels are not simulated: they are the CPU build's nodes of the
same names and parameters (device/sched/sched_loop.h, the text kernel.cu compiles), called with
the context's address and a word per conditional handle, which this driver then gives the handle
(rl_step_wait/rl_step_begin/rl_step_signal: resident, pump; rl_plan_wait/rl_step_gate/
rl_signal_pingpong: ping-pong).  So the graphs launch_graph.py builds run the nodes the GPU runs.

Not simulated: the scheduler's real work (SQ, slots, pages, CQ event contents: only the tail
moves), its block of threads and shared memory (the launch's size is only recorded), the
device's memory model, the idle back-off.  Steps
are handed out only while the test allows (`allow_steps`, None: always), so an idle scheduler is
simulated too.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
from typing import ClassVar

import numpy as np

from ringleader.device.sched.build import GRAPH_NODES, KERNEL_NAME, cpu_scheduler
from ringleader.ipc import layout
from tests.fake_cuda_driver import FakeDriver, _FNode
from tests.fake_gpu_kernels import now_ns, read_u32, write_u32

TEST_STEP = "rl_test_step"  # the stand-in step graph's one kernel: counts the steps of a bucket
# A module holding only that kernel, as FakeDriver's module loading reads an image
TEST_STEP_IMAGE = b"\x7fELF\0.text." + TEST_STEP.encode() + b"\0"
N_CONTEXT = len(layout.ARRAYS)  # RlContext: one pointer per array
TURN_INDEX = [name for name, _, _ in layout.ARRAYS].index("turn")
SIG_OF = {"handle": "Q", "u32": "I"}  # a graph node's parameter kinds as FakeDriver decodes them
UNSET = 0xFFFFFFFF  # a conditional word no node has set
POLL_S = 50e-6  # a fake kernel's pause between two polls of a word

S, T, X = layout.SchedulerState, layout.Turn, layout.ExitReason
F = layout.TraceField
LAUNCH_OFFSETS = {name: off for name, (_, off) in layout.LAUNCH.numpy_dtype().fields.items()}


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
        self._launch = addr["launch"]
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

    def word(self, name: str, index: int = 0) -> int:
        """A launch word (RlLaunchWords), e.g. word("graph_seq", 1)."""
        return read_u32(self._launch + LAUNCH_OFFSETS[name] + 4 * index)

    def set_word(self, name: str, value: int, index: int = 0) -> None:
        write_u32(self._launch + LAUNCH_OFFSETS[name] + 4 * index, value)

    def buckets(self) -> list[int]:
        return [int(b) for b in self.cfg["buckets"][: int(self.cfg["n_buckets"])]]

    def compute_must_exit(self) -> bool:
        """sched_loop.h: turn EXIT, or rl_scheduler_gone (the waits look at both)."""
        if self.turn == T.EXIT:
            return True
        state = self.get("state")
        return state in (S.EXITED, S.FAILED) or (state != S.RUNNING and self.get("shutdown") != 0)

    def row(self) -> np.ndarray:
        """The trace row of the step in the step header."""
        return self.trace[int(self.step["seq"][0]) % len(self.trace)]


class _Halt(threading.Event):
    """The tests' teardown, as a device reset: every fake kernel ends, the CPU build's waiting
    nodes too (their turn words say EXIT)."""

    def __init__(self, fake):
        super().__init__()
        self._fake = fake

    def set(self) -> None:
        super().set()
        for address in self._fake._turns:
            write_u32(address, T.EXIT)


class FakeSchedulerDriver(FakeDriver):
    """FakeDriver with the scheduler module's kernels, and what the tests steer and count.

    Steering: allow_steps (steps the scheduler may still hand out; None: unbounded),
    ignore_shutdown (the kernel never reads shutdown: a hung kernel), step_period_s (a step's
    pause in the scheduler), step_hold_s (each step's own time in the step graph),
    refuse_scheduler_launch (cuLaunchKernel of the scheduler fails with that CUresult),
    unsupported (driver features refused with CUDA_ERROR_NOT_SUPPORTED:
    "CU_GRAPH_COND_TYPE_WHILE" at cuGraphAddNode, "instantiate WHILE" at cuGraphInstantiate of a
    graph holding a WHILE node, "rl_plan_wait" at cuGraphAddKernelNode of that kernel: the
    ping-pong graphs alone refused), refuse_instantiations (the 1-based counts of the
    cuGraphInstantiate calls refused so), halt (the test's teardown: every fake kernel ends, as a
    device reset would end them).
    Shared memory as CUDA bounds it: a launch or kernel node above the function's dynamic limit
    (48 KiB less its static part until cuFuncSetAttribute opts in, up to SHARED_OPTIN less it)
    is refused with CUDA_ERROR_INVALID_VALUE.
    Counts: scheduler launches, blocks and dynamic shared bytes, the plan_ahead each scheduler
    read, steps handed out and signalled, (parity, seq) of each step a ping-pong gate let
    through, planned steps made void, steps run per bucket index, graph launches per exec,
    destroyed graphs and execs."""

    SIGS: ClassVar[dict[str, str]] = {
        **FakeDriver.SIGS,
        KERNEL_NAME: "R",
        **{name: "R" + "".join(SIG_OF[kind] for kind in kinds) for name, kinds in GRAPH_NODES.items()},
        TEST_STEP: "QI",
    }
    MAX_BLOCK: ClassVar[dict[str, int]] = {KERNEL_NAME: 1024}
    # static shared memory by kernel (CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES; others 16, as FakeDriver's)
    STATIC_SHARED: ClassVar[dict[str, int]] = {KERNEL_NAME: 512}  # docs/scheduler.md, layout v12
    DEFAULT_SHARED_LIMIT = 48 << 10  # static + dynamic shared memory of a launch without opt-in
    SHARED_OPTIN = 227 << 10  # an H100's CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN

    def __init__(self):
        super().__init__(None)  # the gpu_limits layout: none of its kernels run here
        self.allow_steps: int | None = None
        self.ignore_shutdown = False
        self.step_period_s = 0.002
        self.step_hold_s = 0.0
        self.unsupported: set[str] = set()
        self.refuse_instantiations: set[int] = set()
        self._max_dynamic_shared: dict[int, int] = {}  # function id -> its opt-in, once set
        self._instantiations = 0
        self.refuse_scheduler_launch: str | None = None  # a CUresult name the launch returns
        self.halt = _Halt(self)
        self._turns: set[int] = set()  # the turn words the nodes were given
        self.scheduler_blocks: list[int] = []
        self.scheduler_shared: list[int] = []
        self.scheduler_plan_ahead: list[int] = []
        self.gated: list[tuple[int, int]] = []
        self.voided_steps = 0
        self.steps_handed = 0
        self.steps_signalled = 0
        self.graph_launches: collections.Counter = collections.Counter()
        self.destroyed_graphs: set[int] = set()
        self.cloned_graphs: set[int] = set()  # the step graphs copied for an in-step signal
        self.destroyed_execs: set[int] = set()

    def _decode_arg(self, ch, p):
        if ch == "R":  # RlContext by value
            return tuple((ctypes.c_uint64 * N_CONTEXT).from_address(p))
        return super()._decode_arg(ch, p)

    # -- driver calls the device-scheduled engine adds to the probe's
    def f_cuCtxGetDevice(self):
        return (self.S, self._real.CUdevice(0))

    def f_cuDeviceGetAttribute(self, attr, dev):
        if int(attr) == int(
            self._real.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        ):
            return (self.S, self.SHARED_OPTIN)
        return super().f_cuDeviceGetAttribute(attr, dev)

    def _static_shared(self, f) -> int:
        return self.STATIC_SHARED.get(self._funcs[int(f)], 16)

    def _dynamic_shared_limit(self, f) -> int:
        """As CUDA's: 48 KiB less the static part until the function opts in to more."""
        return self._max_dynamic_shared.get(int(f), self.DEFAULT_SHARED_LIMIT - self._static_shared(f))

    def f_cuFuncGetAttribute(self, attr, f):
        A = self._real.CUfunction_attribute
        if int(attr) == int(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES):
            return (self.S, self._static_shared(f))
        if int(attr) == int(A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES):
            return (self.S, self._dynamic_shared_limit(f))
        return super().f_cuFuncGetAttribute(attr, f)

    def f_cuFuncSetAttribute(self, f, attr, value):
        """Only the dynamic shared memory opt-in, bounded as CUDA bounds it."""
        assert int(f) in self._funcs
        assert int(attr) == int(
            self._real.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        )
        if not 0 <= int(value) <= self.SHARED_OPTIN - self._static_shared(f):
            return (self._real.CUresult.CUDA_ERROR_INVALID_VALUE,)
        self._max_dynamic_shared[int(f)] = int(value)
        return (self.S,)

    def f_cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, s, kp, extra):
        if self._funcs[int(f)] == KERNEL_NAME:
            self.scheduler_blocks.append(int(bx))
            self.scheduler_shared.append(int(smem))
            if self.refuse_scheduler_launch:
                return (getattr(self._real.CUresult, self.refuse_scheduler_launch),)
        if int(smem) > self._dynamic_shared_limit(f):
            return (self._real.CUresult.CUDA_ERROR_INVALID_VALUE,)
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

    def f_cuGraphAddKernelNode(self, g, deps, ndeps, p):
        if self._funcs[int(p.func)] in self.unsupported:
            return (self._real.CUresult.CUDA_ERROR_NOT_SUPPORTED, None)
        if int(p.sharedMemBytes) > self._dynamic_shared_limit(p.func):
            return (self._real.CUresult.CUDA_ERROR_INVALID_VALUE, None)
        return super().f_cuGraphAddKernelNode(g, deps, ndeps, p)

    def f_cuGraphAddNode(self, g, deps, dep_data, ndeps, p):
        if p.conditional.type.name in self.unsupported:
            return (self._real.CUresult.CUDA_ERROR_NOT_SUPPORTED, None)
        return super().f_cuGraphAddNode(g, deps, dep_data, ndeps, p)

    # -- graph editing for the in-step signal (launch_graph.LaunchGraph._step_with_signal)
    def f_cuGraphClone(self, g):
        """A copy: its nodes anew (new ids, the same kinds and arguments), its edges the same."""
        clone = self._new_graph()
        self.cloned_graphs.add(clone.id)
        copies: dict[int, _FNode] = {}
        for n in self._graphs[int(g)].nodes:
            fields = {k: v for k, v in n.__dict__.items() if k not in ("id", "kind", "deps")}
            if "programmatic_from" in fields:  # the copies' ids, not the original's
                fields["programmatic_from"] = {copies[i].id for i in fields["programmatic_from"]}
            copy = _FNode(self._id(), n.kind, deps=[copies[d.id] for d in n.deps], **fields)
            copies[n.id] = copy
            clone.nodes.append(copy)
            self._nodes[copy.id] = copy
        return (self.S, self._real.CUgraph(clone.id))

    def f_cuGraphGetEdges(self, g, n):
        edges = [(d, x) for x in self._graphs[int(g)].nodes for d in x.deps]
        if int(n) == 0:
            return (self.S, None, None, None, len(edges))
        data = []
        for d, x in edges:
            e = self._real.CUgraphEdgeData()
            if d.id in getattr(x, "programmatic_from", ()):
                e.type = self._real.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
            data.append(e)
        node = self._real.CUgraphNode
        return (self.S, [node(d.id) for d, _ in edges], [node(x.id) for _, x in edges], data, len(edges))

    def f_cuGraphAddDependencies(self, g, froms, tos, data, n):
        """Edges; a programmatic one only between two kernel nodes, as CUDA allows."""
        nodes = self._graphs[int(g)].nodes
        programmatic = int(self._real.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
        for f, t, e in zip(froms, tos, data or [None] * int(n)):
            a, b = self._nodes[int(f)], self._nodes[int(t)]
            assert a in nodes and b in nodes, "an edge from another graph"
            if e is not None and int(e.type) == programmatic:
                if a.kind != "KERNEL" or b.kind != "KERNEL":
                    return (self._real.CUresult.CUDA_ERROR_INVALID_VALUE,)
                b.__dict__.setdefault("programmatic_from", set()).add(a.id)
            b.deps.append(a)
        return (self.S,)

    def f_cuGraphInstantiate(self, g, flags):
        WHILE = int(self._real.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE)
        nodes = self._graphs[int(g)].nodes
        self._instantiations += 1
        if self._instantiations in self.refuse_instantiations or (
            "instantiate WHILE" in self.unsupported
            and any(n.kind == "CONDITIONAL" and int(n.ctype) == WHILE for n in nodes)
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
        plan_ahead = int(c.cfg["plan_ahead"])
        self.scheduler_plan_ahead.append(plan_ahead)
        c.put("state", S.RUNNING)
        seq, stop, planned = 0, X.NONE, 0  # planned: the bucket published for step seq (0: none)
        while True:
            late = self._wait_for_turn(c, started, budget, grace)
            if late != X.NONE or stop != X.NONE:
                self._mark_exited(c, late if late != X.NONE else stop)
                break
            # the critical phase: a published plan is always handed over, in its bucket
            built = planned != 0 if plan_ahead else self._take_step()
            if built:
                self._build_step(c, seq, planned)
                c.turn = T.COMPUTE
                c.set_word("released", seq + 1)
                self.steps_handed += 1
                planned = 0
            # the overlapped phase: the step's CQ event published, the stop looked for, and
            # (none seen) the next step's plan
            if built:
                c.row()[F.OVERLAP_END] = now_ns()
                c.put("cq_tail", c.get("cq_tail") + 1)
                seq += 1
            c.put("heartbeat_ns", now_ns())
            stop = self._stop_reason(c, started, budget)
            if plan_ahead and stop == X.NONE and self._take_step():
                planned = self._bucket_of(c, seq)
                c.set_word("plan_bucket", planned, seq & 1)  # the bucket before the seq that publishes it
                c.set_word("plan_seq", seq + 1, seq & 1)
            if stop != X.NONE and not built:
                self._mark_exited(c, stop)
                break
            time.sleep(self.step_period_s)
        if planned:  # a graph may be parked in its gate: EXIT releases it into a void step
            c.step["n_samples"][0] = 0
            self.voided_steps += 1
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

    @staticmethod
    def _bucket_of(c: _Context, seq: int) -> int:
        """Step seq's bucket: the buckets in turn."""
        buckets = c.buckets()
        return buckets[seq % len(buckets)]

    def _build_step(self, c: _Context, seq: int, planned: int) -> None:
        c.step["bucket"][0] = planned or self._bucket_of(c, seq)
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

    # -- the launch graphs' kernels: the CPU build's nodes of the same names and parameters
    # (sched_loop.h's text, which kernel.cu runs), the context by address, each conditional
    # handle a word the node sets and this driver then gives its handle
    def _node(self, name: str, ctx: tuple[int, ...], *args: int):
        words = (ctypes.c_uint64 * N_CONTEXT)(*ctx)
        self._turns.add(int(words[TURN_INDEX]))
        if self.halt.is_set():  # a device reset: every wait ends, every WHILE with it
            write_u32(int(words[TURN_INDEX]), T.EXIT)
        cells, call = [], []
        for kind, arg in zip(GRAPH_NODES[name], args):
            if kind == "handle":
                cells.append((arg, (ctypes.c_uint32 * 1)(UNSET)))
                call.append(ctypes.addressof(cells[-1][1]))
            else:
                call.append(arg)
        result = cpu_scheduler().node(name, ctypes.addressof(words), *call)
        for handle, cell in cells:
            if cell[0] != UNSET:
                self._set_cond(handle, cell[0])
        return result

    def _signalled(self, name: str, ctx, *args) -> None:
        """A signal node; counts the step if it handed the turn back (it stamped the step's end
        in the row of the step it ran)."""
        row = _Context(ctx).row()
        before = int(row[F.STEP_END])
        self._node(name, ctx, *args)
        if int(row[F.STEP_END]) != before:
            self.steps_signalled += 1

    def k_rl_step_wait(self, ctx, switch_handle, while_handle, use_while):
        self._node("rl_step_wait", ctx, switch_handle, while_handle, use_while)

    def k_rl_step_begin(self, ctx):
        self._node("rl_step_begin", ctx)

    def k_rl_step_signal(self, ctx):
        self._signalled("rl_step_signal", ctx)

    def k_rl_plan_wait(self, ctx, switch_handle, while_handle, parity):
        self._node("rl_plan_wait", ctx, switch_handle, while_handle, parity)

    def k_rl_step_gate(self, ctx, parity):
        if self._node("rl_step_gate", ctx, parity) == T.COMPUTE:
            self.gated.append((parity, int(_Context(ctx).step["seq"][0])))

    def k_rl_signal_pingpong(self, ctx, parity):
        self._signalled("rl_signal_pingpong", ctx, parity)

    def k_rl_test_step(self, counters, index):
        write_u32(counters + 4 * index, read_u32(counters + 4 * index) + 1)
        if self.step_hold_s:
            self.halt.wait(self.step_hold_s)
