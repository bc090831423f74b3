"""The launch graphs as launch_graph.py builds them (LaunchGraph, through the driver), run by the
simulated driver against the scheduler's real loop (the CPU build of sched_loop.h on a thread),
under random traffic.  The graphs' nodes are the CPU build's, the text kernel.cu compiles
(tests/fake_scheduler_kernels.py), so what is checked here is the construction the GPU launches,
not a hand-written copy of it: every handed-over step runs once, in seq order, in the bucket of
the branch its graph's SWITCH took, on the graph of its parity (ping-pong), and every request
ends once with the stand-in sampler's tokens, with the step's signal as a node of the launch
graph or as the last node of the step's own graph.  The step in each branch is that stand-in."""

from __future__ import annotations

import ctypes
import dataclasses
import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest

from ringleader.device.backends import cuda_driver as drv
from ringleader.device.backends.launch_graph import LaunchGraph
from ringleader.device.sched import build
from ringleader.device.sched.build import GRAPH_NODES
from ringleader.ipc import layout
from tests.conftest import wait_until
from tests.fake_scheduler_kernels import FakeSchedulerDriver
from tests.sched_driver import Driver
from tests.test_persistent_loop import ctl, stand_in_sampler, start_loop
from tests.test_pingpong_loop import (
    CFG,
    check_requests,
    check_steps,
    check_timeline,
    journal_entry,
    pingpong_driver,
    traffic,
)

SAMPLER = "rl_test_sampler"  # the stand-in step: one kernel, writing next_token for the samples


class LoopDriver(FakeSchedulerDriver):
    """The simulated driver with the stand-in step's kernel, journaling each step it runs and
    the graph (by stream) that ran it."""

    SIGS: ClassVar[dict[str, str]] = {**FakeSchedulerDriver.SIGS, SAMPLER: "I"}

    def __init__(self, d: Driver):
        super().__init__()
        self.d = d
        self.journal: list[dict] = []
        self.parity_of_thread: dict[str, int] = {}

    def k_rl_test_sampler(self, branch):
        parity = self.parity_of_thread[threading.current_thread().name]
        waits_for = int(self.d.a["launch"][0]["graph_seq"][parity])  # the signal moves it on
        self.journal.append(journal_entry(self.d, parity, waits_for, branch))
        stand_in_sampler(self.d)


class StandInSteps:
    """StepGraphs' interface: per bucket a graph of one stand-in sampler node."""

    def __init__(self, buckets, function):
        self.buckets = tuple(buckets)
        self._args = [drv.KernelArgs(ctypes.c_uint32(i)) for i in range(len(self.buckets))]
        self._raw = {}
        for i, bucket in enumerate(self.buckets):
            self._raw[bucket] = drv.create_graph()
            drv.add_kernel_node(self._raw[bucket], [], function, self._args[i])

    def raw(self, bucket: int):
        return self._raw[bucket]


@pytest.fixture
def launched(monkeypatch):
    """launched(mode, d, signal): the mode's launch graphs (the step's signal placed as asked),
    built by LaunchGraph over Driver d's context, each launched once on a stream of its own
    beside the real loop; returns (fake, loop)."""
    made: list = []

    def launch(mode: str, d: Driver, signal: str):
        fake = LoopDriver(d)
        monkeypatch.setattr(drv, "cu", fake)
        names = (*GRAPH_NODES, SAMPLER)
        module = drv.load_image(b"\x7fELF\0" + b"".join(b".text." + n.encode() + b"\0" for n in names))
        functions = {n: drv.get_function(module, n) for n in names}
        ctx_arg = ctypes.string_at(d.mem.context_address, 8 * len(layout.ARRAYS))
        streams = [drv.create_stream() for _ in range(2 if mode == "pingpong" else 1)]
        graph = LaunchGraph(
            mode,
            StandInSteps(d.cfg.buckets, functions[SAMPLER]),
            functions,
            ctx_arg,
            drv.current_context(),
            streams[0],
            signal=signal,
            programmatic=True,
        )
        loop = start_loop(d)
        for parity, stream in enumerate(streams):
            fake.parity_of_thread[f"fake-stream-{int(stream):#x}"] = parity
            graph.launch(stream, parity)
        made.append((fake, graph, streams, loop))
        return fake, loop

    yield launch
    for fake, graph, streams, loop in made:
        loop.join(30)
        ended = [wait_until(lambda s=s: drv.stream_done(s), 10) for s in streams]
        fake.halt.set()
        graph.destroy()
        fake.close()
        assert not loop.is_alive() and all(ended), "the loop or a launch graph did not end"
        assert not fake.errors, fake.errors[0]


