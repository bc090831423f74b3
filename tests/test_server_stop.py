"""A backend that does not stop is never passed over in silence: the server still closes its
sockets, and BackgroundServer.stop() re-raises the backend's EngineDead.  A backend whose
start() fails is stopped before the error propagates, so nothing it started outlives it."""

import time

import pytest
import zmq

from ringleader.device.backends.cpu import CpuBackend
from ringleader.hostctl.serving.background_server import BackgroundServer
from ringleader.hostctl.serving.server import Server
from ringleader.ipc.backend import EngineDead


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
    assert_port_free(address)  # the server closed its ROUTER anyway


def assert_port_free(address: str) -> None:
    """zmq closes a socket in its I/O thread, after close() returns, so the listener may take a
    moment to go."""
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


class FailsAfterStarting(CpuBackend):
    """Starts its engine thread, then fails: as a CUDA backend whose graph is launched when the
    scheduler kernel rejects its configuration."""

    stuck = False

    def start(self) -> None:
        super().start()
        raise RuntimeError("the scheduler kernel rejected its configuration: bad magic")

    def stop(self) -> None:
        super().stop()
        if self.stuck:
            raise EngineDead("stop: the step graph launch still running 5.0 s after shutdown")


@pytest.mark.parametrize("stuck", [False, True], ids=["stops", "stuck-on-stop"])
def test_a_failed_start_stops_what_it_started_and_raises_its_own_error(stuck):
    backend = FailsAfterStarting("tiny", n_slots=2, max_ctx=128)
    backend.stuck = stuck
    server = Server(backend, "tcp://127.0.0.1:0")
    with pytest.raises(RuntimeError, match="rejected its configuration") as info:
        server.serve_forever()
    assert not isinstance(info.value, EngineDead)  # the start's error, not the stop's
    assert not backend.thread_ids()  # the engine thread was told to stop, and did
    assert int(backend.rings.control[0]["shutdown"]) == 1
    assert_port_free(server.address)


def test_background_server_returns_once_serving_or_raises_the_start_error():
    server = Server(CpuBackend("tiny", n_slots=2, max_ctx=128), "tcp://127.0.0.1:0")
    with BackgroundServer(server):
        assert server.serving.is_set() and server.router._thread.is_alive()
    backend = FailsAfterStarting("tiny", n_slots=2, max_ctx=128)
    with pytest.raises(RuntimeError, match="rejected its configuration"):
        BackgroundServer(Server(backend, "tcp://127.0.0.1:0")).__enter__()
    assert not backend.thread_ids()
