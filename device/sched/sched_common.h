// What both scheduler phases share: shared-memory slots, the counter mirror, the exit record,
// the stop checks and the CQ event writer.  Part of the one scheduler source (see sched_step.h
// for the whole step order); build.py concatenates primitives.h, this file, sched_critical.h,
// sched_overlapped.h and sched_step.h, in that order.
#pragma once

#define RL_SH_SQ_TAIL 0
#define RL_SH_CQ_OK 1
#define RL_SH_STOP 2
#define RL_SH_AQ_TAIL 4  // 3 is sched_loop.h's RL_SH_TURN_EXIT

#define RL_NO_MATCH 0xFFFFFFFFu  // RlSlot.spec_match of a slot with none (sched_spec.h)

#define RL_MIRROR_STEPS 16u      // counters reach the host at least every this many steps
#define RL_MIRROR_NS 1000000ull  // or after this long, whichever comes first

// Why the scheduler should stop now (RL_EXIT_*), or RL_EXIT_NONE.  Leader thread only: the host
// may write shutdown between two threads' reads, so one thread reads and the block is told.
RL_FN uint32_t rl_stop_reason_leader(const RlContext& c, uint64_t now) {
  if (rl_load_acquire(&c.ctl->shutdown) != 0) return RL_EXIT_SHUTDOWN;
  const RlSchedState& st = *c.sched;
  if (st.run_budget_ns != 0 && now - st.started_ns > st.run_budget_ns) return RL_EXIT_BUDGET;
  return RL_EXIT_NONE;
}

// Leader only: copies the device-side counters to the host control block (plain stores).
RL_FN void rl_mirror_counters(const RlContext& c, uint64_t now) {
  RlSchedState& st = *c.sched;
  RlControl* ctl = c.ctl;
  rl_host_write(&ctl->heartbeat_ns, now);
  RL_MIRROR_COUNTERS(ctl, st);  // each counter of ipc/counters.py (generated, the layout header)
  st.mirrored_ns = now;
  st.mirrored_step = st.step;
  st.mirrored_finished = st.finished;
}

// Records why the loop ended; `state = EXITED` is published after it (release).
RL_FN void rl_mark_exited(const RlContext& c, uint32_t why) {
  if (!RL_LEADER) return;
  rl_mirror_counters(c, rl_now_ns());
  rl_host_write(&c.ctl->exit_reason, why);
  rl_fence_system();
  rl_store_release(&c.ctl->state, (uint32_t)RL_STATE_EXITED);
}

// The smallest bucket that holds n_rows rows (a captured graph of that size runs the step),
// at most the token budget.
RL_FN uint32_t rl_bucket_for(const RlConfig& cfg, uint32_t n_rows) {
  uint32_t bucket = n_rows;
  for (uint32_t b = 0; b < cfg.n_buckets; ++b)
    if (n_rows > 0 && cfg.buckets[b] >= n_rows) {
      bucket = cfg.buckets[b];
      break;
    }
  return bucket > cfg.token_budget ? cfg.token_budget : bucket;
}

// Rows [from, to) of the layout made pad rows (no slot: their KV goes to the scratch page).
RL_FN void rl_pad_rows(const RlContext& c, uint32_t from, uint32_t to) {
  RL_FOR(k, to - from) {
    c.token_ids[from + k] = 0;
    c.positions[from + k] = 0;
    c.slot_of[from + k] = -1;
  }
}

// Stop checks for a slot that just received `tok`; returns an RL_FINISH_* code.
RL_FN uint32_t rl_finish_reason(const RlConfig& cfg, const RlSlot& s, int32_t tok) {
  if (!(s.flags & RL_FLAG_IGNORE_EOS))
    for (uint32_t k = 0; k < cfg.n_eos; ++k)
      if (cfg.eos_ids[k] == tok) return RL_FINISH_STOP;
  for (uint32_t k = 0; k < s.n_stop; ++k)
    if (s.stop_ids[k] == tok) return RL_FINISH_STOP;
  if (s.n_generated >= s.max_tokens) return RL_FINISH_LENGTH;
  if (s.prompt_len + s.n_generated >= cfg.max_ctx) return RL_FINISH_LENGTH;
  return RL_FINISH_NONE;
}