@pytest.mark.parametrize("signal", ["in-step", "node"])
@pytest.mark.parametrize("mode", ["pingpong", "resident"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_built_launch_graphs_serve_random_traffic_on_the_real_loop(launched, mode, seed, signal):
    rng = np.random.default_rng(seed)
    d = pingpong_driver(CFG if mode == "pingpong" else dataclasses.replace(CFG, plan_ahead=False))
    ctl(d)["stop_grace_ns"] = 1_000_000_000
    fake, loop = launched(mode, d, signal)
    try:
        assert wait_until(lambda: int(ctl(d)["state"]) == layout.SchedulerState.RUNNING, 5)
        aborted = traffic(d, rng, wanted=30)
        assert wait_until(lambda: d.drain_cq() >= 0 and all(r.done for r in d.records.values()), 20), (
            f"stuck: turn {int(d.a['turn'][0])}, step {int(d.a['sched'][0]['step'])}, "
            f"{len(fake.journal)} steps run, launch words {d.a['launch'][0]}"
        )
    finally:
        d.rings.request_shutdown()
    loop.join(30)
    assert not loop.is_alive()
    assert int(ctl(d)["exit_reason"]) == layout.ExitReason.SHUTDOWN
    assert int(d.a["turn"][0]) == layout.Turn.EXIT
    check_requests(d, aborted)
    journal = fake.journal
    handed_over = int(d.a["sched"][0]["step"])
    assert fake.steps_signalled == handed_over == len(journal) > 0
    if mode == "pingpong":  # each seq once, on its parity's graph, in its planned bucket
        steps = check_steps(SimpleNamespace(d=d, journal=journal))
        assert {e["parity"] for e in journal} == {0, 1} and steps["steps"] == handed_over
        assert fake.gated == [(seq % 2, seq) for seq in range(handed_over)]
    else:  # one graph: each seq once, in order, in the bucket of its branch
        assert [e["seq"] for e in journal] == list(range(handed_over))
        assert all(CFG.buckets[e["branch"]] == e["bucket"] >= e["n_tokens"] > 0 for e in journal)
        assert fake.gated == []
    assert int(d.a["sched"][0]["preemptions"]) > 0
    check_timeline(d)


def _parameter_kinds(source: str, name: str, kinds: dict[str, str]) -> tuple[str, ...]:
    """The kinds of `name`'s parameters after the context, as `source` defines the function."""
    found = re.findall(rf"\b(?:void|uint32_t) {name}\(([^)]*)\)\s*\{{", source)
    assert len(found) == 1, (name, found)
    types = [" ".join(p.split()[:-1]) for p in found[0].split(",")]
    assert types[0] in ("RlContext", "const RlContext*"), types
    return tuple(kinds[t] for t in types[1:])


def test_the_cpu_nodes_take_the_kernels_parameters():
    """kernel.cu's graph node kernels and cpu_entry.cpp's exports of the same names take the
    parameters build.GRAPH_NODES declares (the simulated driver and LaunchGraph rely on it)."""
    sched = Path(build.__file__).parent
    kernel, cpu = (sched / "kernel.cu").read_text(), (sched / "cpu_entry.cpp").read_text()
    for name, params in GRAPH_NODES.items():
        assert (
            _parameter_kinds(kernel, name, {"cudaGraphConditionalHandle": "handle", "unsigned int": "u32"})
            == params
        )
        assert _parameter_kinds(cpu, name, {"RlCondHandle": "handle", "uint32_t": "u32"}) == params
    assert set(
        re.findall(r'extern "C" __global__ void\s*(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(', kernel)
    ) == set(build.KERNELS)
