"""Drives the real CPU-built sched_step over real rings, with a deterministic stand-in for the
model's sampler (the token is a function of handle and index), so scheduler properties can be
checked over many steps without running a model."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ringleader.device.backends.host_memory import HostMemory
from ringleader.device.sched.build import cpu_scheduler as scheduler
from ringleader.ipc import layout
from ringleader.ipc.rings import HostRings, RingConfig
from ringleader.ipc.sampling_params import SamplingParams


def token_for(handle: int, index: int, vocab: int = 1000) -> int:
    return (handle * 7919 + index * 104729) % vocab


@dataclass
class Record:
    handle: int
    prompt: np.ndarray
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    done: list[int] = field(default_factory=list)  # finish reasons (must end with exactly one)
    arena_offset: int = 0
    logprobs: list = field(default_factory=list)  # each TOKEN event's cq_logprobs record, as read
    # its PROMPT events (prompt logprobs): (prompt position, token, the record's logprob), and
    # how many TOKEN events had come before each
    scores: list = field(default_factory=list)
    scores_after_tokens: list = field(default_factory=list)


def score_for(position: int, token: int) -> float:
    """The stand-in's prompt logprob of `token` at prompt `position` (what a record must carry)."""
    return -float(position * 1000 + token % 1000)


class Driver:
    def __init__(self, cfg: RingConfig, start_index: int = 0, token_fn=token_for):
        """start_index: where the free-running u32 ring indices begin (to test the wrap);
        token_fn(handle, index): the stand-in sampler (a function of the token's index in its
        request, as the real sampler's seeded draw is)."""
        self.cfg = cfg
        self.token_fn = token_fn
        self.mem = HostMemory(cfg)
        self.a = self.mem.arrays
        if start_index:
            ctl = self.a["ctl"][0]
            for name in ("sq_tail", "sq_head", "cq_tail", "cq_head", "aq_tail", "aq_head"):
                ctl[name] = start_index
            self.mem.rings = HostRings(self.a, cfg)
        self.rings = self.mem.rings
        self.records: dict[int, Record] = {}
        self.sq_pos: dict[int, int] = {}  # handle -> the SQ position of its GENERATE
        self.steps: list[dict] = []
        self._next = 1
        assert scheduler().init(self.mem.context_address) == layout.InitError.NONE

    def submit(
        self, prompt, max_tokens: int, *, priority: int = 0, stop_ids=(), flags: int = 0, **sampling
    ) -> int | None:
        """sampling: SamplingParams fields (temperature, top_k, seed, ...); flags: layout.SqFlag."""
        prompt = np.asarray(prompt, dtype=np.int32)
        if self.rings.submissions.free_entries() < 1 or not self.rings.can_write_prompt(len(prompt)):
            return None
        off = self.rings.write_prompt(prompt)
        handle = self._next
        self._next += 1
        params = SamplingParams(
            max_tokens,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=bool(flags & layout.SqFlag.IGNORE_EOS),
            **{"seed": 0, **sampling},
        )
        self.sq_pos[handle] = self.rings.submissions.push(
            handle, params, prompt_off=off, prompt_len=len(prompt), priority=priority
        )
        self.records[handle] = Record(handle, prompt, max_tokens, arena_offset=off)
        return handle

    def abort(self, handle: int, *, if_queued: bool = False) -> bool:
        """Queues an abort for the next step; False only when the abort ring is full."""
        return self.rings.aborts.push(handle, self.sq_pos[handle], if_queued=if_queued)

    def step(self, *, drain: bool = True) -> int:
        self.rings.submissions.publish()
        self.rings.aborts.publish()
        status = scheduler().step(self.mem.context_address)
        if status == layout.StepStatus.RUN:
            h = self.a["step"][0]
            n, ns, nseg = int(h["n_tokens"]), int(h["n_samples"]), int(h["n_segments"])
            self.steps.append(
                {
                    "n_tokens": n,
                    "n_decode": int(h["n_decode"]),
                    "n_samples": ns,
                    "seg": [
                        (
                            int(self.a["seg_slot"][g]),
                            int(self.a["seg_row_start"][g]),
                            int(self.a["seg_n_rows"][g]),
                        )
                        for g in range(nseg)
                    ],
                    "tokens": self.a["token_ids"][:n].copy(),
                    "positions": self.a["positions"][:n].copy(),
                    "slot_of": self.a["slot_of"][:n].copy(),
                    "sample_slot": self.a["sample_slot"][:ns].copy(),
                    "sample_row": self.a["sample_row"][:ns].copy(),
                    "counter": self.a["sample_counter"][:ns].copy(),
                }
            )
            slots = self.a["slots"]
            for q in range(ns):
                s = int(self.a["sample_slot"][q])  # its place: the slot's, or a draft row's
                slot = self.slot_of_place(s)
                token = self.token_fn(int(slots[slot]["handle"]), int(self.a["sample_counter"][q]))
                self.a["next_token"][s] = token
                # the stand-in's logprobs record: a function of the token and its index
                record = self.a["step_logprobs"][s]
                record["logprob"], record["n_top"] = -float(token), int(self.a["sample_counter"][q])
                record["top_ids"][:] = token
            for i in range(int(h["n_score"])):  # prompt logprobs: a function of position and token
                row, token = int(self.a["score_row"][i]), int(self.a["score_token"][i])
                record = self.a["step_prompt_logprobs"][i]
                record["logprob"] = score_for(int(self.a["positions"][row]) + 1, token)
                record["n_top"] = int(self.a["score_top"][i])
        if drain:
            self.drain_cq()
        return status

    def slot_of_place(self, place: int) -> int:
        """The slot whose sample goes to next_token[place] (sched_spec.h: rl_sample_out)."""
        n = self.cfg.n_slots
        return place if place < n else (place - n) // self.cfg.spec_tokens

    def drain_cq(self) -> int:
        events, records = self.rings.completions.take_with_logprobs(lambda events: True)
        for e, lp in zip(events, records if records is not None else [None] * len(events)):
            if e["kind"] == layout.EventKind.PROMPT and int(e["handle"]) == 0:
                continue  # an aborted request's: the host drops it
            rec = self.records[int(e["handle"])]
            assert not rec.done, f"event after DONE for handle {rec.handle}"
            if e["kind"] == layout.EventKind.PROMPT:
                rec.scores.append((int(e["index"]), int(e["token"]), float(lp["logprob"])))
                rec.scores_after_tokens.append(len(rec.tokens))
            elif e["kind"] == layout.EventKind.TOKEN:
                if not rec.tokens:
                    self.rings.arena.release(rec.arena_offset)
                rec.tokens.append(int(e["token"]))
                rec.indices.append(int(e["index"]))
                rec.logprobs.append(lp.copy())
            else:
                rec.done.append(int(e["finish_reason"]))
                if not rec.tokens:
                    self.rings.arena.release(rec.arena_offset)
        return len(events)

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if self.step() == layout.StepStatus.IDLE and self.rings.completions.pending() == 0:
                return
        raise AssertionError("scheduler never went idle")
