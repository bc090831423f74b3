"""A backend that does not stop is never passed over in silence: the server still closes its
sockets, and BackgroundServer.stop() re-raises the backend's EngineDead."""

import time

import pytest
import zmq

from device.backends.cpu import CpuBackend
from hostctl.server import BackgroundServer, Server
from ipc.backend import EngineDead


class StuckOnStop(CpuBackend):
    """Stops for real, then reports what a CUDA backend reports when its kernel stays."""

    def stop(self) -> None:
        super().stop()
        raise EngineDead("stop: the scheduler kernel still running 5.0 s after shutdown")


def test_engine_dead_on_stop_reaches_the_caller_and_sockets_close():
    server = Server(StuckOnStop("tiny", n_slots=2, max_ctx=128), "tcp://127.0.0.1:0")
    address = server.address
    bg = BackgroundServer(server)
    bg.__enter__()
    with pytest.raises(EngineDead, match="still running"):
        bg.stop()
    # the port is free again: the server closed its ROUTER anyway. zmq closes a socket in its
    # I/O thread, after close() returns, so the listener may take a moment to go
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    deadline = time.monotonic() + 2.0
    try:
        while True:
            try:
                sock.bind(address)
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
    finally:
        sock.close(0)


def test_a_clean_stop_raises_nothing():
    server = Server(CpuBackend("tiny", n_slots=2, max_ctx=128), "tcp://127.0.0.1:0")
    with BackgroundServer(server) as bg:
        assert bg.address.startswith("tcp://127.0.0.1:")
    assert bg.error is None
