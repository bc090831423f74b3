"""The null model's step (device/null/null_model.py): `run(bucket, layout)` with the contract of
EagerStep.run on the CPU and of StaticStep.run for capture on CUDA, and no arithmetic.

For each live sample entry i: next_token[sample_slot[i]] = table[token_ids[sample_row[i]]], and
for an entry whose request asked for logprobs its RlLogprobs record in closed form (the pattern
token first, then the lowest other ids, as the null logits rank them); on the CPU each score
entry's too (prompt logprobs: the prompt token's logprob under its row's null logits). Then the fixed busy time,
if any: on the CPU a spin in C with the GIL released (a model step's torch ops release it too, so
the server's other threads run beside it as they would), or with --null-step-wait sleep a sleep
(the host's share of a GPU's step: a wait that costs no CPU); on CUDA a spin on the GPU's global timer
inside the step's kernel.

On the CPU the step is one call into C (a few microseconds, where the same in torch ops took
about twenty); on CUDA one Triton launch (triton_null_step.py), so its graph is one kernel node
and what the device scheduler's gap between steps measures is the runtime's. The torch form here
is the reference both are tested against. The C step's argument struct is declared once, as
NULL_STEP_ARGS, and both its C text and the record Python fills are generated from it
(ipc/native_struct.py).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ringleader.device.null.null_logits import record_logprobs
from ringleader.device.sampling.sampler import LOGPROBS_WORDS
from ringleader.device.step.step_layout import StepLayout
from ringleader.ipc.layout import Field, Struct
from ringleader.ipc.native_struct import Pointer, host_c_text, struct_record
from ringleader.ipc.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:  # NullModel builds its step (eager_step): no import back at run time
    from ringleader.device.null.null_model import NullModel

# The C step's arguments: the layout's arrays (bound once, fixed for the engine's life), the
# logprobs records' shape and values, and the busy time. The C struct and the record NullStep
# fills are both generated from this table, so neither side can drift from the other.
NULL_STEP_ARGS = Struct("NullStepArgs", (
    Pointer("table", "i32", const=True), Field("vocab", "i32"), Field("n_slots", "i32"),
    Pointer("token_ids", "i32", const=True), Pointer("n_tokens", "i32", const=True),
    Pointer("n_samples", "i32", const=True),
    Pointer("sample_row", "i32", const=True), Pointer("sample_slot", "i32", const=True),
    Pointer("top_n", "i32", const=True), Field("top_n_stride", "i64"),  # in int32 words
    Pointer("next_token", "i32"), Pointer("records", "i32"),
    Field("record_words", "i32"), Field("max_top", "i32"),
    Field("token_lp", "f32"), Field("other_lp", "f32"), Field("spin_ns", "u64"),
    Field("sleep", "i32"),  # 1: the busy time is slept (a host waiting on a GPU), 0: spun
    # prompt logprobs: the score entries and the records they get (step_prompt_logprobs)
    Pointer("n_score", "i32", const=True), Pointer("score_row", "i32", const=True),
    Pointer("score_token", "i32", const=True), Pointer("score_top", "i32", const=True),
    Pointer("score_records", "i32"),
))  # fmt: skip

# The step itself; it follows the generated NullStepArgs (host_c_text) in the library's source.
_NATIVE_STEP = r"""
#include <string.h>
#include <time.h>

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static int32_t clamp(int32_t x, int32_t lo, int32_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// One RlLogprobs record under the null logits of a row whose pattern token is `tok`: `lp` for
// the token scored, the ranking (tok, then the lowest other ids) and its logprobs.
static void write_record(const NullStepArgs* a, int32_t* rec, int32_t tok, const float* lp, int32_t asked) {
  memcpy(&rec[0], lp, 4);
  rec[1] = asked < a->max_top ? asked : a->max_top;
  for (int32_t j = 0; j < a->max_top; ++j) {
    rec[2 + j] = j == 0 ? tok : (j - 1) + (j - 1 >= tok);
    memcpy(&rec[2 + a->max_top + j], j == 0 ? &a->token_lp : &a->other_lp, 4);
  }
}

// NullStep's step on the CPU (its torch form is the reference), then the busy time; ctypes
// drops the GIL around the call, as a model step's torch ops do.
extern "C" void rl_null_step(const NullStepArgs* a) {
  const int32_t m = a->n_samples ? *a->n_samples : 0;  // none given: the busy time alone
  const int32_t rows = a->n_tokens ? *a->n_tokens : 0;
  for (int32_t i = 0; i < m && i < a->n_slots; ++i) {
    const int32_t row = clamp(a->sample_row[i], 0, rows - 1);
    const int32_t tok = a->table[clamp(a->token_ids[row], 0, a->vocab - 1)];
    const int32_t slot = clamp(a->sample_slot[i], 0, a->n_slots - 1);
    a->next_token[slot] = tok;
    const int32_t asked = a->top_n[i * a->top_n_stride];
    if (asked < 0) continue;
    write_record(a, a->records + (int64_t)slot * a->record_words, tok, &a->token_lp, asked);
  }
  const int32_t n_score = a->n_score ? *a->n_score : 0;
  for (int32_t i = 0; i < n_score; ++i) {  // the prompt token scored under its row's logits
    const int32_t row = clamp(a->score_row[i], 0, rows - 1);
    const int32_t tok = a->table[clamp(a->token_ids[row], 0, a->vocab - 1)];
    const float* lp = a->score_token[i] == tok ? &a->token_lp : &a->other_lp;
    const int32_t asked = a->score_top[i] < 0 ? 0 : a->score_top[i];
    write_record(a, a->score_records + (int64_t)i * a->record_words, tok, lp, asked);
  }
  if (a->spin_ns && a->sleep) {
    struct timespec t = {(time_t)(a->spin_ns / 1000000000u), (long)(a->spin_ns % 1000000000u)};
    while (nanosleep(&t, &t) != 0) {  // interrupted by a signal: sleep the rest
    }
  } else if (a->spin_ns) {
    const uint64_t end = now_ns() + a->spin_ns;
    while (now_ns() < end) {
    }
  }
}
"""


@functools.cache
def _native_step() -> ctypes._CFuncPtr:
    from ringleader.ipc.native import load_library

    fn = load_library("rlnullstep", host_c_text(NULL_STEP_ARGS) + _NATIVE_STEP).rl_null_step
    fn.argtypes, fn.restype = [ctypes.c_void_p], None  # the address of a NULL_STEP_ARGS record
    return fn


def null_records(tokens: torch.Tensor, top_n: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [N, LOGPROBS_WORDS]: the RlLogprobs record of each pattern token [N] under the null
    logits (NULL_LOGIT at the token, 0 elsewhere): the token's logprob, n_top (top_n clamped to
    [0, MAX_LOGPROBS]), and the ranking: the token, then ids 0, 1, ... without it."""
    n, dev = tokens.shape[0], tokens.device
    token_lp, other_lp = record_logprobs(vocab_size)
    tok = tokens.to(torch.int64)[:, None]
    j = torch.arange(MAX_LOGPROBS, device=dev, dtype=torch.int64)[None, :]
    others = (j - 1) + (j - 1 >= tok).long()
    ids = torch.where(j == 0, tok, others).to(torch.int32)
    lps = torch.where(j == 0, token_lp, other_lp).to(torch.float32).expand(n, MAX_LOGPROBS)
    head = torch.full((n, 1), token_lp, dtype=torch.float32, device=dev).view(torch.int32)
    n_top = top_n.to(dev, torch.int32).clamp(0, MAX_LOGPROBS)[:, None]
    return torch.cat([head, n_top, ids, lps.contiguous().view(torch.int32)], dim=1)


class NullStep:
    """The null model's step over `model` (its table on the layout's device) for `n_slots` slots.
    kernel: "native" (the CPU's: C, one call), "torch" (the CPU reference) or "triton" (CUDA: one
    launch); None: native on the CPU, triton on CUDA."""

    def __init__(self, model: NullModel, n_slots: int, kernel: str | None = None) -> None:
        self.model, self.n_slots = model, n_slots
        self.table, self.vocab = model.table, model.options.vocab_size
        self.step_ns = model.options.step_ns
        self.sleeps = model.options.step_wait == "sleep"
        on_cpu = model.device.type == "cpu"
        kernel = kernel or ("native" if on_cpu else "triton")
        allowed = ("native", "torch", "triton") if on_cpu else ("triton",)
        if kernel not in allowed:
            raise ValueError(
                f"kernel on {model.device.type} must be one of {', '.join(allowed)}, got {kernel!r}"
            )
        self.kernel = kernel
        self._native_args: np.ndarray | None = None  # a NULL_STEP_ARGS record, alive while bound
        self._native_address = 0  # where it lies, for the call
        self._bound: StepLayout | None = None  # the layout they point into (kept alive by this)
        if kernel == "native":
            _native_step()  # built now, not inside the first step

    @torch.inference_mode()
    def run(self, bucket: int, layout: StepLayout) -> torch.Tensor:
        """Writes next_token (and the asked logprobs records) for the step's sample entries;
        returns an empty tensor (there are no logits). On the CPU bucket is n_tokens; on CUDA
        the entries are the first min(bucket, n_slots), live below n_samples."""
        if self.kernel == "triton":
            from ringleader.device.null.triton_null_step import null_step_triton

            null_step_triton(self.table, self.n_slots, self.step_ns, bucket, layout)
        elif self.kernel == "native":
            _native_step()(self._bind(layout))
        else:
            self._run_torch(bucket, layout)
        return self.table[:0]

    def _run_torch(self, bucket: int, layout: StepLayout) -> None:
        """The reference, on CPU tensors: the entries' count read on the host, exact sizes."""
        m = int(layout.n_samples.item())
        if m:
            rows = layout.sample_row[:m].long().clamp(0, bucket - 1)
            tokens = self.table[layout.token_ids.index_select(0, rows).long().clamp(0, self.vocab - 1)]
            slots = layout.sample_slot[:m].long().clamp(0, self.n_slots - 1)
            layout.next_token.index_copy_(0, slots, tokens)
            top_n = layout.params["logprobs"][:m]
            asked = top_n >= 0
            if bool(asked.any()):
                records = null_records(tokens[asked], top_n[asked], self.vocab)
                layout.step_logprobs.index_copy_(0, slots[asked], records)
        n_score = int(layout.n_score.item())
        if n_score:  # each prompt token scored under its row's null logits
            rows = layout.score_row[:n_score].long().clamp(0, bucket - 1)
            pattern = self.table[layout.token_ids.index_select(0, rows).long().clamp(0, self.vocab - 1)]
            records = null_records(pattern, layout.score_top[:n_score], self.vocab)
            token_lp, other_lp = record_logprobs(self.vocab)
            scored = torch.where(layout.score_token[:n_score] == pattern, token_lp, other_lp)
            records[:, 0] = scored.to(torch.float32).view(torch.int32)
            layout.step_prompt_logprobs[:n_score].copy_(records)
        if self.step_ns:
            # the busy time alone
            spin_only = struct_record(NULL_STEP_ARGS, spin_ns=self.step_ns, sleep=int(self.sleeps))
            _native_step()(spin_only.ctypes.data)

    def _bind(self, layout: StepLayout) -> int:
        """The address of the C step's arguments: pointers into the layout, which on the CPU are
        the scheduler's arrays themselves (made once: StepLayout.from_arrays), so bound once."""
        if self._native_args is None or layout is not self._bound:  # per step: one identity check
            records, top_n = layout.step_logprobs, layout.params["logprobs"]
            if records.stride() != (LOGPROBS_WORDS, 1) or layout.token_ids.stride() != (1,):
                raise ValueError("the native null step needs the layout's dense arrays")
            token_lp, other_lp = record_logprobs(self.vocab)
            self._native_args = struct_record(
                NULL_STEP_ARGS,
                table=self.table.data_ptr(), vocab=self.vocab, n_slots=self.n_slots,
                token_ids=layout.token_ids.data_ptr(), n_tokens=layout.n_tokens.data_ptr(),
                n_samples=layout.n_samples.data_ptr(),
                sample_row=layout.sample_row.data_ptr(), sample_slot=layout.sample_slot.data_ptr(),
                top_n=top_n.data_ptr(), top_n_stride=top_n.stride(0),
                next_token=layout.next_token.data_ptr(), records=records.data_ptr(),
                record_words=LOGPROBS_WORDS, max_top=MAX_LOGPROBS,
                token_lp=token_lp, other_lp=other_lp, spin_ns=self.step_ns, sleep=int(self.sleeps),
                n_score=layout.n_score.data_ptr(), score_row=layout.score_row.data_ptr(),
                score_token=layout.score_token.data_ptr(), score_top=layout.score_top.data_ptr(),
                score_records=layout.step_prompt_logprobs.data_ptr(),
            )  # fmt: skip
            self._native_address = self._native_args.ctypes.data
            self._bound = layout
        return self._native_address

    def warmup(self, layout: StepLayout, buckets: Iterable[int]) -> None:
        """One run per bucket with no sample entries (compiles the kernel), as StaticStep.warmup."""
        layout.slot_of.fill_(-1)
        layout.n_samples.zero_()
        for b in buckets:
            self.run(b, layout)
