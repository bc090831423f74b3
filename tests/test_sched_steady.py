"""The critical phase's steady state (sched_critical.h rl_critical_steady) is only a faster way to
the same step: two Drivers of the real CPU-built scheduler get identical random traffic; before
every step one of them has its sched.steady_rows zeroed, which forces the full build, while the
other takes the steady path wherever the overlapped phase allowed it.  Every step's layout, every
event (logprobs records included), the slots' progress and the penalized requests' token counts
must come out identical, and the steady path must have been taken on a good share of the steps.
With plan_ahead the published plan is checked too: the step handed over after it is exactly in
that bucket, its rows within it (a void step of pad rows only when every planned row ended)."""

from __future__ import annotations

import numpy as np
import pytest

from ringleader.ipc import layout
from ringleader.ipc.rings import RingConfig
from tests.sched_driver import Driver, scheduler, token_for
from tests.test_pingpong_loop import published_plan

VOCAB = 1000
SIZES = dict(
    n_slots=6,
    max_ctx=96,
    token_budget=32,
    sq_size=32,
    cq_size=256,
    arena_size=4096,
    pending_cap=16,
    buckets=(1, 2, 4, 8, 16, 32),
    page_size=8,
    n_pages=40,  # 12 pages hold one request of max_ctx: long ones run short and get preempted
    vocab_size=VOCAB,  # penalized requests keep token counts
)
STEPS = 400
HEADER = ("n_tokens", "bucket", "n_segments", "n_samples", "n_decode", "seq")
# the slot fields that are pure functions of the traffic (queued_us is a time)
SLOT_FIELDS = (
    "state",
    "handle",
    "n_prefilled",
    "n_generated",
    "max_tokens",
    "flags",
    "last_token",
    "sampled",
    "ev_token",
    "finish",
    "fill_len",
    "n_pages",
    "n_keyed",
    "n_cached",
    "kv_done",
)
EVENT_FIELDS = ("handle", "kind", "finish_reason", "token", "index")


