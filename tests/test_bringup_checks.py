"""The bring-up's own checks (bench/bringup_checks.py) run their whole logic on the CPU, so a
GPU run does not spend its minutes on a Python mistake.  A CUDA graph cannot exist here: the
stand-in below replays the static step eagerly and reports the node list a plain step graph has."""

import torch

from bench import bringup_checks
from device.backends.cpu import CpuBackend
from device.backends.cuda_graph_rules import GraphNode


class EagerGraphs:
    """StepGraphs' interface; replay = the static step run eagerly on the captured layout."""

    def __init__(self, step, layout, buckets, stream, keep_outputs=False):
        self.buckets, self._step, self._layout, self.outputs = tuple(buckets), step, layout, {}
        self.nodes = [GraphNode("CU_GRAPH_NODE_TYPE_KERNEL"), GraphNode("CU_GRAPH_NODE_TYPE_MEMCPY")]

    def __getitem__(self, bucket):
        graphs = self

        class Replay:
            def replay(self):
                graphs.outputs[bucket] = graphs._step.run(bucket, graphs._layout)

        return Replay()

    def read(self, bucket):
        return self.nodes, 0


def test_graph_check_passes_on_a_faithful_replay():
    figures = bringup_checks.check_graphs("float32", device="cpu", graphs_cls=EagerGraphs)
    assert figures["ok"], figures
    assert figures["logit_rel_err"] == 0.0 and figures["greedy_rows_decided"] > 10
    assert len(figures["buckets_run"]) >= 3 and figures["replay_alone_ok"]
    assert figures["nodes"][1] == "1 kernel, 1 memcpy"


class DriftingGraphs(EagerGraphs):
    """A replay that is slightly off: the check must notice."""

    def __getitem__(self, bucket):
        inner = super().__getitem__(bucket)
        graphs = self

        class Replay:
            def replay(self):
                inner.replay()
                graphs.outputs[bucket] = graphs.outputs[bucket] * 1.01

        return Replay()


def test_graph_check_fails_on_drift_and_on_forbidden_nodes():
    drift = bringup_checks.check_graphs("float32", device="cpu", graphs_cls=DriftingGraphs)
    assert not drift["ok"] and drift["logit_rel_err"] > bringup_checks.LOGIT_TOLERANCE["float32"]

    class HostNodeGraphs(EagerGraphs):
        def read(self, bucket):
            return self.nodes + [GraphNode("CU_GRAPH_NODE_TYPE_HOST")], 0

    host = bringup_checks.check_graphs("float32", device="cpu", graphs_cls=HostNodeGraphs)
    assert not host["ok"] and not host["embeddable"] and "HOST x1" in host["nodes"][4]


class HostLoopBackend(CpuBackend):
    """Takes the CUDA backend's options, so the backend check's own logic runs on a CPU."""

    def __init__(self, spec, *, scheduler, launch, dtype, run_budget_s, **options):
        assert dtype == torch.float32 and run_budget_s > 0
        super().__init__(spec, **options)
        self.description["launch"] = "host-loop"


def test_backend_check_logic_on_the_cpu_backend():
    figures = bringup_checks.check_backend("host", "auto", backend_cls=HostLoopBackend, device="cpu")
    assert figures["ok"], figures
    assert figures["parity"] and figures["streams_one_done_each"] and figures["launch_running"] == "host-loop"
    assert figures["device"]["generated"] >= 3 * 24 and figures["stop_s"] < 5
