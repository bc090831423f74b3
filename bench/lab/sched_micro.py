"""Scheduler microbenchmark: the CPU build of the scheduler (device/sched) on synthetic slot states, per phase.

    python bench/lab/sched_micro.py                                   # table on stdout
    python bench/lab/sched_micro.py --json out.json --before ba3cd4b  # also the pre-split scheduler
    python bench/lab/sched_micro.py --null-host-check --steps 100     # critical never reads the host
    python bench/lab/sched_micro.py --steady --plan-ahead --json s.json  # steady path against full build

Scenarios (each at --sizes, default 1, 32, 256 slots; token_budget max(n_slots, 256)):
  decode-only      every slot decodes a long request (its prefill done during warm-up)
  mixed-prefill    half the slots decode, the rest prefill prompts of 2 budgets in chunks and
                   end after one token, so new arrivals keep taking their slots
  admission-heavy  requests of 1-2 tokens: slots free and refill every step; the SQ kept full
  abort-storm      2*n_slots+16 requests live (running, pending, in the SQ), a quarter of them
                   aborted through the abort ring every step
Each step: critical (timed, host accesses counted) -> a stand-in model writes next_token ->
overlapped (timed, counted) -> the host reads the CQ, releases arenas, aborts and submits (not
timed).  A step is what sched_step() does: when a critical pass built nothing but the overlapped
pass left work (e.g. slots just admitted), both run again (the host reads the CQ in between, as
its reader thread would), and the step's times and accesses are the sums over its passes.
`exposed` is what the model step would wait for: every critical pass, plus the overlapped passes
that had no step to hide behind.  Times are the ctypes call around each phase (perf_counter_ns;
the per-call floor is machine.ctypes_call_us); warm-up steps are not measured; the GC is off
while measuring.  On the CPU host-shared memory is ordinary memory, so what the split saves on
the GPU (PCIe round trips between two steps) shows here as host accesses, not as time.

--json PATH writes {"scenarios": [{"name", "n_slots", "phases": {"critical": {"us_per_step"
(median), "us_p99", "host_accesses_per_step", "host_accesses_by_kind"}, "overlapped": {...}},
"exposed": {...}, ...}], "machine": {...}, "mode": "split"}.  --steady: the critical phase's
steady path against the full build on twin harnesses in lockstep (sched_micro_report.py says
how, and what its JSON holds).  With --before REV the same file
also holds "before": the document of REV measured in a temporary git worktree with
--whole-step (mode "whole-step": CpuScheduler.step() timed as "critical", since before the split
all of it sat between two model steps; overlapped null; host accesses null, not counted then).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # `python bench/lab/sched_micro.py`: this tree's packages come first
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ringleader.bench.report import cpu_identity
from ringleader.device.backends.host_memory import HostMemory

# Only names the pre-split tree has too at module level: --before runs this file there.
from ringleader.device.sched import build
from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig
from tests.sched_driver import scheduler, token_for

try:
    from ringleader.ipc.sampling_params import SamplingParams
except ImportError:  # a --before tree from before it
    SamplingParams = None  # type: ignore[assignment,misc]

REPO = Path(__file__).resolve().parents[2]


def _shared(enum: str, member: str) -> int:
    """A layout enum value; --before may run this file in a tree from before the typed enums,
    whose layout had RL_<PREFIX>_<MEMBER> globals instead."""
    if hasattr(layout, enum):
        return int(getattr(getattr(layout, enum), member))
    return int(getattr(layout, _OLD_PREFIX[enum] + member))


_OLD_PREFIX = {
    "StepStatus": "RL_STEP_",
    "EventKind": "RL_EV_",
    "Finish": "RL_FINISH_",
    "InitError": "RL_ERR_",
    "SlotState": "RL_SLOT_",
    "SqFlag": "RL_FLAG_",
}


def push_generate(sq, handle: int, prompt_off: int, prompt_len: int, max_tokens: int) -> int:
    """One ignore-EOS GENERATE, in whichever SubmissionQueue.push form this tree has."""
    if "sampling" not in inspect.signature(sq.push).parameters:  # before SamplingParams: fields as keywords
        return sq.push(
            handle, prompt_off=prompt_off, prompt_len=prompt_len, max_tokens=max_tokens, flags=IGNORE_EOS
        )
    params = SamplingParams(max_tokens, seed=0, ignore_eos=True)
    return sq.push(handle, params, prompt_off=prompt_off, prompt_len=prompt_len)


STEP_RUN, STEP_IDLE, STEP_SHUTDOWN = (_shared("StepStatus", m) for m in ("RUN", "IDLE", "SHUTDOWN"))
EV_TOKEN = _shared("EventKind", "TOKEN")
FINISH_LENGTH, FINISH_ABORT = _shared("Finish", "LENGTH"), _shared("Finish", "ABORT")
INIT_OK = _shared("InitError", "NONE")
SLOT_DECODE = _shared("SlotState", "DECODE")
IGNORE_EOS = _shared("SqFlag", "IGNORE_EOS")
SCENARIOS = ("decode-only", "mixed-prefill", "admission-heavy", "abort-storm")
SIZES = (1, 32, 256)
LONG = 1 << 20  # max_tokens of requests that should outlive the run
VOCAB = 1000


# RINGLEADER_SCHED_MICRO_PREFIX_CACHING=0 measures with the prefix cache off (on: the default);
# an environment variable, since --before runs this file on trees that have no such field
_PREFIX = os.environ.get("RINGLEADER_SCHED_MICRO_PREFIX_CACHING")


def ring_config(n_slots: int, **fields) -> RingConfig:
    """fields: more RingConfig fields (--steady's buckets and plan_ahead)."""
    extra = {} if _PREFIX is None else {"prefix_caching": _PREFIX != "0"}
    return RingConfig(
        **extra,
        **fields,
        n_slots=n_slots,
        # long enough that no request of a run of up to ~30k steps ends by context; no longer,
        # since each slot's token row and block table are sized by it (and the page pool, at
        # every slot's full context, is set free at init)
        max_ctx=1 << 15,
        token_budget=max(n_slots, 256),
        sq_size=1024,
        cq_size=8192,
        arena_size=1 << 20,
        pending_cap=1024,
    )


@dataclass(frozen=True)
class Kind:
    """Requests the host keeps live (submitted, no DONE yet): `target` of them, or None to keep
    the SQ full."""

    target: int | None
    prompt_len: tuple[int, int]  # inclusive range
    max_tokens: tuple[int, int]


def workload(name: str, n_slots: int, budget: int) -> tuple[tuple[Kind, ...], float]:
    """The request kinds, in submission order, and the share of live requests aborted per step."""
    if name == "decode-only":
        return (Kind(n_slots, (16, 16), (LONG, LONG)),), 0.0
    if name == "mixed-prefill":  # decoders first, so FIFO admission gives them their half
        n_dec = n_slots // 2
        return (
            Kind(n_dec, (16, 16), (LONG, LONG)),
            Kind(n_slots - n_dec + 4, (2 * budget, 2 * budget), (1, 1)),
        ), 0.0
    if name == "admission-heavy":
        return (Kind(None, (4, 16), (1, 2)),), 0.0
    if name == "abort-storm":
        return (Kind(2 * n_slots + 16, (32, 32), (8, 64)),), 0.25
    raise ValueError(f"unknown scenario {name!r}")


class Request:
    __slots__ = ("aborted", "arena_off", "kind", "max_tokens", "n_tokens", "sq_pos")

    def __init__(self, kind, arena_off, sq_pos, max_tokens):
        self.kind, self.arena_off, self.sq_pos, self.max_tokens = kind, arena_off, sq_pos, max_tokens
        self.n_tokens, self.aborted = 0, False


def null_host_context(mem: HostMemory) -> ctypes.Array:
    """A copy of the RlContext table with every host-only pointer zeroed: touching one segfaults."""
    table = (ctypes.c_uint64 * len(mem._context))(*mem._context)
    for i, (name, _, _) in enumerate(layout.ARRAYS):
        if name in layout.HOST_RINGS:
            table[i] = 0
    return table


class Harness:
    """One scenario on real host memory and the real scheduler; the host side is deterministic
    (seeded), so two harnesses with the same arguments run in lockstep."""

    def __init__(
        self,
        scenario: str,
        n_slots: int,
        *,
        seed: int = 0,
        whole_step: bool = False,
        null_host_critical: bool = False,
        record_layouts: bool = False,
        force_full: bool = False,
        ring: dict | None = None,
    ):
        """force_full: sched.steady_rows zeroed before every critical pass (the full build);
        ring: more RingConfig fields."""
        self.scenario, self.n_slots = scenario, n_slots
        self.cfg = ring_config(n_slots, **(ring or {}))
        self.kinds, self.abort_share = workload(scenario, n_slots, self.cfg.token_budget)
        self.mem = HostMemory(self.cfg)
        self.a, self.rings, self.ctx = self.mem.arrays, self.mem.rings, self.mem.context_address
        self.sched = scheduler()
        self.whole_step, self.force_full = whole_step, force_full
        # the steady path's input (a tree from before it has no such field)
        sched = self.a.get("sched")
        self._steady = (
            sched["steady_rows"] if sched is not None and "steady_rows" in sched.dtype.names else None
        )
        self._null_table = null_host_context(self.mem) if null_host_critical else None  # kept alive
        self.critical_ctx = ctypes.addressof(self._null_table) if null_host_critical else self.ctx
        self.rng = np.random.default_rng(seed)
        self.pool = self.rng.integers(0, VOCAB, size=1 << 16, dtype=np.int32)
        self.live: dict[int, Request] = {}
        self.live_by_kind = [0] * len(self.kinds)
        self.next_handle, self.submitted, self.finished = 1, 0, 0
        self.submitting = True
        self.errors: list[str] = []
        self.layouts: list[dict] | None = [] if record_layouts else None
        assert self.sched.init(self.ctx) == INIT_OK
        self.top_up()

    # ---- the scheduler's side
    def step(self) -> dict:
        """One step; returns its sample (ns and host accesses per phase, passes, events)."""
        self.rings.submissions.publish()
        self.rings.aborts.publish()
        s = {
            "critical_ns": 0,
            "overlapped_ns": 0,
            "exposed_ns": 0,
            "passes": 0,
            "eligible": 0,  # critical passes the steady path was set up for
            "steady": 0,  # ... and that took it (the full build forced: none)
            "built": False,
            "events": 0,
            "critical": np.zeros(5, np.int64),
            "overlapped": np.zeros(5, np.int64),
            "critical_barriers": 0,  # block barriers (__syncthreads on a GPU) the phase passed
            "overlapped_barriers": 0,
        }
        if self.whole_step:  # before the split: the whole of sched_step sat between model steps
            t0 = time.perf_counter_ns()
            status = self.sched.step(self.ctx)
            s["critical_ns"] = s["exposed_ns"] = time.perf_counter_ns() - t0
            s["passes"], s["built"], s["idle"] = 1, status == STEP_RUN, status == STEP_IDLE
            if s["built"]:
                self.model_step()
        else:
            while True:
                steady = 0 if self._steady is None else int(self._steady[0])
                if self.force_full and steady:  # the same state, the full build's way
                    self._steady[0] = 0
                self.sched.reset_host_accesses()
                b0 = self.sched.block_barriers()
                t0 = time.perf_counter_ns()
                built = self.sched.critical(self.critical_ctx) == STEP_RUN
                t1 = time.perf_counter_ns()
                s["critical_barriers"] += self.sched.block_barriers() - b0
                s["eligible"] += steady > 0  # a steady pass leaves steady_rows; an end zeroes it
                s["steady"] += steady > 0 and not self.force_full and int(self._steady[0]) > 0
                s["critical"] += self._accesses()
                if built:
                    if self.layouts is not None:
                        self.layouts.append(self.snapshot_layout())
                    self.model_step()
                self.sched.reset_host_accesses()
                b2 = self.sched.block_barriers()
                t2 = time.perf_counter_ns()
                following = self.sched.overlapped(self.ctx, built)
                t3 = time.perf_counter_ns()
                s["overlapped_barriers"] += self.sched.block_barriers() - b2
                s["overlapped"] += self._accesses()
                s["critical_ns"] += t1 - t0
                s["overlapped_ns"] += t3 - t2
                s["exposed_ns"] += (t1 - t0) + (0 if built else t3 - t2)  # nothing to hide behind
                s["passes"] += 1
                if following == STEP_SHUTDOWN:
                    raise RuntimeError("the scheduler shut down")
                if built or following == STEP_IDLE or s["passes"] >= 64:  # 64: a livelock guard
                    s["built"], s["idle"] = built, following == STEP_IDLE
                    break
                # the host's CQ reader runs beside the scheduler: passes that build nothing can
                # emit more than the CQ holds (the SQ's aborted entries, pending_cap per pass)
                s["events"] += self.read_events()
        s["events"] += self.read_events()
        if self.submitting:
            self.abort_some()
            self.top_up()
        return s

    def _accesses(self) -> np.ndarray:
        got = self.sched.host_accesses()
        return np.array([got[k] for k in build.HOST_ACCESS_KINDS], np.int64)

    def model_step(self) -> None:
        h = self.a["step"][0]
        n = int(h["n_samples"])
        slots = self.a["sample_slot"][:n]
        handles = self.a["slots"]["handle"][slots].astype(np.int64)
        self.a["next_token"][slots] = token_for(handles, self.a["sample_counter"][:n].astype(np.int64))

    def snapshot_layout(self) -> dict:
        h = self.a["step"][0]
        out = {k: int(h[k]) for k in ("n_tokens", "bucket", "n_segments", "n_samples", "n_decode", "seq")}
        for name, n in (
            ("token_ids", out["bucket"]),
            ("positions", out["bucket"]),
            ("slot_of", out["bucket"]),
            ("seg_slot", out["n_segments"]),
            ("seg_row_start", out["n_segments"]),
            ("seg_n_rows", out["n_segments"]),
            *(
                (name, out["n_samples"])
                for name in (
                    "sample_row",
                    "sample_slot",
                    "sample_params",
                    "sample_counter",
                )
            ),
        ):
            out[name] = self.a[name][:n].copy()
        return out

    # ---- the host's side (not timed)
    def read_events(self) -> int:
        events = self.rings.completions.take()
        for e in events:
            self.on_event(
                int(e["handle"]), int(e["kind"]), int(e["token"]), int(e["index"]), int(e["finish_reason"])
            )
        return len(events)

    def on_event(self, handle, kind, token, index, reason) -> None:
        r = self.live.get(handle)
        if r is None:  # handles are never reused: after its DONE, or never submitted
            self.errors.append(f"event {kind} for handle {handle}, which is not live")
            return
        if kind == EV_TOKEN:
            if index != r.n_tokens or token != token_for(handle, index):
                self.errors.append(
                    f"handle {handle}: token {token} at {index}, expected "
                    f"{token_for(handle, r.n_tokens)} at {r.n_tokens}"
                )
            if r.n_tokens == 0:
                self.rings.arena.release(r.arena_off)
            r.n_tokens += 1
            return
        ok = {FINISH_LENGTH: r.n_tokens == r.max_tokens, FINISH_ABORT: r.aborted}.get(reason, False)
        if not ok or index != r.n_tokens:
            self.errors.append(
                f"handle {handle}: DONE {reason} after {r.n_tokens} tokens "
                f"(index {index}, max {r.max_tokens}, aborted {r.aborted})"
            )
        if r.n_tokens == 0:
            self.rings.arena.release(r.arena_off)
        del self.live[handle]
        self.live_by_kind[r.kind] -= 1
        self.finished += 1

    def _can_write_prompt(self, n: int) -> bool:
        if hasattr(self.rings, "can_write_prompt"):  # --before runs this file on older trees too
            return self.rings.can_write_prompt(n)
        return self.rings.arena.can_allocate(n)

    def _write_prompt(self, tokens: np.ndarray) -> int:
        if hasattr(self.rings, "write_prompt"):  # the prompt and its prefix-cache keys
            return self.rings.write_prompt(tokens)
        return self.rings.arena.allocate(tokens)

    def top_up(self) -> None:
        sq = self.rings.submissions
        for k, kind in enumerate(self.kinds):
            while kind.target is None or self.live_by_kind[k] < kind.target:
                n = int(self.rng.integers(kind.prompt_len[0], kind.prompt_len[1] + 1))
                if sq.free_entries() < 1 or not self._can_write_prompt(n):
                    break
                start = self.next_handle % (len(self.pool) - n)
                off = self._write_prompt(self.pool[start : start + n])
                max_tokens = int(self.rng.integers(kind.max_tokens[0], kind.max_tokens[1] + 1))
                pos = push_generate(sq, self.next_handle, off, n, max_tokens)
                self.live[self.next_handle] = Request(k, off, pos, max_tokens)
                self.live_by_kind[k] += 1
                self.next_handle += 1
                self.submitted += 1

    def abort_some(self, share: float | None = None) -> None:
        share = self.abort_share if share is None else share
        if share <= 0:
            return
        alive = [h for h, r in self.live.items() if not r.aborted]
        n = len(alive) if share >= 1 else max(1, int(len(alive) * share)) if alive else 0
        for i in sorted(self.rng.choice(len(alive), size=n, replace=False)) if n else ():
            r = self.live[alive[i]]
            if not self.rings.aborts.push(alive[i], r.sq_pos):
                break  # the abort ring is full: the rest wait for a later step
            r.aborted = True

    # ---- whole runs
    def warm_up(self, steps: int) -> None:
        for _ in range(steps):
            self.step()
        if self.scenario == "decode-only":  # measure decoding only: every prefill done
            for _ in range(1000):
                if (self.a["slots"]["state"] == SLOT_DECODE).all():
                    break
                self.step()
            else:
                raise RuntimeError("decode-only: slots never all decoding")

    def finish(self, max_steps: int = 10_000) -> None:
        """Stops submitting, aborts everything live, and steps until every request has its DONE
        and the scheduler reports idle (its counters are mirrored then)."""
        self.submitting = False
        for _ in range(max_steps):
            self.abort_some(1.0)
            idle = self.step()["idle"]
            if idle and not self.live and self.rings.completions.pending() == 0:
                return
        raise RuntimeError(f"{len(self.live)} requests never ended")

    def check(self) -> None:
        if self.errors:
            raise AssertionError(f"{len(self.errors)} wrong events, first: {self.errors[:3]}")


# ---------------------------------------------------------------- measuring


def _stats(ns: np.ndarray) -> dict:
    us = ns / 1000.0
    return {
        "us_per_step": float(np.percentile(us, 50)),
        "us_p99": float(np.percentile(us, 99)),
        "us_mean": float(us.mean()),
    }


def measure(scenario: str, n_slots: int, *, steps: int, warmup: int, whole_step: bool, seed: int = 0) -> dict:
    h = Harness(scenario, n_slots, seed=seed, whole_step=whole_step)
    h.warm_up(warmup)
    gc.collect()
    gc.disable()  # a collection inside a timed call would be the GC's time, not the scheduler's
    try:
        samples = [h.step() for _ in range(steps)]
    finally:
        gc.enable()
    h.check()
    out = {
        "name": scenario,
        "n_slots": n_slots,
        "token_budget": h.cfg.token_budget,
        "steps": steps,
        "built_steps": sum(s["built"] for s in samples),
        "passes_per_step": float(np.mean([s["passes"] for s in samples])),
        "events_per_step": float(np.mean([s["events"] for s in samples])),
        "requests_finished": h.finished,
        "phases": {},
    }
    for phase in ("critical", "overlapped"):
        if whole_step and phase == "overlapped":
            out["phases"][phase] = None
            continue
        st = _stats(np.array([s[phase + "_ns"] for s in samples], np.float64))
        if whole_step:  # the old build did not count host accesses
            st["host_accesses_per_step"] = st["host_accesses_by_kind"] = None
        else:
            mean = np.mean([s[phase] for s in samples], axis=0)
            st["host_accesses_by_kind"] = {k: float(v) for k, v in zip(build.HOST_ACCESS_KINDS, mean)}
            st["host_accesses_per_step"] = float(mean.sum())
        out["phases"][phase] = st
    out["exposed"] = _stats(np.array([s["exposed_ns"] for s in samples], np.float64))
    return out


def machine() -> dict:
    cpu, flags = cpu_identity()

    def git(*args):
        r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)
        return r.stdout.strip() if r.returncode == 0 else None

    cxx = shutil.which(os.environ.get("CXX") or "g++")
    lib, calls = scheduler()._lib, []
    for _ in range(5000):  # a call that does nothing, timed as the phases are: the floor under them
        t0 = time.perf_counter_ns()
        lib.rl_layout_fingerprint()
        calls.append(time.perf_counter_ns() - t0)
    return {
        "cpu_model": cpu,
        "cpu_flags": flags,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "compiler": subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, check=False
        ).stdout.splitlines()[0]
        if cxx
        else None,
        "git_rev": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "source_root": str(Path(sys.modules[build.__name__].__file__).resolve().parents[2]),
        "ctypes_call_us": float(np.median(calls)) / 1000.0,
    }


