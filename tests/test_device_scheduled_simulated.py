"""DeviceScheduled (`--scheduler device`, device/backends/device_scheduled.py) built for real under
FakeDriver (tests/fake_cuda_driver.py) with the scheduler module's kernels simulated
(tests/fake_scheduler_kernels.py), both launches (resident: the WHILE/SWITCH graph launched once;
pump: the unrolled graph relaunched by a host thread): start, the CQ poller, a failed init, a
kernel that exits on its own, a clean and a hung stop, and --launch auto's fallback.

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
from ringleader.device.backends.device_scheduled import DeviceScheduled, LaunchUnavailable
from ringleader.device.backends.engine_backend import EngineBackend
from ringleader.device.backends.host_memory import HostMemory
from ringleader.device.backends.launch_graph import PUMP_STEPS_PER_LAUNCH
from ringleader.ipc import layout
from ringleader.ipc.backend import EngineDead
from ringleader.ipc.rings import RingConfig
from tests.gpu_limits_probe import libcuda_present

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(libcuda_present(), reason="a CUDA driver is installed: the fake would call it"),
]
pytest.importorskip("cuda.bindings")

from ringleader.device.sched.build import KERNELS, compile_kernel  # noqa: E402
from tests.fake_scheduler_kernels import TEST_STEP, TEST_STEP_IMAGE, FakeSchedulerDriver  # noqa: E402

LAUNCHES = ("resident", "pump")
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
    """HostMemory as DeviceScheduled and TimelineReader use DeviceMemory: the context's bytes,
    and the trace's address and size (the fake device reads and writes host memory)."""

    def __init__(self, cfg: RingConfig):
        self.host = HostMemory(cfg)
        self.rings = self.host.rings
        self.device_nbytes = {name: a.nbytes for name, a in self.host.arrays.items()}

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

    def __init__(self, kernel_build, launch: str, *, stop_timeout_s=5.0, run_budget_s=None, corrupt=None):
        super().__init__()
        self.mem = SimMemory(RING)
        self.rings = self.mem.rings
        if corrupt:
            self.rings.control[0][corrupt] = 0
        module, self.loaded = drv.load_module(kernel_build)
        functions = {name: drv.get_function(module, name) for name in KERNELS}
        step_fn = drv.get_function(drv.load_image(TEST_STEP_IMAGE), TEST_STEP)
        self.graphs = SimStepGraphs(RING.buckets, step_fn)
        self._timer = StepTimer()
        self._engine = self.engine = DeviceScheduled(
            launch=launch,
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


def assert_released(fake: FakeSchedulerDriver, backend: SimBackend) -> None:
    g = backend.launch_graph
    assert int(g.exec) in fake.destroyed_execs and int(g._graph) in fake.destroyed_graphs
    assert backend.released and backend.engine._launch is None
    assert fake.destroyed_streams == 2  # the scheduler's and the launch graph's
    assert len(backend.engine.timeline()) == 0  # the reader is closed before the buffer goes


# ---- 1. start, the CQ poller, the pump ------------------------------------------------------------
@pytest.mark.parametrize("launch", LAUNCHES)
def test_start_runs_steps_and_the_poller_wakes_on_cq_tail(fake, kernel_build, launch):
    fake.allow_steps = 0  # an idle scheduler: no step, no CQ event
    b = SimBackend(kernel_build, launch)
    assert b.loaded == "cubin" and b.graphs.checked == 1
    assert b.description["launch"] == launch and "launch_fallback" not in b.description
    assert b.description["step_graph_nodes"] == {str(x): "1 kernel" for x in RING.buckets}
    b.start()
    assert b.state() == S.RUNNING  # start() returned only once the kernel reported it
    assert fake.scheduler_blocks == [SCHED_THREADS]
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
    launches = fake.graph_launches[int(b.launch_graph.exec)]
    if launch == "pump":  # each launch runs 8 steps; the pump keeps two queued
        assert launches >= n_steps // PUMP_STEPS_PER_LAUNCH + 1, launches
    else:
        assert launches == 1
    stats = b.stats()
    assert stats["timeline_steps"] == n_steps and stats["bubble_gaps"] == n_steps - 1
    assert b.step_histograms()["bubble_s"].count == n_steps - 1
    assert b.failure() is None
    b.stop()
    assert int(ctl["exit_reason"]) == layout.ExitReason.SHUTDOWN and b.state() == S.EXITED
    assert_released(fake, b)


# ---- 2. a failed init -----------------------------------------------------------------------
@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize(("corrupt", "named"), [("magic", "bad magic"), ("version", "bad layout version")])
def test_failed_init_raises_its_name_and_cleans_up(fake, kernel_build, launch, corrupt, named):
    b = SimBackend(kernel_build, launch, corrupt=corrupt)
    with pytest.raises(RuntimeError, match=f"rejected its configuration: {named}$"):
        b.start()
    assert b.state() == S.FAILED
    # EngineBackend.start's clean-up: shutdown asked, everything ended, the graphs destroyed
    assert int(b.rings.control[0]["shutdown"]) == 1
    assert b.engine.wait_stopped(time.monotonic() + 1.0) == []
    assert b.engine._threads == []  # start() spawned nothing
    assert b.failure() is None
    assert_released(fake, b)


@pytest.mark.parametrize("launch", LAUNCHES)
def test_refused_scheduler_launch_ends_the_graph_already_launched(fake, kernel_build, launch):
    """start() launches the step graph first; when the scheduler's own launch then fails, the
    graph's wait (state INIT, shutdown set by the clean-up) must end, or stop() would hang."""
    fake.refuse_scheduler_launch = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"
    b = SimBackend(kernel_build, launch)
    with pytest.raises(drv.CudaError, match="cuLaunchKernel failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
        b.start()
    assert fake.graph_launches[int(b.launch_graph.exec)] == 1 and b.state() == S.INIT
    assert int(b.rings.control[0]["shutdown"]) == 1
    assert b.engine.wait_stopped(time.monotonic() + 1.0) == []
    assert_released(fake, b)


# ---- 3. a kernel that exits on its own ------------------------------------------------------
@pytest.mark.parametrize("launch", LAUNCHES)
def test_kernel_exiting_on_its_own_is_a_failure_unless_stopping(fake, kernel_build, launch):
    b = SimBackend(kernel_build, launch, run_budget_s=0.1)
    b.start()
    assert int(b.rings.control[0]["run_budget_ns"]) == 100_000_000
    assert wait_until(lambda: b.state() == S.EXITED)
    assert fake.steps_handed > 0
    why = "the scheduler kernel exited on its own (exit reason: budget)"
    assert b.engine.failure(stopping=False) == why and b.failure() == why
    assert b.engine.failure(stopping=True) is None
    # the host threads end with the kernel (the poller and the pump watch its state)
    assert wait_until(lambda: not any(t.is_alive() for t in b.engine._threads), 5.0)
    assert b.engine.wait_stopped(time.monotonic() + 1.0) == []
    b.stop()
    assert_released(fake, b)


# ---- 4. stop ----------------------------------------------------------------------------------
@pytest.mark.parametrize("launch", LAUNCHES)
def test_stop_ends_kernel_graph_and_threads(fake, kernel_build, launch):
    b = SimBackend(kernel_build, launch)
    b.start()
    assert wait_until(lambda: fake.steps_signalled >= 5)
    b.rings.request_shutdown()
    assert b.engine.wait_stopped(time.monotonic() + 5.0) == []
    ctl = b.rings.control[0]
    assert b.state() == S.EXITED and int(ctl["exit_reason"]) == layout.ExitReason.SHUTDOWN
    assert b.engine.failure(stopping=True) is None
    assert not any(t.is_alive() for t in b.engine._threads)
    assert fake.steps_handed == fake.steps_signalled  # the step out at the stop still ran
    b.stop()  # EngineBackend: stopped, released
    assert_released(fake, b)
    b.stop()  # a second stop does nothing


@pytest.mark.parametrize("launch", LAUNCHES)
def test_stop_names_what_ignores_shutdown(fake, kernel_build, launch):
    fake.ignore_shutdown = True
    b = SimBackend(kernel_build, launch, stop_timeout_s=0.3)
    b.start()
    assert wait_until(lambda: fake.steps_signalled >= 2)
    b.rings.request_shutdown()
    stuck = b.engine.wait_stopped(time.monotonic() + 0.3)
    threads = ["thread rl-pump", "thread rl-cq-poll"] if launch == "pump" else ["thread rl-cq-poll"]
    assert stuck == ["the scheduler kernel", "the step graph launch", *threads]
    with pytest.raises(EngineDead, match=r"stop: the scheduler kernel, the step graph launch, .*running"):
        b.stop()
    assert "scheduler state running" in b.failure()
    assert not b.released and b.engine._launch is not None  # nothing freed under a running kernel
    assert not fake.destroyed_execs
    fake.halt.set()  # what a device reset would do: now everything ends
    assert b.engine.wait_stopped(time.monotonic() + 5.0) == []
    b.engine.release()
    assert int(b.launch_graph.exec) in fake.destroyed_execs


# ---- 5. --launch auto falls back to pump -----------------------------------------------------------
@pytest.mark.parametrize("refused", ["CU_GRAPH_COND_TYPE_WHILE", "instantiate WHILE"])
def test_auto_falls_back_to_pump_when_resident_is_refused(fake, kernel_build, refused):
    fake.unsupported = {refused}
    b = SimBackend(kernel_build, "auto")
    assert b.description["launch"] == "pump"
    fallback = b.description["launch_fallback"]
    call = "cuGraphAddNode(conditional)" if refused.startswith("CU_") else "cuGraphInstantiate"
    assert fallback.startswith(f"{call} failed: CUDA_ERROR_NOT_SUPPORTED"), fallback
    assert len(fake.destroyed_graphs) == 1  # the refused resident graph is not kept half-built
    b.start()
    assert wait_until(lambda: fake.steps_signalled >= 2 * PUMP_STEPS_PER_LAUNCH)
    assert fake.graph_launches[int(b.launch_graph.exec)] >= 2
    b.stop()
    assert_released(fake, b)


@pytest.mark.parametrize("refused", ["CU_GRAPH_COND_TYPE_WHILE", "instantiate WHILE"])
def test_resident_refused_raises_launch_unavailable(fake, kernel_build, refused):
    fake.unsupported = {refused}
    with pytest.raises(LaunchUnavailable, match="--launch resident: .*CUDA_ERROR_NOT_SUPPORTED"):
        SimBackend(kernel_build, "resident")
    assert not fake.graph_launches and not fake.scheduler_blocks  # nothing was launched


def test_auto_uses_resident_when_available(fake, kernel_build):
    b = SimBackend(kernel_build, "auto")
    assert b.description["launch"] == "resident" and "launch_fallback" not in b.description
    (loop,) = fake._graphs[int(b.launch_graph._graph)].nodes  # WHILE { wait -> SWITCH -> signal }
    assert loop.kind == "CONDITIONAL" and [n.kind for n in loop.bodies[0].nodes] == [
        "KERNEL",
        "CONDITIONAL",
        "KERNEL",
    ]
    assert len(loop.bodies[0].nodes[1].bodies) == len(RING.buckets)