class LoggedDriver(Driver):
    """A Driver that also logs every event it drains (the fields that are no timestamps, and
    the cq_logprobs record read beside it)."""

    def __init__(self, cfg: RingConfig, forced_full: bool, quoting: bool = False):
        """quoting: odd handles' stand-in quotes the prompt (speculative decoding's drafts hit)."""
        super().__init__(cfg, token_fn=self._quote if quoting else token_for)
        self.forced_full = forced_full
        self.log: list[tuple] = []
        take = self.rings.completions.take_with_logprobs

        def logged(wanted):
            events, records = take(wanted)
            for i, e in enumerate(events):
                lp = records[i].tobytes() if records is not None else b""
                self.log.append((*(int(e[f]) for f in EVENT_FIELDS), lp))
            return events, records

        self.rings.completions.take_with_logprobs = logged  # the host's CQ reader, not the scheduler

    def _quote(self, handle: int, index: int) -> int:
        prompt = self.records[handle].prompt
        return int(prompt[(index + 1) % len(prompt)]) if handle % 2 else token_for(handle, index)

    def snapshot(self) -> dict:
        a = self.a
        h = a["step"][0]
        out = {k: int(h[k]) for k in HEADER}
        bucket, nseg, ns = out["bucket"], out["n_segments"], out["n_samples"]
        for name, n in (
            ("token_ids", bucket),
            ("positions", bucket),
            ("slot_of", bucket),
            ("seg_slot", nseg),
            ("seg_row_start", nseg),
            ("seg_n_rows", nseg),
            ("sample_row", ns),
            ("sample_slot", ns),
            ("sample_counter", ns),
        ):
            out[name] = a[name][:n].tolist()
        out["sample_params"] = a["sample_params"][:ns].tobytes()
        trace = a["trace"].reshape(-1, layout.TRACE_FIELDS)[out["seq"] % self.cfg.trace_len]
        out["trace_flags"] = int(trace[layout.TraceField.FLAGS])
        out["trace_seq"] = int(trace[layout.TraceField.SEQ])
        return out

    def sample(self) -> None:
        """The stand-in model step, as Driver.step's: a token per sample entry, and its logprobs
        record (a function of the token and its index)."""
        a = self.a
        for q in range(int(a["step"][0]["n_samples"])):
            s = int(a["sample_slot"][q])  # its place: its slot's, or a draft row's
            handle = int(a["slots"][self.slot_of_place(s)]["handle"])
            token = self.token_fn(handle, int(a["sample_counter"][q]))
            a["next_token"][s] = token
            record = a["step_logprobs"][s]
            record["logprob"], record["n_top"] = -float(token), int(a["sample_counter"][q])
            record["top_ids"][:] = token

    def one_step(self, phases: bool) -> dict:
        """One scheduler step (phases: critical, the stand-in, overlapped, each once; else the
        serial sched_step through Driver.step), with what was true before it."""
        st = self.a["sched"][0]
        if self.forced_full:
            st["steady_rows"] = 0
        before = {"steady": int(st["steady_rows"]), "plan": int(st["plan_bucket"])}
        # the plan as the compute side reads it: (the seq + 1 it is for, its bucket)
        before["published"] = published_plan(self, int(st["step"]))  # st.step: the next seq
        rows = self.a["seg_slot"][: before["steady"]]  # the steady path's rows, if it is taken
        before["flags"] = int(np.bitwise_or.reduce(self.a["slots"]["flags"][rows], initial=0))
        mark = len(self.log)
        laid_out = None
        if phases:
            self.rings.submissions.publish()
            self.rings.aborts.publish()
            ctx = self.mem.context_address
            status = scheduler().critical(ctx)
            if status == layout.StepStatus.RUN:
                laid_out = self.snapshot()
                self.sample()
            following = scheduler().overlapped(ctx, status == layout.StepStatus.RUN)
            assert following != layout.StepStatus.SHUTDOWN
            self.drain_cq()
        else:
            status = self.step()
            if status == layout.StepStatus.RUN:
                laid_out = self.snapshot()  # the stand-in wrote next_token only
        slots = self.a["slots"]
        return {
            "status": int(status),
            "layout": laid_out,
            "events": self.log[mark:],
            "slots": [slots[f].tolist() for f in SLOT_FIELDS],
            "counts": self.a["token_counts"].tobytes(),
            **before,
        }


class Traffic:
    """Random requests (prompt and output lengths, stop ids that hit, logprobs, penalties) and
    aborts, each decision drawn once and applied to both drivers alike."""

    def __init__(self, seed: int, drivers: list[LoggedDriver]):
        self.rng = np.random.default_rng(seed)
        self.drivers = drivers
        self.common = self.rng.integers(0, VOCAB, 24)  # a shared prefix: prefix-cache hits

    def submit_some(self, rate: float) -> None:
        rng, ref = self.rng, self.drivers[0]
        if rng.random() >= rate:
            return
        for _ in range(int(rng.integers(1, 3))):
            n = int(rng.integers(1, 60))
            prompt = rng.integers(0, VOCAB, n)
            if rng.random() < 0.3:
                prompt[: min(n, 24)] = self.common[: min(n, 24)]
            max_tokens = int(rng.integers(1, 50))
            kw: dict = {}
            if rng.random() < 0.45:  # ends by STOP at a known index (a void step when alone)
                kw["stop_ids"] = (token_for(ref._next, int(rng.integers(0, max_tokens))),)
            if rng.random() < 0.3:
                kw["logprobs"] = int(rng.integers(0, 4))
            r = rng.random()
            if r < 0.2:
                kw["repetition_penalty"] = 1.3
            elif r < 0.3:
                kw["presence_penalty"] = 0.5
            got = [d.submit(prompt, max_tokens, **kw) for d in self.drivers]
            assert got[0] == got[1]

    def lone_stopper(self, rate: float) -> None:
        """When nothing is live: a short request alone that ends by STOP (its last planned row
        ends, so the plan gets a void step)."""
        rng, ref = self.rng, self.drivers[0]
        if any(not r.done for r in ref.records.values()) or rng.random() >= rate:
            return
        stop = token_for(ref._next, int(rng.integers(0, 3)))
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 12)))
        got = [d.submit(prompt, 10, stop_ids=(stop,)) for d in self.drivers]
        assert got[0] == got[1]

    def abort_some(self, rate: float) -> None:
        rng, ref = self.rng, self.drivers[0]
        if rng.random() >= rate:
            return
        live = sorted(h for h, r in ref.records.items() if not r.done)
        if live:
            handle = live[int(rng.integers(0, len(live)))]
            assert [d.abort(handle) for d in self.drivers] == [True, True]


