"""The enumerations the host and the scheduler share (ringleader.ipc.layout re-exports them, and
writes each as `#define <prefix><NAME>` into the C header), with their names in words."""

from __future__ import annotations

from enum import Enum, IntEnum, IntFlag


# Enumerations shared by both sides: IntEnums here, `#define <prefix><NAME>` in the C header.
class Op(IntEnum):
    """RlSqEntry.op; the device reuses it for a pending entry's state."""

    NONE = 0
    GENERATE = 1
    CANCELLED = 3


class SqFlag(IntFlag):
    IGNORE_EOS = 1
    PENALIZED = 2  # keep its token counts (SamplingParams.penalized)
    LOGPROBS = 4  # its tokens' logprobs go out with their events (SamplingParams.logprobs)
    # its prompt tokens' logprobs go out as PROMPT events (SamplingParams.prompt_logprobs)
    PROMPT_LOGPROBS = 8


class AbortFlag(IntFlag):
    """RlAbortEntry.flags."""

    # only if its prefill has not started: cancels it in the SQ or the pending queue, leaves a
    # slot's request running (the server's --max-queue-ms counts waiting, not computing)
    IF_QUEUED = 1


class EventKind(IntEnum):
    TOKEN = 1
    DONE = 2
    # one prompt token's logprobs record (cq_logprobs at its position): `token` is the prompt
    # token, `index` its position in the prompt; all of a request's come before its first TOKEN
    PROMPT = 3


class Finish(IntEnum):
    """RlCqEvent.finish_reason of a DONE."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3


class SlotState(IntEnum):
    # ENDING: finished, its DONE not yet written (then FREE); ABORTED: its DONE written, but the
    # step in flight may still use the slot (FREE at the next critical phase); PREEMPTED: its
    # pages given back when decode ran out, waiting to recompute (PREFILL again when they fit)
    FREE = 0
    PREFILL = 1
    DECODE = 2
    ENDING = 3
    ABORTED = 4
    PREEMPTED = 5


class Policy(IntEnum):
    FIFO = 0
    PRIORITY = 1
    STATIC = 2


class SchedulerState(IntEnum):
    """RlControl.state."""

    INIT = 0
    RUNNING = 1
    EXITED = 2
    FAILED = 3


class ExitReason(IntEnum):
    """Why the scheduler loop ended: asked to (shutdown), compute kept its turn past the grace
    after shutdown (deadline), or the run budget ran out (budget)."""

    NONE = 0
    SHUTDOWN = 1
    DEADLINE = 2
    BUDGET = 3


class InitError(IntEnum):
    """RlControl.error_code: why the scheduler refused its configuration."""

    NONE = 0
    BAD_MAGIC = 1
    BAD_VERSION = 2
    BAD_CONFIG = 3
    BAD_FINGERPRINT = 4


class Turn(IntEnum):
    """The scheduler/compute hand-over word on CUDA."""

    SCHED = 0
    COMPUTE = 1
    EXIT = 2


class TraceField(IntEnum):
    """Device timeline, one row of TRACE_FIELDS u64 per step: the critical phase that built it,
    the step itself (first kernel of its SWITCH branch, then the signal kernel), the overlapped
    phase that ran beside it, flags (TraceFlag) and the step's seq + 1."""

    SCHED_BEGIN = 0
    SCHED_END = 1
    STEP_BEGIN = 2
    STEP_END = 3
    OVERLAP_BEGIN = 4
    OVERLAP_END = 5
    FLAGS = 6
    SEQ = 7


TRACE_FIELDS = len(TraceField)


class TraceFlag(IntFlag):
    CHAINED = 1
    VOID = 2  # a planned step whose rows all ended first: handed over with pad rows only


class StepStatus(IntEnum):
    """What sched_critical tells the step: run the layout it built, idle, stop, or fail."""

    IDLE = 0
    RUN = 1
    SHUTDOWN = 2
    ERROR = 3


# (enum, C prefix), in header order
C_ENUMS: tuple[tuple[type[Enum], str], ...] = (
    (Op, "RL_OP_"),
    (SqFlag, "RL_FLAG_"),
    (AbortFlag, "RL_ABORT_"),
    (EventKind, "RL_EV_"),
    (Finish, "RL_FINISH_"),
    (SlotState, "RL_SLOT_"),
    (Policy, "RL_POLICY_"),
    (SchedulerState, "RL_STATE_"),
    (ExitReason, "RL_EXIT_"),
    (InitError, "RL_ERR_"),
    (Turn, "RL_TURN_"),
    (TraceField, "RL_TRACE_"),
    (TraceFlag, "RL_TRACE_"),
    (StepStatus, "RL_STEP_"),
)


def c_defines() -> list[str]:
    lines = [f"#define {prefix}{member.name} {member.value}" for enum, prefix in C_ENUMS for member in enum]
    return lines + [f"#define RL_TRACE_FIELDS {TRACE_FIELDS}"]


EXIT_REASON_NAMES: dict[int, str] = {
    ExitReason.NONE: "running",
    ExitReason.SHUTDOWN: "shutdown",
    ExitReason.DEADLINE: "deadline",
    ExitReason.BUDGET: "budget",
}
STATE_NAMES: dict[int, str] = {s: s.name.lower() for s in SchedulerState}
ERROR_NAMES: dict[int, str] = {
    InitError.NONE: "none",
    InitError.BAD_MAGIC: "bad magic",
    InitError.BAD_VERSION: "bad layout version",
    InitError.BAD_CONFIG: "bad config",
    InitError.BAD_FINGERPRINT: "layout fingerprint mismatch",
}


def init_error_name(code: int) -> str:
    """The scheduler's RlControl.error_code in words (an unknown code says so with its number)."""
    try:
        return ERROR_NAMES[InitError(code)]
    except ValueError:
        return f"unknown error code {code}"