// Whether the sample a step in flight gives slot `sl` must end its request by length, whatever
// the token (rl_finish_reason's length checks one token ahead): its row will not be laid out.
RL_FN bool rl_ends_by_length_next(const RlConfig& cfg, const RlSlot& sl) {
  return sl.sampled &&
         (sl.n_generated + 1 >= sl.max_tokens || sl.prompt_len + sl.n_generated + 1 >= cfg.max_ctx);
}

RL_FN void rl_put_event(const RlContext& c, uint32_t pos, uint32_t handle, uint32_t kind,
                        uint32_t reason, int32_t token, uint32_t index, uint64_t now,
                        uint32_t queued_us = 0) {
  RlCqEvent e;
  e.handle = handle;
  e.kind = (uint8_t)kind;
  e.finish_reason = (uint8_t)reason;
  e._pad = 0;
  e.token = token;
  e.index = index;
  e.time_ns = now;
  e.queued_us = queued_us;
  rl_host_write(&c.cq[pos & (c.cfg->cq_size - 1)], e);  // one write of the whole event
}

RL_FN uint32_t rl_clamp_us(uint64_t ns) {
  uint64_t us = ns / 1000u;
  return us > 0xFFFFFFFFull ? 0xFFFFFFFFu : (uint32_t)us;
}

