"""The wake pipe on its own (hostctl/serving/wake.py): wake-ups coalesce into one message until
the frontend drains them, from any thread."""

import threading

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
