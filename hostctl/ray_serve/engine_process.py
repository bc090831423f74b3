"""EngineProcess: the `ringleader serve` process a Ray Serve replica starts for itself, reached
over ZeroMQ on a private ipc:// socket, and ended with the replica.

Its own process, not a thread of the replica: the engine keeps its threads, its CUDA context
and its signal handling as `ringleader serve` has them, and a replica's health check can tell
an engine that died (its exit code) from one that stalls (the server's watchdog says so in
`stats`).  The engine dies with the replica too when the replica is killed outright: it gets
SIGTERM (a bounded drain) when the thread that started it ends (Linux's parent-death signal).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from ringleader.ipc.client import AsyncClient

log = logging.getLogger("ringleader.ray_serve")

PR_SET_PDEATHSIG = 1
STOP_WAIT_S = 20.0  # SIGTERM drains (serve's --drain-timeout, then at most 5 s more); then SIGKILL


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the replica's __del__ still stops it


class EngineStartError(RuntimeError):
    """The engine exited or did not serve within its start timeout."""


class EngineProcess:
    """One `ringleader serve --bind ipc://...` child; `address` is where it serves."""

    def __init__(self, serve_argv: list[str], tag: str):
        self._dir = tempfile.mkdtemp(prefix="rl-ray-")
        # the replica's id in the socket's name: `ps` tells which engine belongs to which replica
        self.address = f"ipc://{self._dir}/{tag}.sock"
        argv = [sys.executable, "-m", "ringleader.hostctl.cli", "serve", "--bind", self.address, *serve_argv]
        log.info("starting the engine: %s", " ".join(argv))
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_reason(self) -> str | None:
        """None while the process runs; else how it ended."""
        code = self.proc.poll()
        if code is None:
            return None
        if code < 0:
            return f"the engine process was killed by signal {signal.Signals(-code).name}"
        return f"the engine process exited with code {code}"

    async def wait_serving(self, timeout_s: float) -> dict:
        """The engine's first `stats` reply, once its model loaded and it serves; raises
        EngineStartError if it exits first or does not serve within timeout_s."""
        deadline = time.monotonic() + timeout_s
        # no liveness clock: an engine loading its model neither connects nor answers yet
        async with AsyncClient(self.address, connect_timeout=None, reply_timeout=None) as probe:
            while True:
                why = self.exit_reason()
                if why is not None:
                    raise EngineStartError(f"{why} before it served (its output is in this replica's log)")
                if time.monotonic() > deadline:
                    raise EngineStartError(f"the engine did not serve within {timeout_s:g} s")
                try:
                    return await probe.stats(timeout=0.5)
                except TimeoutError:
                    await asyncio.sleep(0.1)

    async def stop(self) -> None:
        """SIGTERM (serve drains, bounded), SIGKILL after STOP_WAIT_S; removes the socket's folder."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.send_signal(signal.SIGCONT)  # a stopped engine (SIGSTOP, a debugger) takes it too
            deadline = time.monotonic() + STOP_WAIT_S
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.proc.poll() is None:
                log.warning("the engine (pid %d) did not stop within %g s: killing it", self.pid, STOP_WAIT_S)
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __repr__(self) -> str:
        return f"EngineProcess(pid={self.pid}, address={self.address!r}, {self.exit_reason() or 'running'})"
