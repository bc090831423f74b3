"""The shared-memory contract between hostctl and the device scheduler, defined once.

Every struct below is declared here and only here: `numpy_dtype()` gives the host view and
`c_header()` gives the text both C++ compilers (host g++ and NVRTC) include.  The header carries
static_asserts on every size and offset (offsets where the compiler can take them: the host build
always, NVRTC from 13.4), and a fingerprint of the layout that the scheduler library reports back,
so a stale build can never read the rings with the wrong offsets.  Two field lists come from
their own declarations: RlSampling's (ipc/sampling_params.py) and the control block's counters
(ipc/counters.py, which also gives the device's copy of them, RL_MIRROR_COUNTERS).

Ownership (one writer per index; payload first, index last; release/acquire at system scope):
  Control.sq_tail        host writes (release) after the SQ entry and its prompt tokens; device reads (acquire)
  Control.sq_head        device writes (release) after copying entries out of the SQ; host reads (acquire)
  Control.cq_tail        device writes (release) after the CQ events; host reads (acquire)
  Control.cq_head        host writes (release) after reading CQ events; device reads (acquire) only
                         when the last value it read leaves too little CQ room
  cq_logprobs[pos]       device writes (plain) with the TOKEN event at pos, of a request with
                         RL_FLAG_LOGPROBS only, or the PROMPT event at pos (RL_FLAG_PROMPT_LOGPROBS),
                         before the release of cq_tail past pos; host reads before its release of
                         cq_head past pos (the CQ's own order)
  Control.aq_tail        host writes (release) after the abort entries; device reads (acquire)
  Control.aq_head        device writes (release) after reading abort entries; host reads (acquire)
  Control.shutdown       host writes; device reads (the leader thread, once per step in the
                         overlapped phase, then broadcast to the block through shared memory so no
                         two threads disagree; and rarely while waiting for a step to end)
  Control.stop_grace_ns,
  Control.run_budget_ns  host writes before the scheduler starts; device reads once at sched_init
  Control.exit_reason    device writes once, before state = EXITED (release); host reads after
  Control counters,
  heartbeat, error_code  device writes (plain stores mirroring RlSchedState, see rl_mirror_counters
                         and ipc/counters.py); host reads (monitoring only, no ordering attached)
Every device access to these arrays is in the scheduler's overlapped phase (or init and exit):
the critical phase, which the GPU waits for between two steps, touches device memory only.
The SQ carries only GENERATE entries.  Aborts travel in their own ring (aq), which the device
reads every step before it drains the SQ, so no queued GENERATE can hold an abort back: an abort
names its request's handle and the SQ position of its GENERATE; one whose GENERATE is still in
the SQ is parked in the device-private sq_cancel (per SQ position) and applied when that entry is
drained, one whose request already finished is ignored; one flagged IF_QUEUED (the queue limit)
leaves a request that holds a slot running.  The host may publish an abort before or after the
GENERATE it names.
The KV pages are the scheduler's alone (device memory, no host access): it pops pages off
free_pages and writes them into a slot's block_table at admission (the whole prompt, less the
pages the prefix cache already holds) and as decode reaches a new page, and drops its references
when the slot ends, is aborted or is preempted (once no step in flight can read them); the model
step only reads block_table.
The prompt arena has no shared index: the host allocates and reclaims it (a request's tokens are
free once its first TOKEN or its DONE event has been read: the device reads a prompt once, when
it admits the request into a slot, copying it into device memory, before either event).  With
prefix caching on, the prompt is followed in the arena by the prefix-cache key of each of its
full pages (ipc/prefix_keys.py: two int32 words per key, low first), written with the prompt: a
property of the request the host computes once; the device matches, counts and evicts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ringleader.ipc import automaton
from ringleader.ipc.counters import COUNTERS, c_mirror_macro
from ringleader.ipc.layout_enums import (  # noqa: F401  (re-exported: both sides read them as layout.X)
    C_ENUMS,
    ERROR_NAMES,
    EXIT_REASON_NAMES,
    STATE_NAMES,
    TRACE_FIELDS,
    AbortFlag,
    EventKind,
    ExitReason,
    Finish,
    InitError,
    Op,
    Policy,
    SchedulerState,
    SlotState,
    SqFlag,
    StepStatus,
    TraceField,
    TraceFlag,
    Turn,
    c_defines,
    init_error_name,
)
from ringleader.ipc.sampling_params import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, RING_FIELDS

MAGIC = 0x52474E52  # "RNGR" little-endian
LAYOUT_VERSION = 13

MAX_STOP_IDS = MAX_STOP_TOKEN_IDS  # stop_token_ids carried in one SQ entry
# token_counts: a prompt token's entry holds this bit; the rest of the word counts the output's
PROMPT_MARK = 1 << 24
MAX_EOS_IDS = 4
MAX_BUCKETS = 16
MAX_SPEC_TOKENS = 8  # draft tokens one slot verifies per step, at most
MAX_SPEC_NGRAM = 8  # the longest n-gram a prompt-lookup match tries

_SCALARS = {
    "u8": ("uint8_t", np.uint8),
    "u16": ("uint16_t", np.uint16),
    "u32": ("uint32_t", np.uint32),
    "i32": ("int32_t", np.int32),
    "u64": ("uint64_t", np.uint64),
    "i64": ("int64_t", np.int64),
    "f32": ("float", np.float32),
}


@dataclass(frozen=True)
class Field:
    name: str
    kind: str | Struct  # a key of _SCALARS, or a nested struct
    count: int = 1  # > 1 makes a fixed array

    @property
    def item_size(self) -> int:
        return self.kind.size if isinstance(self.kind, Struct) else np.dtype(_SCALARS[self.kind][1]).itemsize

    @property
    def item_align(self) -> int:
        return self.kind.align if isinstance(self.kind, Struct) else self.item_size

    def numpy_base(self) -> np.dtype:
        return self.kind.numpy_dtype() if isinstance(self.kind, Struct) else np.dtype(_SCALARS[self.kind][1])

    @property
    def c_type(self) -> str:
        return self.kind.name if isinstance(self.kind, Struct) else _SCALARS[self.kind][0]


@dataclass(frozen=True)
class Struct:
    """A C struct with natural alignment, padded to `align` bytes."""

    name: str
    fields: tuple[Field, ...]
    align: int = 8

    def offsets(self) -> list[tuple[Field, int]]:
        out, off = [], 0
        for f in self.fields:
            align = f.item_align
            off = (off + align - 1) // align * align
            out.append((f, off))
            off += f.item_size * f.count
        return out

    @property
    def size(self) -> int:
        f, off = self.offsets()[-1]
        end = off + f.item_size * f.count
        return (end + self.align - 1) // self.align * self.align

    def numpy_dtype(self) -> np.dtype:
        names, formats, offs = [], [], []
        for f, off in self.offsets():
            base = f.numpy_base()
            names.append(f.name)
            formats.append((base, (f.count,)) if f.count > 1 else base)
            offs.append(off)
        return np.dtype({"names": names, "formats": formats, "offsets": offs, "itemsize": self.size})

    def c_text(self) -> str:
        lines = [f"struct alignas({self.align}) {self.name} {{"]
        for f, _ in self.offsets():
            arr = f"[{f.count}]" if f.count > 1 else ""
            lines.append(f"  {f.c_type} {f.name}{arr};")
        lines.append("};")
        lines.append(f'static_assert(sizeof({self.name}) == {self.size}, "{self.name} size");')
        for f, off in self.offsets():
            lines.append(f"RL_ASSERT_OFFSET({self.name}, {f.name}, {off});")
        return "\n".join(lines)


def _f(name: str, kind: str | Struct, count: int = 1) -> Field:
    return Field(name, kind, count)


# One request's sampling settings as the sampler reads them: the fields of
# ringleader.ipc.sampling_params.SamplingParams that have a ring scalar, in declaration order.  The
# SQ entry and the slot hold one each and the step's sample_params array one per sample entry, so
# the scheduler copies the struct whole and never names a field.
SAMPLING = Struct("RlSampling", tuple(Field(name, kind) for name, kind in RING_FIELDS))

# One sampled token's logprobs (RL_FLAG_LOGPROBS): the token's and the n_top likeliest tokens',
# from the raw logits; step -> step_logprobs -> slot_logprobs (critical) -> cq_logprobs (overlapped).
LOGPROBS = Struct(
    "RlLogprobs",
    (
        Field("logprob", "f32"),
        Field("n_top", "i32"),
        Field("top_ids", "i32", MAX_LOGPROBS),
        Field("top_logprobs", "f32", MAX_LOGPROBS),
    ),
    align=4,
)


# The tables below keep their hand layout (fields grouped by cache line or by meaning).
# fmt: off
# Written once by the host before the scheduler starts; read-only afterwards.
CONFIG = Struct("RlConfig", (
    _f("magic", "u32"), _f("version", "u32"),
    _f("n_slots", "u32"), _f("max_ctx", "u32"), _f("token_budget", "u32"),
    _f("sq_size", "u32"), _f("cq_size", "u32"), _f("arena_size", "u32"),
    _f("pending_cap", "u32"), _f("aq_size", "u32"), _f("work_len", "u32"), _f("policy", "u32"),
    _f("aging_steps", "u32"),
    _f("n_eos", "u32"), _f("eos_ids", "i32", MAX_EOS_IDS),
    _f("n_buckets", "u32"), _f("buckets", "u32", MAX_BUCKETS),
    _f("trace_len", "u32"),
    # the most prompt rows one step scores (prompt logprobs: the step's score entries, each an
    # lm_head row and a logprobs record); 0: no request may ask for prompt logprobs
    _f("score_rows", "u32"),
    # 1: the overlapped phase publishes each next step's bucket ahead (RlLaunchWords), the
    # critical phase runs it and hands over a void step when every planned row ended (the
    # ping-pong launch, whose next graph picks its branch while the step before it computes)
    _f("plan_ahead", "u32"),
    # the paged KV cache: n_pages pages of page_size token positions; a slot's block table has
    # pages_per_slot entries (ceil(max_ctx / page_size))
    _f("page_size", "u32"), _f("pages_per_slot", "u32"), _f("n_pages", "u32"),
    # the prefix cache (0: off): full pages keyed by ipc/prefix_keys.py under the secret key
    # (prefix_k0, prefix_k1); prefix_table (open addressing) and lru (a ring) have table_size and
    # lru_size entries, each a power of two >= 4 * n_pages
    _f("prefix_caching", "u32"), _f("table_size", "u32"), _f("lru_size", "u32"),
    _f("prefix_k0", "u64"), _f("prefix_k1", "u64"),
    # the model's vocabulary: the width of a slot's token_counts row (0: no counts kept)
    _f("vocab_size", "u32"),
    # the grammar array's int32 words (the automata of structured output, ipc/automaton.py)
    _f("grammar_words", "u32"),
    # speculative decoding (sched_spec.h): the most draft tokens a slot verifies per step (0:
    # off), the n-gram lengths a prompt-lookup match tries (longest first), the positions it
    # searches back, and the decoding slots above which no slot drafts
    _f("spec_tokens", "u32"), _f("spec_ngram_max", "u32"), _f("spec_ngram_min", "u32"),
    _f("spec_window", "u32"), _f("spec_max_batch", "u32"),
    _f("layout_fingerprint", "u64"),
))

# Host-visible control block.  Fields are grouped by writer on separate 64-byte lines.
CONTROL = Struct("RlControl", (
    # line 0: host writes
    _f("magic", "u32"), _f("version", "u32"), _f("shutdown", "u32"), _f("sq_tail", "u32"),
    _f("cq_head", "u32"), _f("aq_tail", "u32"),
    # how long the scheduler waits for compute to hand back its turn once told to stop, and the
    # most it runs at all (0: no limit); both in device ns, read once at start
    _f("stop_grace_ns", "u64"), _f("run_budget_ns", "u64"), _f("_host_pad", "u32", 6),
    # line 1: device writes, ring indices and liveness
    _f("sq_head", "u32"), _f("cq_tail", "u32"), _f("error_code", "u32"), _f("state", "u32"),
    _f("exit_reason", "u32"), _f("aq_head", "u32"),
    _f("heartbeat_ns", "u64"), _f("_dev_pad", "u64", 4),
    # line 2 on: device writes, the counters (ipc/counters.py)
    *(_f(c.name, c.kind) for c in COUNTERS),
), align=64)

# Submission queue entry (host -> device): a GENERATE; the device reuses `op` for its pending state.
# The fields the scheduler acts on (max_tokens, flags, stop_ids) have their own places; the
# sampler's are the RlSampling `sampling`.
SQ_ENTRY = Struct("RlSqEntry", (
    _f("op", "u32"), _f("handle", "u32"), _f("prompt_off", "u32"), _f("prompt_len", "u32"),
    _f("max_tokens", "u32"), _f("flags", "u32"), _f("priority", "i32"),
    _f("n_stop", "u32"), _f("arrival", "u32"), _f("stop_ids", "i32", MAX_STOP_IDS),
    _f("sampling", SAMPLING),
    _f("drained_ns", "u64"),  # device clock when the scheduler took it from the SQ (device-set)
    # its output's constraint: the word offset of its automaton in `grammar` (RL_NO_GRAMMAR: none)
    _f("grammar_off", "u32"), _f("_pad", "u32"),
))

# Abort ring entry (host -> device): the request's handle, the free-running u32 SQ index its
# GENERATE was written at (which tells the device whether it has drained that GENERATE yet) and
# AbortFlag bits (IF_QUEUED: a queue deadline's abort, which a request in a slot ignores).
ABORT_ENTRY = Struct("RlAbortEntry", (_f("handle", "u32"), _f("sq_pos", "u32"), _f("flags", "u32")))

# Completion queue event (device -> host).
CQ_EVENT = Struct("RlCqEvent", (
    _f("handle", "u32"), _f("kind", "u8"), _f("finish_reason", "u8"), _f("_pad", "u16"),
    _f("token", "i32"), _f("index", "u32"), _f("time_ns", "u64"),
    _f("queued_us", "u32"),  # on DONE: microseconds the request waited in the pending queue
))

# Device-private: one batch slot's request.  ev_token and finish are the events the critical
# phase decided and the overlapped phase still has to write (ev_token TOKENs: the step's accepted
# draft tokens, already in slot_tokens, then last_token; a DONE).
# fill_len: the tokens its prefill feeds (the prompt; after a preemption the prompt and every
# token generated so far, recomputed); n_pages: the block-table entries it holds; admit_seq:
# its admission's sequence number (of two equally urgent, the youngest is preempted first).
# Prefix cache: slot_keys holds the keys of its first n_keyed full pages; its first n_cached
# pages were matched or offered to the cache; kv_done: its positions whose KV steps already
# completed have written.
SLOT = Struct("RlSlot", (
    _f("state", "u32"), _f("handle", "u32"), _f("prompt_off", "u32"), _f("prompt_len", "u32"),
    _f("n_prefilled", "u32"), _f("n_generated", "u32"), _f("max_tokens", "u32"),
    _f("flags", "u32"), _f("last_token", "i32"), _f("n_stop", "u32"), _f("sampled", "u32"),
    _f("ev_token", "u32"), _f("finish", "u32"), _f("stop_ids", "i32", MAX_STOP_IDS),
    _f("queued_us", "u32"), _f("fill_len", "u32"), _f("n_pages", "u32"), _f("admit_seq", "u32"),
    _f("n_keyed", "u32"), _f("n_cached", "u32"), _f("kv_done", "u32"),
    # its request's priority and arrival step, from the SQ entry: under --policy priority,
    # preemption and resumption rank slots with pending requests by rl_priority_key, aging included
    _f("priority", "i32"), _f("arrival", "u32"),
    _f("sampling", SAMPLING),
    # structured output: its automaton (RL_NO_GRAMMAR: none) and the state its tokens so far led to
    _f("grammar_off", "u32"), _f("grammar_state", "u32"),
    # prompt logprobs: its prompt positions whose next token's record is laid out (kept across a
    # preemption, so a recompute scores no position twice)
    _f("n_scored", "u32"),
    # speculative decoding (sched_spec.h): its draft length now (adapts to what it accepts; 0:
    # it never drafts), the slot_tokens position its newest token matches (RL_NO_MATCH: none),
    # the draft tokens the step in flight verifies and where they start in slot_tokens, and
    # the last verification's (drafted | accepted << 16) for the counters, the steps it waits
    # before it looks for a match again, and its drafts rejected whole in a row (the wait doubles)
    _f("spec_k", "u32"), _f("spec_match", "u32"), _f("n_draft", "u32"), _f("draft_from", "u32"),
    _f("spec_result", "u32"), _f("spec_wait", "u32"), _f("spec_misses", "u32"),
))

# Device-private: one KV page's record.  ref_count: the block tables that hold it.  A full page
# whose KV is written may be cached: its key (ipc/prefix_keys.py) sits in prefix_table at
# table_pos (else RL_NO_POS).  An unheld page is on the free stack if uncached, else in the lru
# ring at lru_pos (RL_NO_POS while held): free + held + cached-unheld = n_pages.
PAGE = Struct("RlPage", (
    _f("ref_count", "u32"), _f("table_pos", "u32"), _f("key", "u64"), _f("lru_pos", "u32"),
    _f("_pad", "u32"),
))

# Device-private scheduler bookkeeping.  The counters live here, in device memory, and are
# mirrored to the host control block with plain stores (every RL_MIRROR_STEPS steps, after
# RL_MIRROR_NS, on going idle, on a CQ stall and at exit): no step reads host memory to count.
SCHED = Struct("RlSchedState", (
    _f("step", "u64"), _f("started_ns", "u64"), _f("stop_grace_ns", "u64"),
    _f("run_budget_ns", "u64"), _f("mirrored_ns", "u64"), _f("mirrored_step", "u64"),
    _f("mirrored_finished", "u64"),
    _f("step_tokens", "u64"), _f("generated", "u64"), _f("admitted", "u64"),
    _f("finished", "u64"), _f("idle_polls", "u64"), _f("cq_stalls", "u64"), _f("aborts", "u64"),
    _f("n_pending", "u32"), _f("sq_head", "u32"), _f("cq_tail", "u32"), _f("aq_head", "u32"),
    _f("cq_head_seen", "u32"),  # the last cq_head read; re-read only when the CQ looks full
    _f("n_queued", "u32"),      # prefill_queue entries (admission order; compacted before admitting)
    _f("n_active", "u32"),      # slots not FREE after the last overlapped phase
    _f("last_step_tokens", "u32"),
    _f("has_cancelled", "u32"),  # some pending entry is CANCELLED: its DONE is still to write
    _f("chained", "u32"),  # a step was built and no idle pass came since (the bubble's condition)
    # > 0: the next step repeats the in-flight one's rows, all decode rows (this many), with no
    # slot joining, aborted or short of a page: the critical phase only advances them in place
    _f("steady_rows", "u32"),
    _f("n_free_pages", "u32"),  # entries of free_pages in use (a stack: pop and push at the top)
    _f("admit_seq", "u32"),     # the next admission's sequence number
    # the overlapped phase could not give every decoding slot its next row's page: the critical
    # phase does, preempting if it must
    _f("pages_short", "u32"),
    # cfg.plan_ahead: the bucket published for the next step (0: none published), which the
    # next critical phase must hand over, its rows within it
    _f("plan_bucket", "u32"),
    _f("preemptions", "u64"),
    # the prefix cache: lru ring indices (free-running; head is the least recently released),
    # its live entries (cached pages no slot holds), and prefix_table cells marked gone
    _f("lru_head", "u32"), _f("lru_tail", "u32"), _f("n_cached_free", "u32"), _f("n_gone", "u32"),
    _f("prefix_queries", "u64"), _f("prefix_hits", "u64"),
    # prompt logprobs: the score entries of the step just consumed, kept for the overlapped
    # phase's events (kept_score_events, kept_logprobs)
    _f("n_kept_score", "u32"), _f("_pad", "u32"),
    # speculative decoding: verifications (a slot's step with a draft), the draft tokens they
    # verified, and those accepted (each also a generated token)
    _f("spec_drafts", "u64"), _f("spec_draft_tokens", "u64"), _f("spec_accepted", "u64"),
))

# The step the scheduler built, read by the model step.
STEP = Struct("RlStepHeader", (
    _f("n_tokens", "u32"), _f("bucket", "u32"), _f("n_segments", "u32"), _f("n_samples", "u32"),
    _f("n_decode", "u32"), _f("seq", "u32"),
    _f("n_score", "u32"),  # score entries (prompt logprobs), at most cfg.score_rows
    _f("_pad", "u32"),
))

# The launch's words in device memory, beside `turn`, each with one writer: the scheduler
# writes released (the seq + 1 of the last step handed over, after turn = COMPUTE), idle (the
# last overlapped phase found nothing to do: the compute side's hint to back off) and, under
# cfg.plan_ahead, the next step's plan in its parity's slot: plan_bucket[seq & 1], then
# plan_seq[seq & 1] = seq + 1 (release), published by the overlapped phase.  One slot per parity:
# a slot is written again only for the step two on, which is handed over after the graph that
# reads it has taken its plan.  graph_seq[p] is written by ping-pong graph p's signal kernel
# alone (the seq of the next step it runs; the host sets p before any launch).
LAUNCH = Struct("RlLaunchWords", (
    _f("released", "u32"), _f("idle", "u32"), _f("plan_seq", "u32", 2), _f("plan_bucket", "u32", 2),
    _f("graph_seq", "u32", 2),
))

STRUCTS = (SAMPLING, LOGPROBS, CONFIG, CONTROL, SQ_ENTRY, ABORT_ENTRY, CQ_EVENT, SLOT, PAGE, SCHED, STEP, LAUNCH)

# Pointer table handed to sched_step: names, element type, and length in terms of the config.
ARRAYS = (
    ("cfg", "RlConfig", "1"), ("ctl", "RlControl", "1"),
    ("sq", "RlSqEntry", "sq_size"), ("arena", "int32_t", "arena_size"),
    ("cq", "RlCqEvent", "cq_size"),
    ("cq_logprobs", "RlLogprobs", "cq_size"),  # per CQ position: its TOKEN event's, if asked
    ("aq", "RlAbortEntry", "aq_size"),
    ("slots", "RlSlot", "n_slots"), ("pending", "RlSqEntry", "pending_cap"),
    ("sched", "RlSchedState", "1"), ("step", "RlStepHeader", "1"),
    ("token_ids", "int32_t", "token_budget"), ("positions", "int32_t", "token_budget"),
    ("slot_of", "int32_t", "token_budget"),
    ("seg_slot", "int32_t", "n_slots"), ("seg_row_start", "int32_t", "n_slots"),
    ("seg_n_rows", "int32_t", "n_slots"),
    # per sample entry (sample_len = n_slots * (1 + spec_tokens): a decoding slot samples each
    # of its verification rows): its row, its place in next_token (rl_sample_out: the slot for
    # its first, n_slots on for a draft's), its settings and counter (its token's index in its
    # request, the RNG's and min_tokens')
    ("sample_row", "int32_t", "sample_len"), ("sample_slot", "int32_t", "sample_len"),
    ("sample_params", "RlSampling", "sample_len"), ("sample_counter", "int32_t", "sample_len"),
    # per sample: the word offset in `grammar` of the bitmask of the tokens its constraint allows
    # now (ipc/automaton.py), RL_AUTO_NO_MASK (-1) for a request without one
    ("sample_mask", "int32_t", "sample_len"),
    # per slot, pages_per_slot page ids: position p of slot s is in page block_table[s][p / page_size]
    ("block_table", "int32_t", "block_table_len"),
    # per score entry (prompt logprobs; n_score in the header): the row whose logits score, the
    # prompt token it scores, its request's count of alternatives, its slot
    ("score_row", "int32_t", "score_len"), ("score_token", "int32_t", "score_len"),
    ("score_top", "int32_t", "score_len"), ("score_slot", "int32_t", "score_len"),
    # per sample place (rl_sample_out): the token the step sampled
    ("next_token", "int32_t", "sample_len"),
    # per sample place: its logprobs as the step wrote them, and the critical phase's copy
    ("step_logprobs", "RlLogprobs", "sample_len"), ("slot_logprobs", "RlLogprobs", "sample_len"),
    # per score entry (prompt logprobs): the record the step writes, and the critical phase's
    # copies for the overlapped phase: the PROMPT event (its time aside) and the record
    ("step_prompt_logprobs", "RlLogprobs", "score_len"),
    ("kept_score_events", "RlCqEvent", "score_len"), ("kept_logprobs", "RlLogprobs", "score_len"),
    # scheduler work space for scans, sorts and compaction; work_len = max(n_slots, pending_cap)
    ("work_a", "uint32_t", "work_len"), ("work_b", "uint32_t", "work_len"),
    ("work_c", "uint32_t", "work_len"), ("work_d", "uint32_t", "work_len"),
    ("work_e", "uint32_t", "work_len"), ("work_f", "uint32_t", "work_len"),
    ("pending_tmp", "RlSqEntry", "pending_cap"),
    # slots in PREFILL, in admission order (the order prefill chunks are given out)
    ("prefill_queue", "uint32_t", "n_slots"),
    # per slot, max_ctx token ids: the prompt, copied in from the arena at admission, then each
    # token generated (copied as its event is written); prefill rows, and a preempted request's
    # recompute, read them here, so the critical phase lays out rows without reading host memory
    ("slot_tokens", "int32_t", "slot_tokens_len"),
    # per slot, vocab_size words, kept for a request with a penalty (RL_FLAG_PENALIZED) only: its
    # output's count of each token, plus RL_PROMPT_MARK where the token is in its prompt; reset
    # and marked at admission, counted as each sample is consumed (critical phase), read by the
    # step's sampler
    ("token_counts", "int32_t", "token_counts_len"),
    # structured output's automata (ipc/automaton.py), grammar_words int32 words: the host writes
    # one (a device copy on CUDA) before it publishes the first SQ entry naming it; the scheduler
    # and the step's sampler only read them
    ("grammar", "int32_t", "grammar_words"),
    # the KV pages: their records, and the free list (a stack of page ids, n_free_pages deep)
    ("pages", "RlPage", "n_pages"), ("free_pages", "uint32_t", "n_pages"),
    # the prefix cache: key -> page (open addressing, linear probing; RL_CELL_EMPTY/RL_CELL_GONE
    # or a page id), cached pages no slot holds in release order (RL_CELL_GONE once revived),
    # and per slot the keys of its full pages (pages_per_slot each)
    ("prefix_table", "uint32_t", "table_size"), ("lru", "uint32_t", "lru_size"),
    ("slot_keys", "uint64_t", "block_table_len"),
    # per SQ position: the handle of an abort that arrived before that entry was drained (0: none)
    ("sq_cancel", "uint32_t", "sq_size"),
    # the scheduler/compute hand-over word on CUDA (RL_TURN_*); unused by the CPU backend
    ("turn", "uint32_t", "1"),
    # the launch's other words on CUDA (RlLaunchWords: the released seq, the plan, the idle hint)
    ("launch", "RlLaunchWords", "1"),
    # device timeline: per step (seq % trace_len) RL_TRACE_FIELDS stamps in ns
    ("trace", "uint64_t", "trace_words"),
)

# fmt: on

# The scheduler kernel's working state, placed in its shared memory for its whole life, in this
# order, each array while what the launch gave still holds it (the rest stays in device memory):
# every access of the critical phase then misses no cache.  None of them is read by the step on
# CUDA (its layout arrays stay in device memory) or by the host while the kernel runs; sched and
# slots are written back at exit.  (name, the count as a C expression over the config `cfg`.)
SHARED_PLACEMENT = (
    ("cfg", "1"),
    ("sched", "1"),
    ("slots", "cfg.n_slots"),
    ("prefill_queue", "cfg.n_slots"),
    ("seg_slot", "cfg.n_slots"),
    ("seg_row_start", "cfg.n_slots"),
    ("seg_n_rows", "cfg.n_slots"),
    ("work_a", "cfg.work_len"),
    ("work_b", "cfg.work_len"),
    ("work_c", "cfg.work_len"),
    ("work_d", "cfg.work_len"),
    ("work_e", "cfg.work_len"),
    ("work_f", "cfg.work_len"),
)
SHARED_WRITE_BACK = ("sched", "slots")

# Arrays the host reads or writes; the rest are private to the scheduler and the step.
HOST_SHARED = ("cfg", "ctl", "sq", "arena", "cq", "cq_logprobs", "aq")
# Of those, the ones shared while the scheduler runs (cfg is read-only, a device copy on CUDA).
HOST_RINGS = tuple(name for name in HOST_SHARED if name != "cfg")


def _header_body() -> str:
    parts = [
        f"#define RL_MAGIC 0x{MAGIC:08X}u",
        f"#define RL_LAYOUT_VERSION {LAYOUT_VERSION}u",
        f"#define RL_MAX_STOP_IDS {MAX_STOP_IDS}",
        f"#define RL_MAX_EOS_IDS {MAX_EOS_IDS}",
        f"#define RL_MAX_BUCKETS {MAX_BUCKETS}",
        f"#define RL_PROMPT_MARK {PROMPT_MARK}",
        f"#define RL_MAX_SPEC_TOKENS {MAX_SPEC_TOKENS}",
        f"#define RL_MAX_SPEC_NGRAM {MAX_SPEC_NGRAM}",
    ]
    parts += c_defines()
    parts += automaton.c_defines()
    parts += [s.c_text() for s in STRUCTS]
    ptrs = "\n".join(f"  {ctype}* {name};" for name, ctype, _ in ARRAYS)
    parts.append(f"struct RlContext {{\n{ptrs}\n}};")
    ctypes_of = {name: ctype for name, ctype, _ in ARRAYS}
    place = " ".join(f"X({n}, {ctypes_of[n]}, {count})" for n, count in SHARED_PLACEMENT)
    parts.append(f"#define RL_SHARED_PLACEMENT(X) {place}")
    back = " ".join(f"X({n}, {ctypes_of[n]}, {dict(SHARED_PLACEMENT)[n]})" for n in SHARED_WRITE_BACK)
    parts.append(f"#define RL_SHARED_WRITE_BACK(X) {back}")
    return "\n\n".join(parts)


def fingerprint() -> int:
    """64-bit hash of the header text: any change to the layout changes it."""
    return int.from_bytes(hashlib.sha256(_header_body().encode()).digest()[:8], "little")


def c_header() -> str:
    """The header both compilers include (NVRTC gets no include path: its integer types are typedefs).

    Every offset is asserted where the compiler can take one in a constant expression: the host
    compiler always (<stddef.h>), NVRTC when it has the builtin. NVRTC 13.0-13.3 rejects
    __builtin_offsetof inside static_assert, so there only sizes are asserted; the host build
    compiles the same text and the fingerprint is checked at start, so no offset goes unchecked."""
    return "\n".join(
        [
            "// Generated from ipc/layout.py. Do not edit.",
            "#pragma once",
            "#ifdef __CUDACC_RTC__",
            "typedef unsigned char uint8_t; typedef unsigned short uint16_t;",
            "typedef unsigned int uint32_t; typedef int int32_t;",
            "typedef unsigned long long uint64_t; typedef long long int64_t;",
            "#if defined(__has_builtin)",  # nested: `0(x)` would not parse where it is undefined
            "#if __has_builtin(__builtin_offsetof)",
            "#define RL_OFFSETOF(t, m) __builtin_offsetof(t, m)",
            "#endif",
            "#endif",
            "#else",
            "#include <stddef.h>",
            "#include <stdint.h>",
            "#define RL_OFFSETOF(t, m) offsetof(t, m)",
            "#endif",
            "#ifdef RL_OFFSETOF",
            '#define RL_ASSERT_OFFSET(t, m, off) static_assert(RL_OFFSETOF(t, m) == (off), #t "." #m)',
            "#else",
            '#define RL_ASSERT_OFFSET(t, m, off) static_assert(sizeof(((t*)0)->m) > 0, #t "." #m)',
            "#endif",
            f"#define RL_LAYOUT_FINGERPRINT 0x{fingerprint():016X}ull",
            _header_body(),
            c_mirror_macro(),  # device code, not the layout the host reads: not in the fingerprint
            "",
        ]
    )


def array_lengths(cfg: dict) -> dict[str, int]:
    """Element count of every ARRAYS entry for a config given as a dict of RlConfig fields."""
    return {name: (1 if n == "1" else int(cfg[n])) for name, _, n in ARRAYS}


_CTYPE_DTYPES = {"int32_t": np.int32, "uint32_t": np.uint32, "uint64_t": np.uint64, "float": np.float32}


def array_dtype(ctype: str) -> np.dtype:
    for s in STRUCTS:
        if s.name == ctype:
            return s.numpy_dtype()
    return np.dtype(_CTYPE_DTYPES[ctype])
