"""The bring-up's own checks (bench/lab/bringup_checks.py) run their whole logic on the CPU, so a
GPU run does not spend its minutes on a Python mistake.  A CUDA graph cannot exist here: the
stand-in below replays the static step eagerly and reports the node list a plain step graph has."""

import pytest
import torch

from ringleader.bench.lab import bringup_checks
from ringleader.device.backends.cpu import CpuBackend
from ringleader.device.backends.cuda_graph_rules import GraphNode


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


class CraftedReference:
    """prompt_logits: a fixed logit vector per context length (what the reference would say)."""

    def __init__(self, by_length):
        self.by_length = by_length

    def prompt_logits(self, ids):
        return torch.tensor(self.by_length[len(ids)], dtype=torch.float32)


def test_greedy_agreement_accepts_a_divergence_only_at_a_near_tie():
    prompts = [[1], [1], [1]]
    want = [[0, 2], [0, 2], [0]]
    got = [[0, 2], [0, 1], [0, 3]]
    # after [1, 0] the reference's tokens 2 and 1 score 10.0 and 9.9995: within 1e-4 x 10
    near = CraftedReference({2: [0.0, 9.9995, 10.0, 0.0]})
    out = bringup_checks.greedy_agreement(near, prompts, got, want, tolerance=1e-4)
    assert out["exact_prompts"] == [0]
    assert [t["prompt"] for t in out["tie_divergences"]] == [1]
    assert out["tie_divergences"][0]["index"] == 1
    assert out["tie_divergences"][0]["gap"] == pytest.approx(5e-4, rel=1e-2)
    assert out["mismatched"] == [2]  # a different number of tokens: a mismatch, whatever the logits
    # the same divergence where token 2 leads by a whole logit is a mismatch
    firm = CraftedReference({2: [0.0, 9.0, 10.0, 0.0]})
    out = bringup_checks.greedy_agreement(firm, prompts[:2], got[:2], want[:2], tolerance=1e-4)
    assert out["exact_prompts"] == [0] and not out["tie_divergences"]
    assert out["mismatched"][0]["prompt"] == 1 and out["mismatched"][0]["gap"] == pytest.approx(1.0)


class BuiltNotLaunched(CpuBackend):
    """Stands in for the CUDA backend the embed check builds: takes an EngineConfig, reports
    the launch mode it built, and must be stopped without ever being started."""

    stopped = False

    def __init__(self, config):
        super().__init__(config, n_slots=2, max_ctx=64)
        self.description["launch"] = config.launch

    def start(self):  # pragma: no cover - the check must never launch
        raise AssertionError("the embed check launched the backend")

    def stop(self):
        BuiltNotLaunched.stopped = True
        super().stop()


def test_embed_check_builds_at_the_server_defaults_and_never_launches():
    figures = bringup_checks.check_embed("tiny", backend_cls=BuiltNotLaunched)
    assert figures["ok"] and figures["launch"] == "resident" and BuiltNotLaunched.stopped
    assert figures["n_slots"] == 128 and figures["token_budget"] == 256  # what `serve` builds

    class Unavailable(BuiltNotLaunched):
        def __init__(self, config):
            raise RuntimeError("--launch resident: the WHILE/SWITCH graph could not be built")

    failed = bringup_checks.check_embed("tiny", backend_cls=Unavailable)
    assert not failed["ok"] and "WHILE/SWITCH" in failed["error"]


def test_the_kernel_run_budget_follows_the_stage_timeout(monkeypatch):
    monkeypatch.setenv("RL_BRINGUP_TIMEOUT_S", "120")
    assert bringup_checks.kernel_run_budget_s() == 100.0
    monkeypatch.setenv("RL_BRINGUP_TIMEOUT_S", "15")
    assert bringup_checks.kernel_run_budget_s() == 10.0
    monkeypatch.delenv("RL_BRINGUP_TIMEOUT_S")
    assert bringup_checks.kernel_run_budget_s() == 240.0
