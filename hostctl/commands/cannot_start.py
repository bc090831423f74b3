"""How a command that fails before it does its work says so: one line naming the fault, exit code 2."""

from __future__ import annotations

import logging
import sys
import traceback

from ringleader.ipc.curve import CurveError

log = logging.getLogger("ringleader.cli")

# Exceptions whose message is the whole story (they name the fault and, where there is one, the
# fix); any other type gets its name in the line, since it is likely a bug.
CLEAN_ERRORS = (ValueError, OSError, ImportError, RuntimeError, KeyError, MemoryError, CurveError)


class CommandError(Exception):
    """A command's failure, its message one line naming the flag at fault; cli.main prints it as
    `ringleader COMMAND: message` and exits with exit_code (2: a mistake in the command line, 1:
    the server did not answer)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def cannot_start(exc: BaseException, what: str = "cannot start") -> int:
    """One line on stderr naming the fault; exit code 2.  Under --log-level debug the traceback
    is printed first."""
    if log.isEnabledFor(logging.DEBUG):
        traceback.print_exception(exc)
    if isinstance(exc, KeyError) and exc.args:
        message = str(exc.args[0])  # str(KeyError) quotes its message
    elif isinstance(exc, OSError) and exc.strerror and exc.filename is None:
        message = exc.strerror  # without the "[Errno N]" prefix; ours name the address
    else:
        message = str(exc) or type(exc).__name__
    if not isinstance(exc, CLEAN_ERRORS):
        message = f"{type(exc).__name__}: {message} (--log-level debug shows where)"
    print(f"ringleader: {what}: {message}", file=sys.stderr, flush=True)
    return 2
