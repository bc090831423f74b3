"""The wake pipe on its own (hostctl/serving/wake.py): wake-ups coalesce into one message until
the frontend drains them, from any thread."""

import threading
import time

import zmq

from ringleader.hostctl.serving.wake import WakePipe


def pending_messages(pipe: WakePipe) -> int:
    count = 0
    while pipe.receiver.poll(50):
        pipe.receiver.recv()
        count += 1
    return count


def test_wake_ups_coalesce_until_drained():
    pipe = WakePipe(zmq.Context.instance())
    try:
        threads = [threading.Thread(target=pipe.notify) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert pipe.receiver.poll(1000)
        pipe.drain()
        assert pending_messages(pipe) == 0
        pipe.notify()
        pipe.notify()
        assert pending_messages(pipe) == 1  # drain() reset it: the next notify() sent one
    finally:
        pipe.close()


def test_the_completion_signal_counts_its_wake_ups_and_their_latency():
    """CompletionSignal (device/backends/doorbells.py): sets before a wait coalesce into one
    wake-up, a wait that times out is none, and each wake-up's latency from its first set is kept."""
    from ringleader.device.backends.doorbells import CompletionSignal

    signal = CompletionSignal()
    assert not signal.wait(0.01) and signal.figures()["completion_wakes"] == 0
    signal.set()
    signal.set()  # coalesces with the first
    time.sleep(0.003)
    assert signal.wait(1.0) and not signal.is_set()
    figures = signal.figures()
    assert figures["completion_wakes"] == 1
    assert figures["wake_latency_us_p50"] >= 2000  # its first set was 3 ms before the wait
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(signal.wait(5.0)))
    waiter.start()
    time.sleep(0.05)
    signal.set()
    waiter.join(5)
    assert woke == [True] and signal.figures()["completion_wakes"] == 2
