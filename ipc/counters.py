"""The scheduler's counters in the control block, declared once.

Each `Counter` below is one u64 (or other scalar) the device scheduler keeps in its own state
(RlSchedState, device memory) and copies into the host's control block (RlControl) with plain
stores; the host only reads them (monitoring, no ordering attached).  Everything else is derived
from COUNTERS, in its order:

- RlControl's counter fields (ipc/layout.py: CONTROL) and their C text;
- the device's copy, the RL_MIRROR_COUNTERS macro of the generated header (ipc/layout.py:
  c_header), which rl_mirror_counters (device/sched/sched_common.h) expands: each counter is
  written from its `mirrored_from`, a C expression over the scheduler's state `st`;
- HostRings.counters() (ipc/rings.py), and so the `stats` reply's `device` object;
- the server's snapshot and its Prometheus families (hostctl/serving/snapshot.py, prometheus.py)
  for every counter with a `series`;
- docs/metrics.md's table of them (`markdown_rows`, kept equal by tests/test_counters.py).

Adding a counter: count it in RlSchedState (ipc/layout.py: SCHED, and the scheduler's C) unless
it copies state kept there already, declare it here, and give docs/metrics.md its row
(`print(markdown_rows("ringleader:"))` prints the table's rows; tests/test_counters.py checks).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Series:
    """A counter's Prometheus family in the server's exporter."""

    name: str  # without the exporter's prefix; prometheus_client adds `_total` to a counter's
    type: str  # "counter" (it only grows) or "gauge"
    help: str  # the family's HELP text

    def __post_init__(self) -> None:
        if self.type not in ("counter", "gauge"):
            raise ValueError(f"series {self.name}: type must be counter or gauge, not {self.type!r}")

    def exposed_name(self, prefix: str) -> str:
        """The name a scrape shows (a counter's samples end in `_total`)."""
        return prefix + self.name + ("_total" if self.type == "counter" else "")


@dataclass(frozen=True)
class Counter:
    name: str  # the RlControl field, HostRings.counters()'s key and the `stats` reply's
    mirrored_from: str  # C expression over the scheduler's RlSchedState `st` the device copies
    unit: str  # docs/metrics.md's unit column
    doc: str  # what it counts, in docs/metrics.md's words
    series: Series | None = None  # exported to Prometheus at scrape (None: only in `stats`)
    kind: str = "u64"  # the RlControl field's scalar (ipc/layout.py's scalar kinds)


# fmt: off
COUNTERS = (
    Counter("steps", "st.step", "steps", "model steps the scheduler built",
            Series("steps", "counter", "Model steps the scheduler built.")),
    Counter("step_tokens", "st.step_tokens", "rows",
            "rows (tokens) those steps computed: prefill chunks and one per decoding slot. "
            "Tokens per step = `rate(step_tokens_total) / rate(steps_total)`",
            Series("step_tokens", "counter", "Rows (tokens) computed by those steps.")),
    Counter("generated", "st.generated", "tokens", "tokens the scheduler wrote to the completion queue"),
    Counter("admitted", "st.admitted", "requests", "requests the scheduler admitted into a batch slot"),
    Counter("finished", "st.finished", "requests",
            "requests whose DONE event the scheduler wrote, aborted ones included"),
    Counter("idle_polls", "st.idle_polls", "passes", "scheduler passes that found nothing to do"),
    Counter("cq_stalls", "st.cq_stalls", "stalls",
            "times the device found the completion queue full and waited for the host",
            Series("cq_stalls", "counter", "Times the device waited for room in the completion queue.")),
    Counter("pending", "st.n_pending", "requests",
            "requests in the device's pending queue (drained from the SQ, not yet in a slot), now"),
    Counter("active_slots", "st.n_active", "slots", "batch slots holding a request, now"),
    Counter("last_step_tokens", "st.last_step_tokens", "rows", "rows of the last step built"),
    Counter("aborts", "st.aborts", "requests", "requests ended by an abort (each also counts in `finished`)"),
    Counter("preemptions", "st.preemptions", "requests",
            "requests preempted when decode ran out of KV pages (each gave its pages back and "
            "recomputes later; vllm's `num_preemptions_total`)",
            Series("num_preemptions", "counter",
                   "Requests preempted when decode ran out of KV pages (each recomputes later).")),
    Counter("kv_pages_free", "st.n_free_pages + st.n_cached_free", "pages",
            "free KV pages, counting cached pages no request holds (evictable), now"),
    Counter("kv_pages_cached", "st.n_cached_free", "pages", "of those, the ones that hold a cached prefix"),
    # in tokens, as vllm counts them
    Counter("prefix_cache_queries", "st.prefix_queries", "tokens",
            "prompt tokens of admitted requests looked up in the prefix cache (vllm's name and unit)",
            Series("prefix_cache_queries", "counter",
                   "Prompt tokens of admitted requests looked up in the prefix cache.")),
    Counter("prefix_cache_hits", "st.prefix_hits", "tokens",
            "of those, the tokens whose KV the prefix cache held, so their prefill was skipped; "
            "hits / queries is the hit rate",
            Series("prefix_cache_hits", "counter",
                   "Prompt tokens whose KV the prefix cache held (their prefill skipped).")),
    # speculative decoding, as vllm counts it
    Counter("spec_drafts", "st.spec_drafts", "drafts",
            "verifications: a decoding request's step that checked a draft (vllm's "
            "`spec_decode_num_drafts_total`)",
            Series("spec_decode_num_drafts", "counter", "Steps in which a request verified a draft.")),
    Counter("spec_draft_tokens", "st.spec_draft_tokens", "tokens",
            "draft tokens those verifications checked (vllm's `spec_decode_num_draft_tokens_total`)",
            Series("spec_decode_num_draft_tokens", "counter", "Draft tokens verified.")),
    Counter("spec_accepted_tokens", "st.spec_accepted", "tokens",
            "of those, the ones accepted (each also a generated token); accepted / draft tokens "
            "is the acceptance rate, and 1 + accepted / drafts the tokens a verification gives "
            "(vllm's `spec_decode_num_accepted_tokens_total`)",
            Series("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.")),
)
# fmt: on

# The counters the server's exporter turns into families, with their series, in COUNTERS' order.
EXPORTED: tuple[tuple[Counter, Series], ...] = tuple((c, c.series) for c in COUNTERS if c.series)


def c_mirror_macro() -> str:
    """RL_MIRROR_COUNTERS(ctl, st), the generated header's (ipc/layout.py: c_header): writes each
    counter to RlControl* ctl from RlSchedState st.  rl_mirror_counters expands it; a macro, as
    rl_host_write is defined after the header."""
    writes = "".join(
        f"    rl_host_write(&ctl->{c.name}, (decltype(ctl->{c.name}))({c.mirrored_from})); \\\n"
        for c in COUNTERS
    )
    return f"#define RL_MIRROR_COUNTERS(ctl, st) \\\n  do {{ \\\n{writes}  }} while (0)"


def markdown_rows(prefix: str) -> str:
    """docs/metrics.md's rows of the control block's counters table; prefix: the exporter's
    (a test keeps the page equal to this)."""
    rows = []
    for c in COUNTERS:
        series = f" `{c.series.exposed_name(prefix)}` ({c.series.type}) " if c.series else " "
        rows.append(f"| `{c.name}` |{series}| {c.unit} | {c.doc} |")
    return "\n".join(rows)