def run_all(args, whole_step: bool) -> dict:
    if not whole_step and not hasattr(build.CpuScheduler, "critical"):
        raise SystemExit("this tree's scheduler has no phases: run with --whole-step")
    doc = {
        "mode": "whole-step" if whole_step else "split",
        "steps": args.steps,
        "warmup": args.warmup,
        "machine": machine(),
        "scenarios": [],
    }
    for name in args.scenarios:
        for n in args.sizes:
            doc["scenarios"].append(
                measure(name, n, steps=args.steps, warmup=args.warmup, whole_step=whole_step, seed=args.seed)
            )
            if not args.quiet:
                print(f"  measured {name} n_slots={n}", file=sys.stderr, flush=True)
    return doc


def _csv(kind):
    return lambda text: [kind(v) for v in text.split(",") if v]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="measured steps per scenario and size")
    p.add_argument("--warmup", type=int, default=200, help="steps run before measuring")
    p.add_argument("--scenarios", type=_csv(str), default=list(SCENARIOS))
    p.add_argument("--sizes", type=_csv(int), default=list(SIZES), help="n_slots values")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--before", metavar="REV", help="also measure the scheduler of git revision REV")
    p.add_argument("--whole-step", action="store_true", help="time CpuScheduler.step (pre-split API)")
    p.add_argument(
        "--null-host-check",
        action="store_true",
        help="critical on a context without host-shared pointers must build the same layouts",
    )
    p.add_argument("--steady", action="store_true", help="critical: the steady path against the full build")
    p.add_argument("--plan-ahead", action="store_true", help="--steady: also both with plans published ahead")
    p.add_argument("--neighbour", type=_csv(str), default=["quiet", "busy"], help="--steady: quiet,busy")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr, no table on stdout")
    args = p.parse_args(argv)
    for name in args.scenarios:
        workload(name, 1, 256)  # unknown names fail before anything runs
    if args.null_host_check or args.steady:  # this tree's own checks: in the report's module
        from ringleader.bench.lab.sched_micro_report import null_host_check, steady_main

        micro = sys.modules[__name__]  # handed over, so the report never imports this module
        return steady_main(args, micro) if args.steady else null_host_check(args, micro)
    if args.before or not args.quiet:  # not in a --before child, which may run in an older tree
        from ringleader.bench.lab.sched_micro_report import run_before, table
    before = run_before(Path(__file__).resolve(), args.before, args) if args.before else None
    doc = run_all(args, args.whole_step)
    if before:
        doc["before"] = before
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    if not args.quiet:
        print(table(doc, before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
