"""BackgroundServer: a Server run on a thread of its own (`ringleader serve` runs its server on
the main thread instead)."""

from __future__ import annotations

import logging
import threading

from ringleader.hostctl.serving.server import Server

log = logging.getLogger("ringleader.server")


class BackgroundServer:
    """Runs a Server on a thread: for tests and for embedding the runtime in a program."""

    def __init__(self, server: Server):
        self.server = server
        self.error: BaseException | None = None  # what ended serve_forever, if not a clean stop
        self._thread = threading.Thread(target=self._serve, name="rl-frontend", daemon=True)

    def _serve(self) -> None:
        try:
            self.server.serve_forever()
        except BaseException as exc:  # kept for stop() to raise on the caller's thread
            self.error = exc
            log.error("server ended with an error: %r", exc)

    @property
    def address(self) -> str:
        return self.server.address

    def __enter__(self):
        """Returns once the server serves (its backend and completion thread started); raises
        what ended it instead if its start failed."""
        self._thread.start()
        while not self.server.serving.wait(0.05):
            if not self._thread.is_alive():
                self._thread.join()
                raise self.error or RuntimeError("the server ended before it started serving")
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the server; re-raises what ended it badly (EngineDead from a device that did not
        stop), and raises TimeoutError if it is still running after `timeout` seconds."""
        self.server.request_stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the server did not stop within {timeout} s")
        if self.error is not None:
            raise self.error
