"""The host-driven engine loop (device/backends/engine_loop.py), written once for the CPU backend
and CUDA's `--scheduler host`: a StepRunner whose step computes beside the overlapped phase, as a
GPU's does, gives exactly the tokens of the serial CPU runner; a step that fails or a stop in the
middle of a step ends every request as the server promises.  The threaded runner here stands in
for GraphStepRunner's queue-then-wait shape on a machine without a GPU."""

from __future__ import annotations

import threading

import pytest

from ringleader.device.backends.cpu import CpuBackend
from ringleader.device.backends.eager_runner import EagerStepRunner
from ringleader.ipc.client import Client
from tests.conftest import running_server

PROMPTS = [[1, 5, 17, 200, 33], [1, 250, 3, 3, 90, 91, 92, 7], [1, 42], list(range(1, 40))]


class ThreadedStepRunner(EagerStepRunner):
    """launch() starts the step on a thread of its own and finish() joins it: the scheduler's
    overlapped phase then runs while the step computes, the order GraphStepRunner gives a GPU."""

    overlaps_host = True
    launches = 0

    def launch(self) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._compute, name="fake-compute-stream")
        self._thread.start()
        type(self).launches += 1

    def _compute(self) -> None:
        try:
            super().finish()
        except BaseException as exc:  # handed to the engine thread, as a failed launch would be
            self._error = exc

    def finish(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        self._thread.join()


class OverlappedBackend(CpuBackend):
    runner_class = ThreadedStepRunner


def _generate_all(backend_cls, **options) -> list[list[int]]:
    # a small token budget puts the long prompt's chunked prefill beside decode rows
    with running_server("tiny", backend_cls=backend_cls, n_slots=4, token_budget=8, **options) as bg:
        with Client(bg.address, timeout=120) as c:
            streams = [c.generate(prompt_ids=p, max_tokens=24, ignore_eos=True) for p in PROMPTS]
            sampled = [
                c.generate(prompt_ids=p, max_tokens=24, ignore_eos=True, temperature=0.8, seed=7 + i)
                for i, p in enumerate(PROMPTS)
            ]
            for s in streams + sampled:
                s.wait()
    return [s.token_ids for s in streams + sampled]


def test_a_step_computed_beside_the_overlapped_phase_gives_the_serial_tokens():
    before = ThreadedStepRunner.launches
    serial = _generate_all(CpuBackend)
    overlapped = _generate_all(OverlappedBackend)
    assert ThreadedStepRunner.launches > before + 24  # the overlapped runner did run the steps
    assert all(len(t) == 24 for t in serial)
    assert overlapped == serial


class FailingOverlappedRunner(ThreadedStepRunner):
    fail_after = 4

    def _compute(self) -> None:
        type(self).fail_after -= 1
        if type(self).fail_after < 0:
            self._error = RuntimeError("injected fault on the compute stream")
            return
        super()._compute()


class FailingOverlappedBackend(CpuBackend):
    runner_class = FailingOverlappedRunner


def test_a_step_failing_on_its_own_thread_ends_every_request_with_engine_dead():
    with running_server("tiny", backend_cls=FailingOverlappedBackend, n_slots=4) as bg:
        with Client(bg.address, timeout=60) as c:
            streams = [c.generate(prompt_ids=p, max_tokens=64, ignore_eos=True) for p in PROMPTS]
            for s in streams:
                s.wait()
        failure = bg.server.backend.failure()
    assert {s.done.error_code for s in streams} == {"engine_dead"}
    assert "rl-engine failed" in failure and "injected fault on the compute stream" in failure


@pytest.mark.parametrize("backend_cls", [CpuBackend, OverlappedBackend], ids=["serial", "overlapped"])
def test_a_stop_while_steps_run_ends_every_request_and_the_engine_thread(backend_cls):
    """The server stops with requests mid-decode: a step may be launched when the scheduler
    sees shutdown (the runner's cancel); every stream still gets its one done."""
    with running_server("tiny", backend_cls=backend_cls, n_slots=4) as bg:
        backend = bg.server.backend
        c = Client(bg.address, timeout=60)
        streams = [c.generate(prompt_ids=p, max_tokens=400, ignore_eos=True) for p in PROMPTS]
        next(iter(streams[0]))  # decoding has begun
    for s in streams:
        s.wait()
    c.close()
    assert all(s.done is not None for s in streams)
    assert {s.done.finish_reason for s in streams} <= {"error", "length"}
    assert not backend.thread_ids() and backend.failure() is None
    backend.stop()  # a second stop does nothing
