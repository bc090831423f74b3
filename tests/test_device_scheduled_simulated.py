"""DeviceScheduled (`--scheduler device`, device/backends/device_scheduled.py) built for real under
FakeDriver (tests/fake_cuda_driver.py) with the scheduler module's kernels simulated
(tests/fake_scheduler_kernels.py), all three launches (pingpong: two WHILE graphs on two streams
taking turns by seq parity; resident: the WHILE/SWITCH graph launched once; pump: the unrolled
graph relaunched by a host thread): start, the CQ poller, a failed init, a kernel that exits on
its own, a clean and a hung stop, --launch auto's fallbacks, the config's plan_ahead and the
launch words written before any launch, and the scheduler's dynamic shared memory.

The scheduler module is the real CUBIN (NVRTC, no GPU needed), loaded through cuda_driver's
load_module; every driver call goes through cuda_driver to the fake, after the installed
cuda-python binding has converted its arguments.  The engine is driven through a small
EngineBackend (engine_backend.py), so start()'s clean-up and stop() are the real ones.  What is
not real: the step graphs (one counting kernel per bucket), the device memory (the rings and the
scheduler's arrays all in one HostMemory), and the scheduler's work (fake_scheduler_kernels.py).
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from ringleader.device.backends import cuda_driver as drv
from ringleader.device.backends.common import StepTimer
from ringleader.device.backends.cuda_graph_rules import GraphNode, check_conditional_body, count_nodes
from ringleader.device.backends.device_scheduled import (
    DeviceScheduled,
    LaunchUnavailable,
    scheduler_shared_bytes,
)
from ringleader.device.backends.engine_backend import EngineBackend
from ringleader.device.backends.host_memory import HostMemory
from ringleader.device.backends.launch_graph import PUMP_STEPS_PER_LAUNCH
from ringleader.ipc import layout
from ringleader.ipc.backend import EngineDead
from ringleader.ipc.rings import RingConfig, write_config
from tests.gpu_limits_probe import libcuda_present

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(libcuda_present(), reason="a CUDA driver is installed: the fake would call it"),
]
pytest.importorskip("cuda.bindings")

from ringleader.device.sched.build import KERNEL_NAME, KERNELS, compile_kernel  # noqa: E402
from tests.fake_scheduler_kernels import TEST_STEP, TEST_STEP_IMAGE, FakeSchedulerDriver  # noqa: E402

LAUNCHES = ("pingpong", "resident", "pump")
SCHED_THREADS = 256
RING = RingConfig(
    n_slots=4,
    max_ctx=64,
    token_budget=8,
    sq_size=16,
    cq_size=64,
    arena_size=4096,
    pending_cap=16,
    buckets=(1, 2, 4, 8),
    trace_len=64,
)
S = layout.SchedulerState


def wait_until(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.005)
    return bool(pred())


@pytest.fixture(scope="module")
def kernel_build():
    """The real scheduler module, compiled once (a few seconds)."""
    try:
        return compile_kernel("sm_90", threads=SCHED_THREADS)
    except Exception as exc:  # no NVRTC on this machine
        pytest.skip(f"NVRTC cannot compile the scheduler here: {exc}")


@pytest.fixture
def fake(monkeypatch):
    f = FakeSchedulerDriver()
    monkeypatch.setattr(drv, "cu", f)
    yield f
    f.halt.set()  # whatever a test left running ends
    f.close()
    assert not f.errors, f.errors[0]


class SimMemory:
    """HostMemory as DeviceScheduled and TimelineReader use DeviceMemory: the config, the
    context's bytes, the writes made before any launch, and the trace's address and size (the
    fake device reads and writes host memory)."""

    def __init__(self, cfg: RingConfig):
        self.host = HostMemory(cfg)
        self.config = cfg
        self.rings = self.host.rings
        self.device_nbytes = {name: a.nbytes for name, a in self.host.arrays.items()}

    def write_config(self, cfg: RingConfig) -> None:
        write_config(self.host.arrays["cfg"], cfg)
        self.config = cfg

    def write_array(self, name: str, values: np.ndarray) -> None:
        array = self.host.arrays[name]
        assert values.nbytes == array.nbytes, name
        array.view(np.uint8)[:] = values.view(np.uint8).reshape(-1)

    def cfg_word(self, name: str) -> int:
        return int(self.host.arrays["cfg"][0][name])

    def launch_words(self) -> np.ndarray:
        return self.host.arrays["launch"][0]

    def address(self, name: str) -> int:
        return self.host.arrays[name].ctypes.data

    def context_bytes(self) -> bytes:
        return ctypes.string_at(self.host.context_address, 8 * len(layout.ARRAYS))


class SimStepGraphs:
    """StepGraphs' interface over one fake graph per bucket: a kernel counting that bucket's steps."""

    def __init__(self, buckets, function):
        self.buckets = tuple(sorted(buckets))
        self.counts = np.zeros(len(self.buckets), dtype=np.uint32)  # steps run, by SWITCH branch
        self._args = []  # kernel node parameters outlive the graphs
        self._raw = {}
        for i, bucket in enumerate(self.buckets):
            args = drv.KernelArgs(ctypes.c_uint64(self.counts.ctypes.data), ctypes.c_uint32(i))
            self._args.append(args)
            self._raw[bucket] = drv.create_graph()
            drv.add_kernel_node(self._raw[bucket], [], function, args)
        self.checked = 0

    def raw(self, bucket: int):
        return self._raw[bucket]

    def check_embeddable(self):
        """The real rule over the node types read back through the driver."""
        self.checked += 1
        return {
            b: check_conditional_body([GraphNode(t) for t in drv.node_types(self._raw[b])], b)
            for b in self.buckets
        }

    def describe(self) -> dict[str, str]:
        return {
            str(b): count_nodes([GraphNode(t) for t in drv.node_types(self._raw[b])]).summary()
            for b in self.buckets
        }


class SimBackend(EngineBackend):
    """What CudaBackend builds around DeviceScheduled, with the fake's memory and step graphs."""

    def __init__(
        self,
        kernel_build,
        launch: str,
        *,
        stop_timeout_s=5.0,
        run_budget_s=None,
        corrupt=None,
        ring=RING,
        step_signal="auto",
        programmatic=True,
    ):
        super().__init__()
        self.mem = SimMemory(ring)
        self.rings = self.mem.rings
        if corrupt:
            self.rings.control[0][corrupt] = 0
        module, self.loaded = drv.load_module(kernel_build)
        self.functions = functions = {name: drv.get_function(module, name) for name in KERNELS}
        step_fn = drv.get_function(drv.load_image(TEST_STEP_IMAGE), TEST_STEP)
        self.graphs = SimStepGraphs(ring.buckets, step_fn)
        self._timer = StepTimer()
        self._engine = self.engine = DeviceScheduled(
            launch=launch,
            step_signal=step_signal,
            programmatic=programmatic,
            rings=self.rings,
            device_memory=self.mem,
            graphs=self.graphs,
            functions=functions,
            cu_ctx=drv.current_context(),
            sched_threads=SCHED_THREADS,
            timer=self._timer,
            doorbell=self._doorbell,
            events=self._events,
            stop_grace_s=0.5,
            run_budget_s=run_budget_s,
            trace_path=None,
        )
        self.description = dict(self.engine.description)
        self.launch_graph = self.engine._launch.graph
        self._stop_timeout_s = stop_timeout_s
        self.released = False

    def _release(self) -> None:
        self.released = True

    def state(self) -> int:
        return int(self.rings.control[0]["state"])

    def cq_tail(self) -> int:
        return int(self.rings.control[0]["cq_tail"])