def run_pair(seed: int, *, plan_ahead: bool, phases: bool, spec_tokens: int = 0) -> dict:
    # one object: one prefix-cache secret
    cfg = RingConfig(**SIZES, plan_ahead=plan_ahead, spec_tokens=spec_tokens)
    quoting = spec_tokens > 0
    steady, full = LoggedDriver(cfg, False, quoting), LoggedDriver(cfg, True, quoting)
    traffic = Traffic(seed, [steady, full])
    stats = {"built": 0, "steady_tried": 0, "steady_taken": 0, "void": 0, "planned": 0}
    stats |= {"steady_logprobs": 0, "steady_penalized": 0}
    for i in range(STEPS + 2000):
        if i < STEPS:  # bursts, then quiet, with lone requests that stop (void steps)
            if i % 100 < 30:
                traffic.submit_some(0.5)
            else:
                traffic.lone_stopper(0.5)
            traffic.abort_some(0.04)
        x, y = steady.one_step(phases), full.one_step(phases)
        where = f"seed {seed}, step {i} (plan_ahead={plan_ahead}, phases={phases})"
        assert x["status"] == y["status"], where
        assert x["layout"] == y["layout"], f"{where}: {_first_diff(x['layout'], y['layout'])}"
        assert x["events"] == y["events"], where
        assert x["slots"] == y["slots"], where
        assert x["counts"] == y["counts"], where
        assert y["steady"] == 0
        if x["layout"] is not None:
            laid_out = x["layout"]
            stats["built"] += 1
            assert laid_out["n_tokens"] <= laid_out["bucket"] and laid_out["trace_seq"] == laid_out["seq"] + 1
            if x["steady"]:
                stats["steady_tried"] += 1
                # a fallback happens only when some request ended by its sample: its DONE
                # (STOP or LENGTH) goes out in this very step
                ended = any(
                    e[1] == layout.EventKind.DONE and e[2] != layout.Finish.ABORT for e in x["events"]
                )
                stats["steady_taken"] += not ended
                if not ended:
                    assert laid_out["n_tokens"] == laid_out["n_decode"] == x["steady"], where
                    stats["steady_logprobs"] += bool(x["flags"] & layout.SqFlag.LOGPROBS)
                    stats["steady_penalized"] += bool(x["flags"] & layout.SqFlag.PENALIZED)
            void = bool(laid_out["trace_flags"] & layout.TraceFlag.VOID)
            assert void == (plan_ahead and laid_out["n_tokens"] == 0), where
            if plan_ahead:
                assert x["plan"] == y["plan"]
                if phases:  # the plan read just before the critical phase that handed it over
                    assert x["plan"] != 0, f"{where}: a step built without a plan"
                    assert laid_out["bucket"] == x["plan"], where
                    assert x["published"] == (laid_out["seq"] + 1, x["plan"]), where
                stats["planned"] += 1
            if void:
                stats["void"] += 1
                assert laid_out["n_samples"] == laid_out["n_segments"] == 0
                assert laid_out["slot_of"] == [-1] * laid_out["bucket"]
            else:
                assert laid_out["n_tokens"] > 0
        if (
            i >= STEPS
            and x["status"] == layout.StepStatus.IDLE
            and not any(not r.done for r in steady.records.values())
        ):
            break
    else:
        raise AssertionError(f"seed {seed}: requests never all ended")
    for d in (steady, full):
        for handle, rec in d.records.items():
            assert len(rec.done) == 1, f"seed {seed}: handle {handle} got {rec.done}"
            assert rec.tokens == [d.token_fn(handle, k) for k in range(len(rec.tokens))]
            assert rec.indices == list(range(len(rec.tokens)))
            if rec.done[0] == layout.Finish.LENGTH:
                assert (
                    len(rec.tokens) == rec.max_tokens or len(rec.prompt) + len(rec.tokens) >= SIZES["max_ctx"]
                )
    assert [r.tokens for r in steady.records.values()] == [r.tokens for r in full.records.values()]
    stats["requests"] = len(steady.records)
    stats["preemptions"] = int(steady.a["sched"][0]["preemptions"])
    stats["finish"] = sorted({r.done[0] for r in steady.records.values()})
    stats["spec_accepted"] = int(steady.a["sched"][0]["spec_accepted"])
    return stats


