"""--max-queue-ms counts waiting, not computing (issue 55): a request whose prefill has started
runs on however long its prompt takes; one still waiting for a batch slot when the limit passes
ends with a timeout that says so.  The device decides which of the two a request is (an
IF_QUEUED abort: ipc/layout_enums.py AbortFlag), on the CPU-built scheduler the CUDA one shares."""

from __future__ import annotations

import time

import numpy as np

from ringleader.device.backends.cpu import CpuBackend
from ringleader.device.backends.eager_runner import EagerStepRunner
from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig
from tests.conftest import RawPeer, running_server
from tests.sched_driver import Driver
from tests.test_reliability import dones_of, generate


def small_config(**kw) -> RingConfig:
    base = dict(n_slots=1, max_ctx=64, token_budget=8, sq_size=8, cq_size=128, arena_size=512, pending_cap=8)
    return RingConfig(**{**base, **kw})


def slot_handles(d: Driver) -> set[int]:
    return {int(sl["handle"]) for sl in d.a["slots"] if int(sl["state"]) != layout.SlotState.FREE}


def test_an_if_queued_abort_cancels_a_waiting_request_and_leaves_a_prefilling_one_running():
    d = Driver(small_config())
    running = d.submit(np.arange(40, dtype=np.int32) + 3, 6)  # 40 prompt tokens: 5 prefill steps
    d.step()
    waiting = d.submit(np.arange(4, dtype=np.int32) + 3, 6)
    d.step()
    assert slot_handles(d) == {running}, "the first request holds the only slot"
    assert not d.records[running].tokens, "still in its prefill: no token yet"
    assert int(d.a["sched"][0]["n_pending"]) == 1, "the second one waits in the pending queue"
    d.abort(running, if_queued=True)
    d.abort(waiting, if_queued=True)
    d.step()
    assert d.records[waiting].done == [layout.Finish.ABORT]
    assert slot_handles(d) == {running} and not d.records[running].done
    d.run_until_idle()
    assert d.records[running].done == [layout.Finish.LENGTH]
    assert len(d.records[running].tokens) == 6


def test_an_if_queued_abort_of_a_generate_still_in_the_sq_cancels_it():
    d = Driver(small_config())
    handle = d.submit([5, 6, 7], 4)
    d.abort(handle, if_queued=True)  # published with the GENERATE, before any drain
    d.run_until_idle()
    assert d.records[handle].done == [layout.Finish.ABORT] and not d.records[handle].tokens


def test_a_plain_abort_after_an_ignored_if_queued_one_still_ends_the_request():
    d = Driver(small_config())
    handle = d.submit(np.arange(40, dtype=np.int32) + 3, 50)
    d.step()
    d.step()
    d.abort(handle, if_queued=True)
    d.step()
    assert slot_handles(d) == {handle} and not d.records[handle].done
    d.abort(handle)
    d.run_until_idle()
    assert d.records[handle].done == [layout.Finish.ABORT]
    assert len(d.records[handle].tokens) < 50


def test_the_same_batch_holding_both_kinds_of_abort_of_one_request_aborts_it():
    d = Driver(small_config())
    handle = d.submit(np.arange(40, dtype=np.int32) + 3, 50)
    d.step()
    d.step()
    d.abort(handle, if_queued=True)
    d.abort(handle)
    d.step()
    d.run_until_idle()
    assert d.records[handle].done == [layout.Finish.ABORT]


class SlowStepRunner(EagerStepRunner):
    """A deliberately slow model step (60 ms), as a big model's prefill on a busy CPU is."""

    def finish(self) -> None:
        time.sleep(0.06)
        super().finish()


class SlowBackend(CpuBackend):
    runner_class = SlowStepRunner


def test_a_long_prompt_whose_prefill_outlasts_the_queue_limit_is_served():
    # 480 prompt tokens at 32 a step: 15 steps of >= 60 ms, twice the 400 ms queue limit
    with running_server(
        backend_cls=SlowBackend,
        n_slots=2,
        token_budget=32,
        max_ctx=1024,
        server_options=dict(max_queue_ms=400),
    ) as bg:
        peer = RawPeer(bg.address)
        t0 = time.monotonic()
        peer.send(generate("long", 3, prompt=[3 + i % 250 for i in range(480)]))  # tiny: 264 ids
        done = dones_of(peer, ["long"], timeout=60)["long"]
        assert done["finish_reason"] == "length", done.get("error")
        assert done["usage"] == {"prompt_tokens": 480, "completion_tokens": 3}
        assert time.monotonic() - t0 > 0.8, "the prefill did outlast the queue limit"
        assert bg.server.stats()["timed_out"] == 0
        peer.close()


def test_a_request_still_waiting_for_a_slot_at_the_limit_gets_a_timeout_saying_so():
    with running_server(
        backend_cls=SlowBackend,
        n_slots=1,
        token_budget=32,
        max_ctx=1024,
        server_options=dict(max_queue_ms=300),
    ) as bg:
        peer = RawPeer(bg.address)
        peer.send(generate("runner", 40))  # 40 steps of >= 60 ms hold the only slot
        peer.send(generate("waiter", 4))
        waiter = dones_of(peer, ["waiter"], timeout=30)["waiter"]
        assert waiter["finish_reason"] == "error" and waiter["error"]["code"] == "timeout"
        message = waiter["error"]["message"]
        assert "waited" in message and "batch slot" in message and "--max-queue-ms" in message, message
        assert waiter["usage"] == {"prompt_tokens": 0, "completion_tokens": 0}
        runner = dones_of(peer, ["runner"], timeout=60)["runner"]
        assert runner["finish_reason"] == "length" and runner["usage"]["completion_tokens"] == 40
        assert bg.server.stats()["timed_out"] == 1
        peer.close()