def assert_released(fake: FakeSchedulerDriver, backend: SimBackend, execs: list, raws: list) -> None:
    """execs, raws: the launch graph's, taken before the stop (destroy() empties its lists)."""
    assert {int(x) for x in execs} <= fake.destroyed_execs and {int(g) for g in raws} <= fake.destroyed_graphs
    assert backend.released and backend.engine._launch is None
    # the scheduler's stream and the launch graphs' (ping-pong: one per graph)
    assert fake.destroyed_streams == 1 + len(execs)
    assert len(backend.engine.timeline()) == 0  # the reader is closed before the buffer goes


def graphs_of(backend: SimBackend) -> tuple[list, list]:
    g = backend.launch_graph
    return list(g.execs), list(g.raws)


def launches(fake: FakeSchedulerDriver, execs: list) -> list[int]:
    return [fake.graph_launches[int(x)] for x in execs]


# ---- 1. start, the CQ poller, the pump, ping-pong's turns ------------------------------------
@pytest.mark.parametrize("launch", LAUNCHES)
def test_start_runs_steps_and_the_poller_wakes_on_cq_tail(fake, kernel_build, launch):
    fake.allow_steps = 0  # an idle scheduler: no step, no CQ event
    b = SimBackend(kernel_build, launch)
    execs, raws = graphs_of(b)
    assert b.loaded == "cubin" and b.graphs.checked == 1
    assert b.description["launch"] == launch and "launch_fallback" not in b.description
    assert b.description["step_graph_nodes"] == {str(x): "1 kernel" for x in RING.buckets}
    assert len(execs) == (2 if launch == "pingpong" else 1)
    b.start()
    assert b.state() == S.RUNNING  # start() returned only once the kernel reported it
    assert fake.scheduler_blocks == [SCHED_THREADS]
    assert fake.scheduler_plan_ahead == [int(launch == "pingpong")]  # what the kernel read at start
    ctl = b.rings.control[0]
    assert int(ctl["stop_grace_ns"]) == 500_000_000 and int(ctl["run_budget_ns"]) == 0
    names = {t.name for t in b.engine._threads}
    assert names == ({"rl-cq-poll", "rl-pump"} if launch == "pump" else {"rl-cq-poll"})

    b._events.clear()
    time.sleep(0.2)
    assert not b._events.is_set() and b.cq_tail() == 0  # nothing published: nobody woken

    n_steps = 3 * PUMP_STEPS_PER_LAUNCH + 2
    fake.allow_steps = n_steps
    assert b._events.wait(5.0), "the CQ poller did not wake the completion thread"
    assert wait_until(lambda: fake.steps_signalled == n_steps and b.cq_tail() == n_steps), (
        fake.steps_signalled,
        b.cq_tail(),
    )
    # every step ran its bucket's branch of the SWITCH, the buckets in turn
    assert b.graphs.counts.tolist() == [(n_steps + 3 - i) // 4 for i in range(4)]
    if launch == "pump":  # each launch runs 8 steps; the pump keeps two queued
        assert launches(fake, execs)[0] >= n_steps // PUMP_STEPS_PER_LAUNCH + 1, launches(fake, execs)
    else:  # launched once each, on a stream each
        assert launches(fake, execs) == [1] * len(execs)
    if launch == "pingpong":  # graph 0 ran the even seqs, graph 1 the odd ones, each once, in order
        assert fake.gated == [(seq % 2, seq) for seq in range(n_steps)]
        words = b.mem.launch_words()
        assert list(words["graph_seq"]) == [n_steps + n_steps % 2, n_steps + 1 - n_steps % 2]
        assert int(words["released"]) == n_steps
    else:
        assert fake.gated == []
    stats = b.stats()
    assert stats["timeline_steps"] == n_steps and stats["bubble_gaps"] == n_steps - 1
    assert b.step_histograms()["bubble_s"].count == n_steps - 1
    assert b.failure() is None
    b.stop()
    assert int(ctl["exit_reason"]) == layout.ExitReason.SHUTDOWN and b.state() == S.EXITED
    assert fake.voided_steps == 0  # no plan is published once the stop is seen
    assert_released(fake, b, execs, raws)


@pytest.mark.parametrize("launch", LAUNCHES)
def test_the_device_config_and_launch_words_are_written_before_any_launch(fake, kernel_build, launch):
    b = SimBackend(kernel_build, launch)
    assert b.mem.cfg_word("plan_ahead") == int(launch == "pingpong") and b.mem.config.plan_ahead == (
        launch == "pingpong"
    )
    assert b.mem.cfg_word("magic") == layout.MAGIC and b.mem.cfg_word("n_buckets") == len(RING.buckets)
    words = b.mem.launch_words()
    assert list(words["graph_seq"]) == [0, 1]  # graph p's first step is seq p
    assert int(words["released"]) == 0 and list(words["plan_seq"]) == list(words["plan_bucket"]) == [0, 0]
    assert int(words["idle"]) == 0
    assert not fake.graph_launches and not fake.scheduler_blocks
    b.stop()  # never started: released all the same


# ---- 2. a failed init -----------------------------------------------------------------------
@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize(("corrupt", "named"), [("magic", "bad magic"), ("version", "bad layout version")])
def test_failed_init_raises_its_name_and_cleans_up(fake, kernel_build, launch, corrupt, named):
    b = SimBackend(kernel_build, launch, corrupt=corrupt)
    execs, raws = graphs_of(b)
    with pytest.raises(RuntimeError, match=f"rejected its configuration: {named}$"):
        b.start()
    assert b.state() == S.FAILED
    # EngineBackend.start's clean-up: shutdown asked, everything ended, the graphs destroyed
    assert int(b.rings.control[0]["shutdown"]) == 1
    assert b.engine.wait_stopped(time.monotonic() + 1.0) == []
    assert b.engine._threads == []  # start() spawned nothing
    assert b.failure() is None
    assert fake.gated == []
    assert_released(fake, b, execs, raws)


@pytest.mark.parametrize("launch", LAUNCHES)
def test_refused_scheduler_launch_ends_the_graph_already_launched(fake, kernel_build, launch):
    """start() launches the step graphs first; when the scheduler's own launch then fails, the
    graphs' waits (state INIT, shutdown set by the clean-up) must end, or stop() would hang."""
    fake.refuse_scheduler_launch = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"
    b = SimBackend(kernel_build, launch)
    execs, raws = graphs_of(b)
    with pytest.raises(drv.CudaError, match="cuLaunchKernel failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
        b.start()
    assert launches(fake, execs) == [1] * len(execs) and b.state() == S.INIT
    assert int(b.rings.control[0]["shutdown"]) == 1
    assert b.engine.wait_stopped(time.monotonic() + 1.0) == []
    assert_released(fake, b, execs, raws)


# ---- 3. a kernel that exits on its own ------------------------------------------------------
@pytest.mark.parametrize("launch", LAUNCHES)
def test_kernel_exiting_on_its_own_is_a_failure_unless_stopping(fake, kernel_build, launch):
    b = SimBackend(kernel_build, launch, run_budget_s=0.1)
    execs, raws = graphs_of(b)
    b.start()
    assert int(b.rings.control[0]["run_budget_ns"]) == 100_000_000
    assert wait_until(lambda: b.state() == S.EXITED)
    assert fake.steps_handed > 0
    why = "the scheduler kernel exited on its own (exit reason: budget)"
    assert b.engine.failure(stopping=False) == why and b.failure() == why
    assert b.engine.failure(stopping=True) is None
    # the host threads end with the kernel (the poller and the pump watch its state)
    assert wait_until(lambda: not any(t.is_alive() for t in b.engine._threads), 5.0)
    assert b.engine.wait_stopped(time.monotonic() + 1.0) == []  # every graph launch ended too
    assert fake.steps_handed == fake.steps_signalled
    b.stop()
    assert_released(fake, b, execs, raws)


# ---- 4. stop ----------------------------------------------------------------------------------
@pytest.mark.parametrize("launch", LAUNCHES)
def test_stop_ends_kernel_graph_and_threads(fake, kernel_build, launch):
    b = SimBackend(kernel_build, launch)
    execs, raws = graphs_of(b)
    b.start()
    assert wait_until(lambda: fake.steps_signalled >= 5)
    b.rings.request_shutdown()
    assert b.engine.wait_stopped(time.monotonic() + 5.0) == []
    ctl = b.rings.control[0]
    assert b.state() == S.EXITED and int(ctl["exit_reason"]) == layout.ExitReason.SHUTDOWN
    assert b.engine.failure(stopping=True) is None
    assert not any(t.is_alive() for t in b.engine._threads)
    assert fake.steps_handed == fake.steps_signalled  # the step out at the stop still ran
    if launch == "pingpong":
        assert fake.gated == [(seq % 2, seq) for seq in range(fake.steps_handed)]
    b.stop()  # EngineBackend: stopped, released
    assert_released(fake, b, execs, raws)
    b.stop()  # a second stop does nothing


@pytest.mark.parametrize("launch", LAUNCHES)
def test_stop_names_what_ignores_shutdown(fake, kernel_build, launch):
    fake.ignore_shutdown = True
    b = SimBackend(kernel_build, launch, stop_timeout_s=0.3)
    execs, _ = graphs_of(b)
    b.start()
    assert wait_until(lambda: fake.steps_signalled >= 2)
    b.rings.request_shutdown()
    stuck = b.engine.wait_stopped(time.monotonic() + 0.3)
    threads = ["thread rl-pump", "thread rl-cq-poll"] if launch == "pump" else ["thread rl-cq-poll"]
    if launch == "pingpong":
        graphs = ["the step graph launch of the even seqs", "the step graph launch of the odd seqs"]
    else:
        graphs = ["the step graph launch"]
    assert stuck == ["the scheduler kernel", *graphs, *threads]
    with pytest.raises(EngineDead, match=rf"stop: the scheduler kernel, {graphs[0]}, .*running"):
        b.stop()
    assert "scheduler state running" in b.failure()
    assert not b.released and b.engine._launch is not None  # nothing freed under a running kernel
    assert not fake.destroyed_execs
    fake.halt.set()  # what a device reset would do: now everything ends
    assert b.engine.wait_stopped(time.monotonic() + 5.0) == []
    b.engine.release()
    assert {int(x) for x in execs} <= fake.destroyed_execs


def test_pingpong_deadline_exit_with_a_plan_out_ends_both_graphs(fake, kernel_build):
    """A step that keeps the turn past the grace after a stop: the scheduler exits (deadline)
    with the next step planned and its graph parked in the gate; EXIT releases that graph into
    the void step, and then both graphs must end."""
    fake.step_hold_s = 1.0
    b = SimBackend(kernel_build, "pingpong")
    b.start()
    assert wait_until(lambda: fake.steps_handed >= 1 and b.mem.launch_words()["plan_seq"][1] == 2)
    b.rings.request_shutdown()  # step 0 holds the turn for 1 s, past the 0.5 s grace
    assert wait_until(lambda: b.state() == S.EXITED)
    assert int(b.rings.control[0]["exit_reason"]) == layout.ExitReason.DEADLINE
    assert fake.voided_steps == 1
    assert b.engine.wait_stopped(time.monotonic() + 4.0) == []


# ---- 5. --launch auto's fallbacks, and the modes that must run -------------------------------------
@pytest.mark.parametrize("refused", ["CU_GRAPH_COND_TYPE_WHILE", "instantiate WHILE"])
def test_auto_falls_back_to_pump_when_while_graphs_are_refused(fake, kernel_build, refused):
    fake.unsupported = {refused}
    b = SimBackend(kernel_build, "auto")
    execs, raws = graphs_of(b)
    assert b.description["launch"] == "pump"
    call = "cuGraphAddNode(conditional)" if refused.startswith("CU_") else "cuGraphInstantiate"
    pingpong, resident = b.description["launch_fallback"].split("; ")
    for mode, refusal in (("pingpong", pingpong), ("resident", resident)):
        assert refusal.startswith(f"{mode}: {call} failed: CUDA_ERROR_NOT_SUPPORTED"), refusal
    # neither refused mode's graph is kept half-built: each tried with the signal in the step,
    # then as a node (--step-signal auto)
    assert len(fake.destroyed_graphs - fake.cloned_graphs) == 4
    assert b.mem.cfg_word("plan_ahead") == 0
    b.start()
    assert wait_until(lambda: fake.steps_signalled >= 2 * PUMP_STEPS_PER_LAUNCH)
    assert launches(fake, execs)[0] >= 2
    assert fake.scheduler_plan_ahead == [0]
    b.stop()
    assert_released(fake, b, execs, raws)


@pytest.mark.parametrize("refused", ["rl_plan_wait", "graph 1's instantiation"])
def test_auto_falls_back_to_resident_when_pingpong_is_refused(fake, kernel_build, refused):
    if refused == "rl_plan_wait":  # the first ping-pong graph refused as it is built
        fake.unsupported = {refused}
    else:  # the second refused, the first already instantiated (then destroyed as well), with
        # the signal in the step and then as a node (--step-signal auto)
        fake.refuse_instantiations = {2, 4}
    b = SimBackend(kernel_build, "auto")
    execs, raws = graphs_of(b)
    assert b.description["launch"] == "resident" and len(execs) == 1
    refusal = b.description["launch_fallback"]
    call = "cuGraphAddKernelNode" if refused == "rl_plan_wait" else "cuGraphInstantiate"
    assert refusal.startswith(f"pingpong: {call} failed: CUDA_ERROR_NOT_SUPPORTED"), refusal
    assert b.mem.cfg_word("plan_ahead") == 0 and not b.mem.config.plan_ahead  # as resident needs
    # every ping-pong graph made (each signal placement), none kept
    ping_pong_graphs = fake.destroyed_graphs - fake.cloned_graphs
    assert len(ping_pong_graphs) == (2 if refused == "rl_plan_wait" else 4)
    assert len(fake.destroyed_execs) == (0 if refused == "rl_plan_wait" else 2)
    b.start()
    assert wait_until(lambda: fake.steps_signalled >= 5)
    assert fake.scheduler_plan_ahead == [0] and fake.gated == []
    assert launches(fake, execs) == [1]
    b.stop()
    assert_released(fake, b, execs, raws)


@pytest.mark.parametrize("launch", ["pingpong", "resident"])
@pytest.mark.parametrize("refused", ["CU_GRAPH_COND_TYPE_WHILE", "instantiate WHILE"])
def test_while_launch_refused_raises_launch_unavailable(fake, kernel_build, launch, refused):
    fake.unsupported = {refused}
    with pytest.raises(LaunchUnavailable, match=f"--launch {launch}: .*CUDA_ERROR_NOT_SUPPORTED"):
        SimBackend(kernel_build, launch)
    assert not fake.graph_launches and not fake.scheduler_blocks  # nothing was launched


def test_pingpong_refused_alone_raises_launch_unavailable(fake, kernel_build):
    fake.unsupported = {"rl_plan_wait"}
    with pytest.raises(LaunchUnavailable, match="--launch pingpong: .*cuGraphAddKernelNode.*NOT_SUPPORTED"):
        SimBackend(kernel_build, "pingpong")
    assert not fake.graph_launches and not fake.scheduler_blocks


def branch_step(branch, first: str, args: tuple, signal: str | None, programmatic: bool):
    """A SWITCH branch: [first -> the step graph], the step ending in `signal` when given (by a
    programmatic edge from the stand-in step's kernel when `programmatic`); returns the step."""
    head, step = branch.nodes
    assert (head.name, head.args[1:], step.kind, step.deps) == (first, args, "GRAPH", [head])
    if signal is None:
        assert [n.name for n in step.nodes] == [TEST_STEP]
        return step
    kernel, signalled = step.nodes
    assert (kernel.name, signalled.name, signalled.deps) == (TEST_STEP, signal, [kernel])
    assert getattr(signalled, "programmatic_from", set()) == ({kernel.id} if programmatic else set())
    return step


@pytest.mark.parametrize("programmatic", [True, False])
def test_auto_uses_pingpong_with_the_signal_in_the_step_when_available(fake, kernel_build, programmatic):
    b = SimBackend(kernel_build, "auto", programmatic=programmatic)
    assert b.description["launch"] == "pingpong" and "launch_fallback" not in b.description
    assert b.description["step_signal"] == "in-step" and "step_signal_fallback" not in b.description
    assert b.description["programmatic_signals"] == (2 * len(RING.buckets) if programmatic else 0)
    assert b.mem.cfg_word("plan_ahead") == 1
    for parity, raw in enumerate(b.launch_graph.raws):
        # WHILE { plan wait(p) -> SWITCH { gate(p) -> step -> signal(p) } }
        (loop,) = fake._graphs[int(raw)].nodes
        body = loop.bodies[0].nodes
        assert loop.kind == "CONDITIONAL" and [n.kind for n in body] == ["KERNEL", "CONDITIONAL"]
        assert body[0].name == "rl_plan_wait" and body[0].args[1:] == (body[1].handle, loop.handle, parity)
        assert len(body[1].bodies) == len(RING.buckets)
        for branch in body[1].bodies:
            step = branch_step(branch, "rl_step_gate", (parity,), "rl_signal_pingpong", programmatic)
            assert step.nodes[-1].args[1:] == (parity,)


def test_pingpong_with_a_signal_node(fake, kernel_build):
    b = SimBackend(kernel_build, "pingpong", step_signal="node")
    assert b.description["step_signal"] == "node" and b.description["programmatic_signals"] == 0
    for parity, raw in enumerate(b.launch_graph.raws):
        # WHILE { plan wait(p) -> SWITCH { gate(p) -> step } -> signal(p) }
        (loop,) = fake._graphs[int(raw)].nodes
        body = loop.bodies[0].nodes
        assert [n.kind for n in body] == ["KERNEL", "CONDITIONAL", "KERNEL"]
        assert [body[0].name, body[2].name] == ["rl_plan_wait", "rl_signal_pingpong"]
        assert body[0].args[1:] == (body[1].handle, loop.handle, parity) and body[2].args[1:] == (parity,)
        for branch in body[1].bodies:
            branch_step(branch, "rl_step_gate", (parity,), None, False)


@pytest.mark.parametrize("signal", ["node", "in-step"])
def test_resident_graph_with_either_signal(fake, kernel_build, signal):
    b = SimBackend(kernel_build, "resident", step_signal=signal)
    (raw,) = b.launch_graph.raws
    (loop,) = fake._graphs[int(raw)].nodes  # WHILE { wait -> SWITCH { begin -> step } -> signal }
    body = loop.bodies[0].nodes
    if signal == "node":
        assert [n.kind for n in body] == ["KERNEL", "CONDITIONAL", "KERNEL"]
        assert [n.name for n in body[::2]] == ["rl_step_wait", "rl_step_signal"]
    else:  # WHILE { wait -> SWITCH { begin -> step -> signal } }
        assert [n.kind for n in body] == ["KERNEL", "CONDITIONAL"] and body[0].name == "rl_step_wait"
    assert len(body[1].bodies) == len(RING.buckets)
    for branch in body[1].bodies:
        branch_step(branch, "rl_step_begin", (), "rl_step_signal" if signal == "in-step" else None, True)


# ---- 6. the scheduler's dynamic shared memory ---------------------------------------------------
def align16(n: int) -> int:
    return (n + 15) // 16 * 16


def test_scheduler_shared_bytes_sums_the_placement_by_struct_sizes():
    """RING: 4 slots, work_len = max(4 slots, 16 pending) = 16."""
    u32 = 4
    wanted = (
        align16(layout.CONFIG.size)
        + align16(layout.SCHED.size)
        + align16(layout.SLOT.size * 4)  # slots
        + 4 * align16(u32 * 4)  # prefill_queue, seg_slot, seg_row_start, seg_n_rows
        + 6 * align16(u32 * 16)  # work_a..work_f
    )
    assert scheduler_shared_bytes(RING, 1 << 20) == {"wanted": wanted, "given": wanted}
    assert scheduler_shared_bytes(RING, wanted - 1) == {"wanted": wanted, "given": wanted - 1}
    assert scheduler_shared_bytes(RING, -5)["given"] == 0


BIG_RING = RingConfig(
    n_slots=64,
    max_ctx=64,
    token_budget=64,
    sq_size=16,
    cq_size=8192,
    arena_size=4096,
    pending_cap=4096,
    buckets=(8, 64),
    trace_len=64,
)


@pytest.mark.parametrize(
    ("ring", "optin", "opted_in"),
    [(RING, None, False), (BIG_RING, None, True), (BIG_RING, 64 << 10, True), (BIG_RING, 2048, False)],
)
def test_scheduler_launch_gets_its_shared_memory(fake, kernel_build, ring, optin, opted_in):
    """What the launch is given: all it wants where the device holds it (opted in above 48 KiB),
    else what the device's opt-in maximum leaves beside the kernel's static shared memory."""
    if optin is not None:
        fake.SHARED_OPTIN = optin
    static = fake.STATIC_SHARED[KERNEL_NAME]
    b = SimBackend(kernel_build, "resident", ring=ring)
    wanted = scheduler_shared_bytes(ring, 1 << 30)["wanted"]
    given = wanted if optin is None else optin - static
    assert given <= wanted
    assert b.description["scheduler_shared_bytes"] == {"wanted": wanted, "given": given}
    assert (wanted > (48 << 10)) == (ring is BIG_RING)
    fn = b.functions[KERNEL_NAME]
    assert (int(fn) in fake._max_dynamic_shared) == opted_in
    b.start()
    assert fake.scheduler_shared == [given]  # the launch took it (the fake refuses more than allowed)
    b.stop()