def _first_diff(x: dict | None, y: dict | None) -> str:
    if x is None or y is None:
        return f"built {x is not None} vs {y is not None}"
    return next((f"{k}: {x[k]} vs {y[k]}" for k in x if x[k] != y[k]), "")


def _check_coverage(stats: dict) -> None:
    print(f"steady path: {stats}")
    assert stats["steady_taken"] > 0 and stats["steady_tried"] >= stats["steady_taken"]
    assert stats["steady_taken"] * 5 >= stats["built"], stats  # a good share of the steps
    assert stats["steady_logprobs"] > 0 and stats["steady_penalized"] > 0, stats
    assert stats["requests"] > 50 and stats["preemptions"] > 0, stats
    assert set(stats["finish"]) == {layout.Finish.STOP, layout.Finish.LENGTH, layout.Finish.ABORT}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("phases", [False, True], ids=["sched_step", "phases"])
def test_the_steady_path_lays_out_what_the_full_build_does(seed, phases):
    _check_coverage(run_pair(seed, plan_ahead=False, phases=phases))


@pytest.mark.parametrize("seed", [6, 7])
@pytest.mark.parametrize("plan_ahead", [False, True], ids=["built", "planned"])
def test_with_drafts_the_steady_path_and_the_plans_still_hold(seed, plan_ahead):
    """Speculative decoding under the same traffic (half the requests quote their prompt, so
    drafts are verified and accepted): the steady path, taken only while no slot may draft, and
    the planned buckets, which count every draft's rows, lay out what the full build does."""
    stats = run_pair(seed, plan_ahead=plan_ahead, phases=True, spec_tokens=3)
    assert stats["spec_accepted"] > 100 and stats["steady_taken"] > 0, stats
    assert stats["requests"] > 50 and stats["preemptions"] > 0, stats


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_with_plans_ahead_every_step_is_in_its_planned_bucket(seed):
    stats = run_pair(seed, plan_ahead=True, phases=True)
    _check_coverage(stats)
    assert stats["planned"] == stats["built"] and stats["void"] > 0, stats


def test_plans_ahead_through_the_serial_step_match_too():
    stats = run_pair(6, plan_ahead=True, phases=False)
    _check_coverage(stats)


def test_a_lone_request_that_stops_gets_a_void_step_in_its_planned_bucket():
    # one decoding request whose third sample is its stop id: the plan for the step after it
    # names its row, the critical phase finds it ended and hands over pad rows only
    cfg = RingConfig(**SIZES, plan_ahead=True)
    d = LoggedDriver(cfg, False)
    handle = d.submit(np.arange(1, 6), 20, stop_ids=(token_for(1, 2),))
    steps = [d.one_step(phases=True) for _ in range(8)]
    built = [s for s in steps if s["layout"] is not None]
    void = [s for s in built if s["layout"]["n_tokens"] == 0]
    assert len(void) == 1 and void[0]["layout"]["bucket"] == void[0]["plan"] == 1
    v = void[0]["layout"]
    assert v["n_samples"] == 0 and v["slot_of"] == [-1] and v["trace_flags"] & layout.TraceFlag.VOID
    rec = d.records[handle]
    assert rec.done == [layout.Finish.STOP] and rec.tokens == [token_for(handle, k) for k in range(3)]
    # no further plan: the scheduler went idle after the void step
    assert int(d.a["sched"][0]["plan_bucket"]) == 0 and steps[-1]["status"] == layout.StepStatus.IDLE