// The last k < n with start[k] <= i (start: ascending, e.g. an exclusive scan): the segment
// or candidate whose flattened item i is.
RL_FN uint32_t rl_owner_of(const uint32_t* start, uint32_t n, uint32_t i) {
  uint32_t lo = 0, hi = n;
  while (hi - lo > 1) {
    uint32_t mid = (lo + hi) / 2;
    if (start[mid] <= i)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// ---- KV pages ----------------------------------------------------------------------------
// The pool is n_pages pages; free_pages[0, n_free_pages) is a stack of the free ones (uncached:
// the prefix cache's unheld pages wait in its lru ring, sched_prefix.h, and are evicted onto
// the stack when it runs short).  A batch of allocations takes the stack's top
// [n_free_pages - taken, n_free_pages), each slot its own range found by a scan, and a batch of
// releases pushes above the top the same way.  Only the scheduler touches pages, free_pages and
// block_table (the step reads block_table), always between two steps or beside one that cannot
// read the pages concerned.

RL_FN uint32_t rl_pages_for(const RlConfig& cfg, uint32_t n_tokens) {
  return (n_tokens + cfg.page_size - 1) / cfg.page_size;
}

// Slot s's row of slot_tokens (max_ctx token ids).
RL_FN int32_t* rl_slot_tokens(const RlContext& c, uint32_t s) {
  return c.slot_tokens + (size_t)s * c.cfg->max_ctx;
}

// Effective priority with aging: one level per aging_steps waited since arrival, so nothing
// starves.  As an ascending sort key: the most urgent sorts first; clamped to 32 bits.  A
// pending request and a slot's (its SQ entry's priority and arrival) compare on one scale.
RL_FN uint32_t rl_priority_key(const RlConfig& cfg, int32_t priority, uint32_t arrival,
                               uint64_t step) {
  uint32_t waited = (uint32_t)step - arrival;
  int64_t p = (int64_t)priority + (int64_t)(waited / (cfg.aging_steps ? cfg.aging_steps : 1u));
  if (p > 0x7FFFFFFFll) p = 0x7FFFFFFFll;
  if (p < -0x80000000ll) p = -0x80000000ll;
  return ~((uint32_t)(int32_t)p ^ 0x80000000u);
}

// How urgent a running or preempted slot is, as the same key (smaller: more urgent): under
// --policy priority its request's aged priority; otherwise all are equal (0) and admission
// order alone decides.
RL_FN uint32_t rl_slot_urgency(const RlConfig& cfg, const RlSlot& sl, uint64_t step) {
  return cfg.policy == RL_POLICY_PRIORITY ? rl_priority_key(cfg, sl.priority, sl.arrival, step)
                                          : 0u;
}

// Whether slot s runs in steps (and so holds pages).
RL_FN bool rl_slot_runs(const RlSlot& sl) {
  return sl.state == RL_SLOT_PREFILL || sl.state == RL_SLOT_DECODE;
}

// Appends free_pages[from, from + n) to slot s's block table.
RL_FN void rl_take_pages(const RlContext& c, RlSlot& sl, uint32_t s, uint32_t n, uint32_t from) {
  int32_t* table = c.block_table + (size_t)s * c.cfg->pages_per_slot;
  for (uint32_t j = 0; j < n; ++j) {
    uint32_t page = c.free_pages[from + j];
    c.pages[page].ref_count = 1;
    table[sl.n_pages + j] = (int32_t)page;
  }
  sl.n_pages += n;
}

// Pages that can be had: the free ones and the cached ones no slot holds (evicted on demand).
RL_FN uint32_t rl_pages_unheld(const RlSchedState& st) {
  return st.n_free_pages + st.n_cached_free;
}

// Pages admission may hand out: the unheld ones less a 1% watermark while any are held, so a
// new request does not take the pages running ones are about to grow into (and get preempted
// at once); an empty pool gives all, so one request of max_ctx always fits alone.
RL_FN uint32_t rl_pages_admittable(const RlConfig& cfg, const RlSchedState& st) {
  uint32_t unheld = rl_pages_unheld(st);
  uint32_t reserve = unheld < cfg.n_pages ? cfg.n_pages / 100u : 0u;
  return unheld > reserve ? unheld - reserve : 0u;
}

// Whether decoding slot `sl` lacks the page of its next row: position prompt_len + n_generated
// - 1, where `ahead` counts the tokens a step in flight may still add (and, for speculative
// decoding, the draft its next step may verify), up to the context.  A multiply, not
// rl_pages_for's divide: this runs per slot per step.
RL_FN bool rl_needs_page(const RlConfig& cfg, const RlSlot& sl, uint32_t ahead) {
  uint32_t reach = sl.prompt_len + sl.n_generated + ahead;
  return sl.state == RL_SLOT_DECODE &&
         (reach < cfg.max_ctx ? reach : cfg.max_ctx) > sl.n_pages * cfg.page_size;
}

// rl_needs_page's `ahead` for slot sl in the overlapped phase (one_ahead 1) or after the
// samples were consumed (0): the step in flight adds a token, and as many more as its draft
// has; a slot with a match may verify spec_k more in the next step (no page is taken for a
// draft in the critical phase: without that page the draft is cut short).
RL_FN uint32_t rl_rows_ahead(const RlConfig& cfg, const RlSlot& sl, uint32_t one_ahead) {
  if (!one_ahead) return 0u;
  uint32_t in_flight = sl.sampled ? 1u + sl.n_draft : 0u;
  return in_flight + (cfg.spec_tokens && sl.spec_match != RL_NO_MATCH ? sl.spec_k : 0u);
}

// Marks in work_a (then exclusive-scans) the decoding slots that lack their next row's page;
// returns how many.  ahead: 1 beside a step in flight (rl_rows_ahead).
RL_FN uint32_t rl_count_page_needs(const RlContext& c, RlShared* sh, uint32_t ahead) {
  const RlConfig& cfg = *c.cfg;
  RL_FOR(s, cfg.n_slots) {
    const RlSlot& sl = c.slots[s];
    c.work_a[s] = rl_needs_page(cfg, sl, rl_rows_ahead(cfg, sl, ahead)) ? 1u : 0u;
  }
  RL_SYNC();
  return rl_exclusive_scan(c.work_a, cfg.n_slots, sh);
}

// Gives each slot rl_count_page_needs marked its page: the `wanted` (<= n_free_pages) off the
// top of the free list, each slot at its scanned offset.
RL_FN void rl_take_needed_pages(const RlContext& c, RlShared* sh, uint32_t wanted, uint32_t ahead) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  if (wanted == 0) return;
  const uint32_t from = st.n_free_pages - wanted;
  RL_FOR(s, cfg.n_slots) {
    RlSlot& sl = c.slots[s];
    if (rl_needs_page(cfg, sl, rl_rows_ahead(cfg, sl, ahead)))
      rl_take_pages(c, sl, s, 1, from + c.work_a[s]);
  }
  RL_SYNC();
  if (RL_LEADER) st.n_free_pages = from;
  RL_SYNC();
}
