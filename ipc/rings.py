"""Host-side views of the shared memory: the SQ and abort-ring producers, the CQ consumer and the
prompt arena.

Memory is planned from ringleader.ipc.layout.ARRAYS: every array starts on a 128-byte boundary.  A backend
allocates the bytes (plain host memory on the CPU, pinned host memory plus device memory on CUDA)
and hands the host-shared arrays to these classes; hostctl never touches the device-private ones.

Ordering (the rules of ipc/layout.py): the SQ producer writes an entry, then its prompt tokens
are already in the arena, then publishes sq_tail with a release store; the CQ consumer reads
cq_tail with an acquire load, copies the events out, then publishes cq_head with a release store.
The abort producer writes an entry, then publishes aq_tail with a release store; it may do so before
or after the SQ publish of the GENERATE it names (the device parks an abort for an undrained entry).
Each class below is used from one thread only: SubmissionQueue and AbortQueue by the frontend
thread, CompletionQueue by the completion thread.  PromptArena is shared by both and locks.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ringleader.ipc import layout
from ringleader.ipc.atomics import AtomicU32
from ringleader.ipc.automaton import GrammarArena
from ringleader.ipc.counters import COUNTERS
from ringleader.ipc.limits import MAX_SLOTS
from ringleader.ipc.prefix_keys import mix64, page_keys
from ringleader.ipc.sampling_params import SamplingParams

ALIGN = 128
# the control block's liveness fields HostRings.counters() reports after the counters
LIVENESS_FIELDS = ("heartbeat_ns", "error_code", "state", "exit_reason")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class RingConfig:
    n_slots: int = 32
    max_ctx: int = 2048
    token_budget: int = 512
    sq_size: int = 1024
    cq_size: int = 8192
    arena_size: int = 1 << 20
    pending_cap: int = 1024
    # abort ring entries; 0: the next power of two >= sq_size + pending_cap + n_slots, so every
    # request the device can hold gets its abort in without waiting
    aq_size: int = 0
    policy: int = layout.Policy.FIFO
    aging_steps: int = 64
    eos_ids: tuple[int, ...] = ()
    buckets: tuple[int, ...] = ()
    trace_len: int = 4096  # steps kept in the device timeline ring
    page_size: int = 16  # token positions per KV page
    # KV pages in the pool; 0: n_slots * pages_per_slot, every slot's longest context at once
    n_pages: int = 0
    # share the KV of full prompt pages between requests with the same prefix (ipc/prefix_keys.py)
    prefix_caching: bool = True
    # the secret the page keys are made under; 0: drawn at random (per process, as it should be)
    prefix_seed: int = 0
    # the model's vocabulary, the width of each slot's token counts (the penalties' input); 0:
    # none kept, and a request with a penalty is refused (the protocol decoder checks)
    vocab_size: int = 0
    # publish each next step's bucket ahead and hand over exactly that bucket (a void step when
    # all its rows ended): the ping-pong launch's contract (device/sched/sched_loop.h)
    plan_ahead: bool = False
    # int32 words of the grammar array, structured output's automata (ipc/automaton.py); at
    # least 1, so every plan has the array
    grammar_words: int = 1
    # the most prompt rows one step scores for prompt logprobs (RlConfig.score_rows); None: the
    # token budget, as far as the CQ holds one step's events; 0: prompt logprobs refused
    score_rows: int | None = None
    # speculative decoding (device/sched/sched_spec.h): the most draft tokens a decoding slot
    # verifies per step (0: off), the n-gram lengths its prompt lookup tries, longest first, the
    # positions it searches back, and the decoding slots above which no slot drafts
    spec_tokens: int = 0
    spec_ngram_max: int = 4
    spec_ngram_min: int = 2
    spec_window: int = 2048
    spec_max_batch: int = 8

    def __post_init__(self):
        for name, low, high in (
            ("n_slots", 1, MAX_SLOTS),
            ("max_ctx", 2, None),  # one prompt token and one generated
            ("pending_cap", 1, None),
            ("aging_steps", 1, None),
        ):
            value = getattr(self, name)
            if value < low or (high is not None and value > high):
                limits = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"{name} must be {limits}, got {value}")
        if self.aq_size == 0:  # frozen: resolve "auto" once, so every reader sees the real size
            in_device = self.sq_size + self.pending_cap + self.n_slots
            object.__setattr__(self, "aq_size", 1 << (in_device - 1).bit_length())
        if not _pow2(self.page_size):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.n_pages == 0:
            object.__setattr__(self, "n_pages", self.n_slots * self.pages_per_slot)
        if self.prefix_seed == 0:
            object.__setattr__(self, "prefix_seed", secrets.randbits(64) | 1)
        if self.n_pages < self.pages_per_slot:
            raise ValueError(
                f"{self.n_pages} KV pages of {self.page_size} tokens cannot hold one request of "
                f"max_ctx {self.max_ctx} ({self.pages_per_slot} pages): a request that long could never finish"
            )
        for name in ("sq_size", "cq_size", "arena_size", "aq_size"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two, got {getattr(self, name)}")
        if self.token_budget < self.n_slots:
            raise ValueError("token_budget must be >= n_slots (every decoding slot gets a row)")
        if len(self.eos_ids) > layout.MAX_EOS_IDS:
            raise ValueError(f"at most {layout.MAX_EOS_IDS} eos ids")
        if len(self.buckets) > layout.MAX_BUCKETS or list(self.buckets) != sorted(self.buckets):
            raise ValueError(f"buckets: ascending, at most {layout.MAX_BUCKETS}")
        if not _pow2(self.trace_len):
            raise ValueError(f"trace_len must be a power of two, got {self.trace_len}")
        if self.plan_ahead and (not self.buckets or self.buckets[-1] < self.token_budget):
            raise ValueError("plan_ahead: the buckets must reach token_budget (every plan names one)")
        if self.vocab_size and self.max_ctx >= layout.PROMPT_MARK:
            raise ValueError(f"max_ctx must be below {layout.PROMPT_MARK} where token counts are kept")
        if not 0 <= self.spec_tokens <= layout.MAX_SPEC_TOKENS:
            raise ValueError(f"spec_tokens must be in [0, {layout.MAX_SPEC_TOKENS}], got {self.spec_tokens}")
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max <= layout.MAX_SPEC_NGRAM:
            raise ValueError(
                f"the n-gram lengths must satisfy 1 <= spec_ngram_min <= spec_ngram_max <= "
                f"{layout.MAX_SPEC_NGRAM}, got {self.spec_ngram_min} and {self.spec_ngram_max}"
            )
        if self.spec_window < 1 or self.spec_max_batch < 0:
            raise ValueError("spec_window must be >= 1 and spec_max_batch >= 0")
        if self.spec_tokens and self.max_ctx > 1 << 24:  # a match's place is kept in 24 bits
            raise ValueError("speculative decoding needs max_ctx <= 2**24")
        if self.sample_len > MAX_SLOTS:  # a step's TOKEN events are counted in 16 bits
            raise ValueError(f"n_slots * (1 + spec_tokens) must be at most {MAX_SLOTS}")
        step_events = (2 + self.spec_tokens) * self.n_slots + self.pending_cap
        if self.cq_size < step_events:
            raise ValueError(
                "cq_size must hold one step's events: >= (2 + spec_tokens)*n_slots + pending_cap"
            )
        room = self.cq_size - step_events  # a step's PROMPT events fit
        score_rows = min(self.token_budget, room) if self.score_rows is None else self.score_rows
        object.__setattr__(self, "score_rows", score_rows)
        if not 0 <= score_rows <= min(self.token_budget, room):
            raise ValueError(
                f"score_rows must be in [0, {min(self.token_budget, room)}] (the token budget, and "
                f"what cq_size holds besides a step's other events), got {self.score_rows}"
            )

    @property
    def work_len(self) -> int:
        return max(self.n_slots, self.pending_cap)

    @property
    def sample_len(self) -> int:
        """Sample entries (and next_token places) a step has: one per decoding slot's row."""
        return self.n_slots * (1 + self.spec_tokens)

    @property
    def pages_per_slot(self) -> int:
        return -(-self.max_ctx // self.page_size)

    @property
    def prefix_table_size(self) -> int:
        """prefix_table and lru entries: a power of two >= 4 * n_pages, so the table stays at most
        three quarters full of live and gone cells and the ring never laps itself."""
        return 1 << (4 * self.n_pages - 1).bit_length()

    @property
    def prefix_secret(self) -> tuple[int, int]:
        """(k0, k1): the SipHash key of the page keys, derived from prefix_seed."""
        return mix64(self.prefix_seed), mix64(self.prefix_seed ^ 0x9E3779B97F4A7C15)

    def prompt_keys(self, tokens: np.ndarray) -> np.ndarray:
        """The prefix-cache keys of a prompt's full pages (none when caching is off)."""
        if not self.prefix_caching:
            return np.zeros(0, np.uint64)
        return page_keys(tokens, self.page_size, *self.prefix_secret)

    def lengths(self) -> dict[str, int]:
        return layout.array_lengths(
            {
                **self.__dict__,
                "work_len": self.work_len,
                "trace_words": self.trace_len * layout.TRACE_FIELDS,
                "block_table_len": self.n_slots * self.pages_per_slot,
                "slot_tokens_len": self.n_slots * self.max_ctx,
                "token_counts_len": self.n_slots * self.vocab_size,
                "score_len": max(1, self.score_rows or 0),  # every plan has the arrays
                "sample_len": self.sample_len,
                "grammar_words": self.grammar_words,
                "table_size": self.prefix_table_size,
                "lru_size": self.prefix_table_size,
            }
        )


@dataclass
class MemoryPlan:
    offsets: dict[str, int] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    total: int = 0


def plan_memory(cfg: RingConfig, names) -> MemoryPlan:
    lengths = cfg.lengths()
    plan = MemoryPlan()
    off = 0
    for name, ctype, _ in layout.ARRAYS:
        if name not in names:
            continue
        nbytes = layout.array_dtype(ctype).itemsize * lengths[name]
        plan.offsets[name], plan.nbytes[name] = off, nbytes
        off = (off + nbytes + ALIGN - 1) // ALIGN * ALIGN
    plan.total = off
    return plan


def map_arrays(buffer: np.ndarray, plan: MemoryPlan, cfg: RingConfig) -> dict[str, np.ndarray]:
    """numpy views of each planned array inside `buffer` (a uint8 array of plan.total bytes)."""
    lengths = cfg.lengths()
    ctypes_of = {name: ctype for name, ctype, _ in layout.ARRAYS}
    views = {}
    for name, off in plan.offsets.items():
        dt = layout.array_dtype(ctypes_of[name])
        views[name] = buffer[off : off + plan.nbytes[name]].view(dt)[: lengths[name]]
    return views


def aligned_host_buffer(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start : start + nbytes]


def write_config(cfg_view: np.ndarray, cfg: RingConfig) -> None:
    c = cfg_view[0]
    c["magic"], c["version"] = layout.MAGIC, layout.LAYOUT_VERSION
    for name in (
        "n_slots",
        "max_ctx",
        "token_budget",
        "sq_size",
        "cq_size",
        "arena_size",
        "pending_cap",
        "aq_size",
        "policy",
        "aging_steps",
        "trace_len",
        "page_size",
        "pages_per_slot",
        "n_pages",
        "vocab_size",
        "grammar_words",
        "score_rows",
        "spec_tokens",
        "spec_ngram_max",
        "spec_ngram_min",
        "spec_window",
        "spec_max_batch",
    ):
        c[name] = getattr(cfg, name)
    c["work_len"] = cfg.work_len
    c["n_eos"] = len(cfg.eos_ids)
    c["eos_ids"][: len(cfg.eos_ids)] = cfg.eos_ids
    c["n_buckets"] = len(cfg.buckets)
    c["buckets"][: len(cfg.buckets)] = cfg.buckets
    c["prefix_caching"] = int(cfg.prefix_caching)
    c["plan_ahead"] = int(cfg.plan_ahead)
    c["table_size"] = c["lru_size"] = cfg.prefix_table_size
    c["prefix_k0"], c["prefix_k1"] = cfg.prefix_secret
    c["layout_fingerprint"] = layout.fingerprint()


def _field_address(view: np.ndarray, struct: layout.Struct, name: str) -> int:
    return view.ctypes.data + dict((f.name, off) for f, off in struct.offsets())[name]


class _RingProducer:
    """The host end of a ring the device consumes: entries are written at the private tail, and
    publish() makes them visible with one release store of the shared tail index."""

    def __init__(self, ctl: np.ndarray, ring: np.ndarray, tail_field: str, head_field: str):
        self._ring = ring
        self._mask = len(ring) - 1
        self._tail_word = AtomicU32(_field_address(ctl, layout.CONTROL, tail_field))
        self._head_word = AtomicU32(_field_address(ctl, layout.CONTROL, head_field))
        self._tail = self._tail_word.load_acquire()
        self._published = self._tail

    def free_entries(self) -> int:
        return len(self._ring) - (self._tail - self._head_word.load_acquire()) % (1 << 32)

    def publish(self) -> bool:
        """True if anything was new."""
        if self._tail == self._published:
            return False
        self._tail_word.store_release(self._tail)
        self._published = self._tail
        return True


NO_GRAMMAR = 0xFFFFFFFF  # RlSqEntry.grammar_off of a request without a constraint


class SubmissionQueue(_RingProducer):
    """Host end of the SQ: the only writer of sq_tail."""

    def __init__(self, ctl: np.ndarray, sq: np.ndarray):
        super().__init__(ctl, sq, "sq_tail", "sq_head")

    def push(
        self,
        handle: int,
        sampling: SamplingParams,
        *,
        prompt_off: int,
        prompt_len: int,
        priority: int = 0,
        grammar_off: int | None = None,
    ) -> int:
        """Writes one GENERATE (the caller checked free_entries(); `sampling.seed` is resolved,
        None counts as 0); it becomes visible to the device at the next publish().  grammar_off:
        its constraint's automaton in the grammar array (GrammarArena.place), None for none.
        Returns the free-running u32 position it went to: the sq_pos an abort of this request
        names."""
        stop_ids = sampling.stop_token_ids
        pos = self._tail
        e = self._ring[pos & self._mask]
        e["op"], e["handle"] = layout.Op.GENERATE, handle
        e["prompt_off"], e["prompt_len"] = prompt_off & 0xFFFFFFFF, prompt_len
        e["max_tokens"] = sampling.max_tokens
        e["flags"] = (
            (layout.SqFlag.IGNORE_EOS if sampling.ignore_eos else 0)
            | (layout.SqFlag.PENALIZED if sampling.penalized else 0)
            | (layout.SqFlag.LOGPROBS if sampling.logprobs is not None else 0)
            | (layout.SqFlag.PROMPT_LOGPROBS if sampling.prompt_logprobs is not None else 0)
        )
        ring = e["sampling"]
        for name, value in sampling.ring_values().items():
            ring[name] = value
        e["priority"] = priority
        e["n_stop"], e["arrival"] = len(stop_ids), 0
        e["stop_ids"][:] = -1
        e["stop_ids"][: len(stop_ids)] = stop_ids
        e["grammar_off"] = NO_GRAMMAR if grammar_off is None else grammar_off
        self._tail = (pos + 1) & 0xFFFFFFFF
        return pos


class AbortQueue(_RingProducer):
    """Host end of the abort ring: the only writer of aq_tail.  The device empties it every step,
    whatever the SQ and the pending queue hold."""

    def __init__(self, ctl: np.ndarray, aq: np.ndarray):
        super().__init__(ctl, aq, "aq_tail", "aq_head")

    def push(self, handle: int, sq_pos: int, *, if_queued: bool = False) -> bool:
        """Writes one abort of the request whose GENERATE went to SQ position sq_pos (what
        SubmissionQueue.push returned); visible at the next publish().  if_queued: only while
        its prefill has not started (a request in a slot ignores it).  False when full."""
        if self.free_entries() < 1:
            return False
        e = self._ring[self._tail & self._mask]
        e["handle"], e["sq_pos"] = handle, sq_pos & 0xFFFFFFFF
        e["flags"] = layout.AbortFlag.IF_QUEUED if if_queued else 0
        self._tail = (self._tail + 1) & 0xFFFFFFFF
        return True


class CompletionQueue:
    """Host end of the CQ: the only writer of cq_head."""

    def __init__(self, ctl: np.ndarray, cq: np.ndarray, logprobs: np.ndarray):
        self._cq = cq
        self._logprobs = logprobs
        self._size = len(cq)
        self._tail_word = AtomicU32(_field_address(ctl, layout.CONTROL, "cq_tail"))
        self._head_word = AtomicU32(_field_address(ctl, layout.CONTROL, "cq_head"))
        self._head = self._head_word.load_acquire()

    def pending(self) -> int:
        return (self._tail_word.load_acquire() - self._head) & 0xFFFFFFFF

    def take(self) -> np.ndarray:
        """Copies out every published event and hands their entries back to the device."""
        return self.take_with_logprobs(lambda events: False)[0]

    def take_with_logprobs(
        self, wanted: Callable[[np.ndarray], bool]
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """take(), and where `wanted(events)` says so, the cq_logprobs records at the same
        positions (read before the entries go back to the device; None otherwise)."""
        n = self.pending()
        if n == 0:
            return self._cq[:0].copy(), None
        start = self._head % self._size
        events = self._copy(self._cq, start, n)
        records = self._copy(self._logprobs, start, n) if wanted(events) else None
        self._head = (self._head + n) & 0xFFFFFFFF
        self._head_word.store_release(self._head)
        return events, records

    def _copy(self, ring: np.ndarray, start: int, n: int) -> np.ndarray:
        first = min(n, self._size - start)
        out = ring[start : start + first].copy()
        return np.concatenate([out, ring[: n - first]]) if first < n else out


class PromptArena:
    """Allocator for the prompt-token ring.  The device only reads it; tokens stay until the
    host releases them (on the request's first TOKEN or its DONE), and space is reclaimed in
    allocation order, so the arena behaves as a ring with out-of-order release."""

    def __init__(self, arena: np.ndarray):
        self._arena = arena
        self._size = len(arena)
        self._head = 0  # oldest unreleased token (monotonic count)
        self._tail = 0  # next free token (monotonic count)
        self._live: deque[list] = deque()  # [start, length, released] in allocation order
        self._by_start: dict[int, list] = {}
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self._size

    def used(self) -> int:
        return self._tail - self._head

    def can_allocate(self, n: int) -> bool:
        return self._tail - self._head + n <= self._size

    def allocate(self, tokens: np.ndarray) -> int | None:
        """Copies `tokens` in and returns their ring offset, or None when it does not fit."""
        n = len(tokens)
        with self._lock:
            if not self.can_allocate(n):
                return None
            start = self._tail
            i = start % self._size
            first = min(n, self._size - i)
            self._arena[i : i + first] = tokens[:first]
            if first < n:
                self._arena[: n - first] = tokens[first:]
            entry = [start, n, False]
            self._live.append(entry)
            self._by_start[start] = entry
            self._tail += n
            return start

    def release(self, start: int) -> None:
        with self._lock:
            entry = self._by_start.pop(start, None)
            if entry is None:
                return
            entry[2] = True
            while self._live and self._live[0][2]:
                done = self._live.popleft()
                self._head = done[0] + done[1]


class HostRings:
    """The host-shared arrays a backend hands to hostctl."""

    def __init__(self, arrays: dict[str, np.ndarray], cfg: RingConfig):
        self.config = cfg
        self.control = arrays["ctl"]
        self.submissions = SubmissionQueue(arrays["ctl"], arrays["sq"])
        self.aborts = AbortQueue(arrays["ctl"], arrays["aq"])
        self.completions = CompletionQueue(arrays["ctl"], arrays["cq"], arrays["cq_logprobs"])
        self.arena = PromptArena(arrays["arena"])
        # structured output's automata: set by the backend, whose writer knows where the grammar
        # array lives (host memory, or a device copy on CUDA); None: constraints are refused
        self.grammar: GrammarArena | None = None
        self._shutdown = AtomicU32(_field_address(arrays["ctl"], layout.CONTROL, "shutdown"))

    def request_shutdown(self) -> None:
        self._shutdown.store_release(1)

    def arena_words(self, prompt_len: int) -> int:
        """Arena words a prompt takes: its tokens, then two per full page's prefix-cache key."""
        return prompt_len + (2 * (prompt_len // self.config.page_size) if self.config.prefix_caching else 0)

    def can_write_prompt(self, prompt_len: int) -> bool:
        return self.arena.can_allocate(self.arena_words(prompt_len))

    def write_prompt(self, prompt: np.ndarray) -> int | None:
        """Puts a prompt in the arena, followed by its pages' prefix-cache keys; returns the
        offset (the SQ entry's prompt_off), or None when it does not fit."""
        prompt = np.asarray(prompt, dtype=np.int32)
        keys = self.config.prompt_keys(prompt)
        if len(keys):
            prompt = np.concatenate([prompt, keys.view(np.int32)])  # little-endian: low word first
        return self.arena.allocate(prompt)

    def counters(self) -> dict:
        """The control block's counters (ipc/counters.py) and liveness fields, and what follows
        from them: the KV pool's use and the state and exit reason in words."""
        c = self.control[0]
        names = (*(counter.name for counter in COUNTERS), *LIVENESS_FIELDS)
        out: dict[str, int | str | float] = {n: int(c[n]) for n in names}
        total, free = self.config.n_pages, int(c["kv_pages_free"])
        out["kv_pages_total"] = total
        # the share of KV pages held by requests, as vllm's kv_cache_usage_perc (0..1); the
        # counter mirror starts at 0 free before the scheduler first mirrors it
        out["kv_cache_usage_perc"] = (total - free) / total if int(c["state"]) else 0.0
        state, exit_reason = int(c["state"]), int(c["exit_reason"])
        out["state_name"] = layout.STATE_NAMES.get(state, str(state))
        out["exit_reason_name"] = layout.EXIT_REASON_NAMES.get(exit_reason, str(exit_reason))
        return out
