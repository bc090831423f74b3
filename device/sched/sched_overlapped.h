// The overlapped phase (steps 3-6 of sched_step.h's order): runs beside the step the critical
// phase built; every access to host-shared memory is here (or in init and exit).
#pragma once

// The first index of sorted[0..n) (ascending) whose value is >= h.
RL_FN uint32_t rl_lower_bound(const uint32_t* sorted, uint32_t n, uint32_t h) {
  uint32_t lo = 0, hi = n;
  while (lo < hi) {
    uint32_t mid = (lo + hi) / 2;
    if (sorted[mid] < h)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// Whether `h` is among sorted[0..n) (ascending).
RL_FN bool rl_sorted_contains(const uint32_t* sorted, uint32_t n, uint32_t h) {
  uint32_t lo = rl_lower_bound(sorted, n, h);
  return lo < n && sorted[lo] == h;
}

// Overlapped 3a: applies every new abort entry, in batches of up to work_len: the block reads a
// batch from host memory at once; an abort whose GENERATE is still in the SQ (maybe not even
// published) is parked in sq_cancel for the drain; the handles of the others are radix-sorted
// so each pending entry and each slot looks itself up once (O(n log n), not one scan of every
// pending entry and slot per abort).  An abort whose request already finished matches nothing.
// A running request's DONE is written in this same phase; its slot stays out of every new step
// and is freed by the next critical phase, once the step in flight no longer uses it.  An
// IF_QUEUED abort (a queue deadline) cancels a request in the SQ or the pending queue only: a
// request in a slot has started its prefill and keeps running.
RL_FN void rl_apply_aborts(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  const uint32_t head = st.aq_head, tail = sh->u[RL_SH_AQ_TAIL];
  if (head == tail) return;
  const uint32_t sq_head = st.sq_head, n_pending = st.n_pending;
  uint32_t* key = c.work_a;  // per batch entry: the handle if drained, else 0 (handles are never 0)
  uint32_t* if_queued = c.work_e;  // per batch entry: its IF_QUEUED bit (scratch until admission)
  uint32_t my_slot_aborts = 0, my_cancelled = 0;
  for (uint32_t base = head; base != tail;) {
    uint32_t m = tail - base < cfg.work_len ? tail - base : cfg.work_len;
    uint32_t my_drained = 0;
    RL_FOR(i, m) {
      RlAbortEntry e = rl_host_read(&c.aq[(base + i) & (cfg.aq_size - 1)]);
      bool in_sq = (int32_t)(e.sq_pos - sq_head) >= 0;
      if (in_sq) c.sq_cancel[e.sq_pos & (cfg.sq_size - 1)] = e.handle;
      key[i] = in_sq ? 0u : e.handle;
      if_queued[i] = e.flags & RL_ABORT_IF_QUEUED;
      c.work_b[i] = i;
      my_drained += in_sq ? 0u : 1u;
    }
    if (rl_block_sum(my_drained, sh) != 0) {  // its barrier: the batch is read
      uint32_t* order = rl_radix_sort(key, c.work_b, c.work_c, c.work_d, m, sh);
      uint32_t* sorted = order == c.work_b ? c.work_c : c.work_b;  // the buffer not holding order
      RL_FOR(r, m) sorted[r] = key[order[r]];
      RL_SYNC();
      RL_FOR(j, n_pending) {
        RlSqEntry& e = c.pending[j];
        if (e.op == RL_OP_GENERATE && rl_sorted_contains(sorted, m, e.handle)) {
          e.op = RL_OP_CANCELLED;
          my_cancelled += 1;
        }
      }
      RL_FOR(s, cfg.n_slots) {
        RlSlot& sl = c.slots[s];
        if (!rl_slot_runs(sl) && sl.state != RL_SLOT_PREEMPTED) continue;
        bool aborted = false;  // by an abort of its handle without IF_QUEUED
        for (uint32_t r = rl_lower_bound(sorted, m, sl.handle); r < m && sorted[r] == sl.handle;
             ++r)
          aborted = aborted || !if_queued[order[r]];
        if (!aborted) continue;
        sl.n_generated -= sl.ev_token;  // an aborted request gets no further tokens
        sl.ev_token = 0;
        sl.state = RL_SLOT_ABORTED;
        sl.finish = RL_FINISH_ABORT;
        my_slot_aborts += 1;
      }
    }
    RL_SYNC();  // the next batch reuses the work arrays
    base += m;
  }
  uint32_t slot_aborts = rl_block_sum(my_slot_aborts, sh);
  uint32_t cancelled = rl_block_sum(my_cancelled, sh);
  if (RL_LEADER) {
    st.aq_head = tail;
    st.aborts += slot_aborts;  // cancelled pending entries are counted as their DONE goes out
    if (cancelled) st.has_cancelled = 1;
    rl_store_release(&c.ctl->aq_head, tail);  // the host may now reuse those entries
  }
  RL_SYNC();
}

// Overlapped 3b: copies new SQ entries into pending, as many as it has room for (the rest
// stays in the SQ, abort marks and all).
RL_FN void rl_drain_sq(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  uint32_t head = st.sq_head, tail = sh->u[RL_SH_SQ_TAIL];
  uint32_t n_pending = st.n_pending;
  uint32_t room = cfg.pending_cap - n_pending;
  uint32_t n_take = tail - head;
  if (n_take > room) n_take = room;
  if (n_take == 0) return;
  uint64_t now = rl_now_ns();
  uint32_t my_cancelled = 0;
  RL_FOR(i, n_take) {
    uint32_t p = (head + i) & (cfg.sq_size - 1);
    RlSqEntry e = rl_host_read(&c.sq[p]);
    if (c.sq_cancel[p] == e.handle) {  // aborted while in the SQ
      e.op = RL_OP_CANCELLED;
      my_cancelled += 1;
    }
    c.sq_cancel[p] = 0;
    e.arrival = (uint32_t)st.step;
    e.drained_ns = now;
    c.pending[n_pending + i] = e;
  }
  uint32_t cancelled = rl_block_sum(my_cancelled, sh);  // its barrier: every entry is read
  if (RL_LEADER) {
    st.sq_head = head + n_take;
    st.n_pending = n_pending + n_take;
    if (cancelled) st.has_cancelled = 1;
    rl_store_release(&c.ctl->sq_head, head + n_take);  // the host may now reuse those entries
  }
  RL_SYNC();
}

// Overlapped 4: writes the events the critical phase decided (TOKEN, DONE of finished slots),
// the DONE of aborted slots and of cancelled pending requests, all reserved and published at
// once.  Returns false if a stop arrived while waiting for CQ room (its reason in
// sh->u[RL_SH_STOP]).
RL_FN bool rl_emit_events(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  // Events per slot packed as tokens + (dones << 16), so one scan yields both counts
  // (n_slots < 65536) and a slot's first event is at low + high of its prefix.
  uint32_t* count = c.work_a;
  uint32_t* pcount = c.work_b;  // DONE per cancelled pending entry, then offsets
  RL_FOR(s, cfg.n_slots) {
    const RlSlot& sl = c.slots[s];
    count[s] =
        sl.state == RL_SLOT_FREE ? 0u : sl.ev_token + (sl.finish != RL_FINISH_NONE ? 1u << 16 : 0u);
  }
  uint32_t n_pending = st.has_cancelled ? st.n_pending : 0u;  // no scan over pending otherwise
  RL_FOR(j, n_pending) pcount[j] = c.pending[j].op == RL_OP_CANCELLED ? 1u : 0u;
  RL_SYNC();
  uint32_t packed = rl_exclusive_scan(count, cfg.n_slots, sh);
  uint32_t n_tokens = packed & 0xFFFFu, n_slot_dones = packed >> 16;
  uint32_t n_slot_events = n_tokens + n_slot_dones;
  uint32_t n_pending_events = rl_exclusive_scan(pcount, n_pending, sh);
  // prompt logprobs kept by the critical phase go first: a request's before its first TOKEN
  const uint32_t n_prompt = st.n_kept_score;
  uint32_t total = n_prompt + n_slot_events + n_pending_events;
  if (total == 0) return true;
  uint32_t tail = st.cq_tail;
  // A full CQ makes the scheduler wait (and count it), never drop an event.  cq_head is read
  // from the host only when the last value read leaves too little room.
  if (RL_LEADER) {
    uint32_t round = 0;
    bool ok = true;
    while (tail + total - st.cq_head_seen > cfg.cq_size) {
      st.cq_head_seen = rl_load_acquire(&c.ctl->cq_head);
      if (tail + total - st.cq_head_seen <= cfg.cq_size) break;
      if (round == 0) {
        st.cq_stalls += 1;
        rl_host_write(&c.ctl->cq_stalls, st.cq_stalls);  // seen at once: the host is behind
      }
      uint32_t why = rl_stop_reason_leader(c, rl_now_ns());
      if (why != RL_EXIT_NONE) {
        sh->u[RL_SH_STOP] = why;
        ok = false;
        break;
      }
      rl_backoff(round++);
    }
    sh->u[RL_SH_CQ_OK] = ok;
  }
  RL_SYNC();
  if (!sh->u[RL_SH_CQ_OK]) return false;
  uint64_t now = rl_now_ns();
  RL_FOR(i, n_prompt) {
    uint32_t pos = (tail + i) & (cfg.cq_size - 1);
    RlCqEvent e = c.kept_score_events[i];
    e.time_ns = now;
    rl_host_write(&c.cq_logprobs[pos], c.kept_logprobs[i]);  // beside its event
    rl_host_write(&c.cq[pos], e);
  }
  const uint32_t first = tail + n_prompt;  // the slots' events, then the pending entries'
  RL_FOR(s, cfg.n_slots) {
    RlSlot& sl = c.slots[s];
    if (sl.state == RL_SLOT_FREE) continue;
    uint32_t pos = first + (count[s] & 0xFFFFu) + (count[s] >> 16);
    if (sl.ev_token) {  // the step's tokens: accepted draft tokens (in slot_tokens), last_token
      int32_t* tokens = rl_slot_tokens(c, s);
      const uint32_t n_ev = sl.ev_token, index0 = sl.n_generated - n_ev;
      for (uint32_t j = 0; j < n_ev; ++j) {
        if (sl.flags & RL_FLAG_LOGPROBS)  // beside its event, before cq_tail is published
          rl_host_write(&c.cq_logprobs[pos & (cfg.cq_size - 1)],
                        c.slot_logprobs[rl_sample_out(cfg, s, j)]);
        int32_t tok = j + 1u == n_ev ? sl.last_token : tokens[sl.prompt_len + index0 + j];
        rl_put_event(c, pos++, sl.handle, RL_EV_TOKEN, 0, tok, index0 + j, now);
      }
      sl.ev_token = 0;
      uint32_t at = rl_newest_pos(sl);  // kept for a recompute after preemption, and lookups
      if (at < cfg.max_ctx) tokens[at] = sl.last_token;
    }
    if (sl.finish != RL_FINISH_NONE) {
      rl_put_event(c, pos, sl.handle, RL_EV_DONE, sl.finish, -1, sl.n_generated, now, sl.queued_us);
      sl.finish = RL_FINISH_NONE;
      if (sl.state == RL_SLOT_ENDING) sl.state = RL_SLOT_FREE;  // ABORTED waits for its step
    }
  }
  RL_FOR(j, n_pending) {
    RlSqEntry& e = c.pending[j];
    if (e.op != RL_OP_CANCELLED) continue;
    rl_put_event(c, first + n_slot_events + pcount[j], e.handle, RL_EV_DONE, RL_FINISH_ABORT, -1, 0,
                 now, rl_clamp_us(now - e.drained_ns));
    e.op = RL_OP_NONE;  // removed by the next compaction
  }
  rl_fence_system();
  RL_SYNC();
  if (RL_LEADER) {
    st.n_kept_score = 0;
    st.cq_tail = tail + total;
    rl_store_release(&c.ctl->cq_tail, tail + total);
    st.generated += n_tokens;
    st.finished += n_slot_dones + n_pending_events;
    st.aborts += n_pending_events;  // every cancelled pending entry is an abort
  }
  RL_SYNC();
  return true;
}

// Overlapped 4b: slots that ended (their DONE just written) or were freed after an abort let go
// of their KV pages, before admission hands pages out: a page no other slot holds goes onto the
// free stack, or into the prefix cache's lru ring if it is cached.  No step reads them: the step
// in flight was built after they stopped running (a slot aborted in this very phase is still
// ABORTED and keeps its pages until the next one).
RL_FN void rl_release_pages(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  uint32_t* to_free = c.work_a;  // per slot: the pages it puts on the free stack, then where
  uint32_t* to_lru = c.work_b;   // per slot: the cached pages it puts in the lru ring, then where
  uint32_t my_releasing = 0;
  RL_FOR(s, cfg.n_slots) {
    const RlSlot& sl = c.slots[s];
    uint32_t n_free = 0, n_lru = 0;
    if ((sl.state == RL_SLOT_FREE || sl.state == RL_SLOT_ENDING) && sl.n_pages) {
      rl_unref_pages(c, sl, s, n_free, n_lru);
      my_releasing += 1;
    }
    to_free[s] = n_free;
    to_lru[s] = n_lru;
  }
  if (rl_block_sum(my_releasing, sh) == 0) return;  // its barrier: every reference is dropped
  const uint32_t n_to_free = rl_exclusive_scan(to_free, cfg.n_slots, sh);
  const uint32_t n_to_lru = rl_exclusive_scan(to_lru, cfg.n_slots, sh);
  const uint32_t top = st.n_free_pages, lru_tail = st.lru_tail;
  RL_FOR(s, cfg.n_slots) {
    RlSlot& sl = c.slots[s];
    if ((sl.state == RL_SLOT_FREE || sl.state == RL_SLOT_ENDING) && sl.n_pages)
      rl_push_unheld(c, sl, s, top + to_free[s], lru_tail + to_lru[s]);
  }
  RL_SYNC();
  if (RL_LEADER) {
    st.n_free_pages = top + n_to_free;
    st.lru_tail = lru_tail + n_to_lru;
    st.n_cached_free += n_to_lru;
  }
  RL_SYNC();
}

// Overlapped 4c: each decoding slot gets, one step ahead, the page its next row will write
// (its row in the step after the one in flight, which adds one more token), so the critical
// phase moves no page; running requests come before admission.  When too few are free it takes
// none and leaves the shortage to the critical phase, which may preempt (this phase cannot: the
// step in flight reads every running slot's pages).
RL_FN void rl_grow_pages_ahead(const RlContext& c, RlShared* sh) {
  RlSchedState& st = *c.sched;
  uint32_t wanted = rl_count_page_needs(c, sh, 1);
  bool fits = wanted <= rl_pages_unheld(st);
  if (fits) rl_evict_for(c, sh, wanted);
  rl_take_needed_pages(c, sh, fits ? wanted : 0u, 1);
  if (RL_LEADER) st.pages_short = fits ? 0u : 1u;
  RL_SYNC();
}

// Removes pending entries that are no longer GENERATE (admitted, or cancelled and answered),
// keeping arrival order.
RL_FN void rl_compact_pending(const RlContext& c, RlShared* sh) {
  RlSchedState& st = *c.sched;
  uint32_t n = st.n_pending;
  uint32_t* keep = c.work_a;
  RL_FOR(j, n) keep[j] = c.pending[j].op == RL_OP_GENERATE ? 1u : 0u;
  RL_SYNC();
  uint32_t n_keep = rl_exclusive_scan(keep, n, sh);
  if (n_keep != n) {
    RL_FOR(j, n)
      if (c.pending[j].op == RL_OP_GENERATE) c.pending_tmp[keep[j]] = c.pending[j];
    RL_SYNC();
    RL_FOR(j, n_keep) c.pending[j] = c.pending_tmp[j];
  }
  RL_SYNC();
  if (RL_LEADER) {
    st.n_pending = n_keep;
    st.has_cancelled = 0;
  }
  RL_SYNC();
}

// Drops prefill_queue entries whose slot no longer prefills (decoding now, or aborted), keeping
// admission order.  Runs before admission appends, so a slot re-admitted later is never found
// twice.
RL_FN void rl_compact_prefill_queue(const RlContext& c, RlShared* sh) {
  RlSchedState& st = *c.sched;
  uint32_t n = st.n_queued;
  if (n == 0) return;
  uint32_t* keep = c.work_a;
  uint32_t* tmp = c.work_b;
  RL_FOR(q, n) keep[q] = c.slots[c.prefill_queue[q]].state == RL_SLOT_PREFILL ? 1u : 0u;
  RL_SYNC();
  uint32_t n_keep = rl_exclusive_scan(keep, n, sh);
  if (n_keep == n) return;
  RL_FOR(q, n)
    if (c.slots[c.prefill_queue[q]].state == RL_SLOT_PREFILL) tmp[keep[q]] = c.prefill_queue[q];
  RL_SYNC();
  RL_FOR(q, n_keep) c.prefill_queue[q] = tmp[q];
  RL_SYNC();
  if (RL_LEADER) st.n_queued = n_keep;
  RL_SYNC();
}

// at[0, n) holds each candidate's page cost, in admission order; turns it into where each one's
// pages start (an exclusive scan) and returns how many candidates, from the first, fit in the
// pages admission may hand out (a prefix: the running sums only grow), with the pages they
// take in *taken.  Candidate k's running sum is where k + 1 starts, so no cost is read twice.
RL_FN uint32_t rl_fitting_prefix(const RlContext& c, RlShared* sh, uint32_t* at, uint32_t n,
                                 uint32_t* taken) {
  RL_SYNC();
  const uint32_t total = rl_exclusive_scan(at, n, sh);
  const uint32_t avail = rl_pages_admittable(*c.cfg, *c.sched);
  uint32_t my_fit = 0;
  RL_FOR(k, n) my_fit += (k + 1 < n ? at[k + 1] : total) <= avail;
  const uint32_t n_fit = rl_block_sum(my_fit, sh);
  *taken = n_fit < n ? at[n_fit] : total;
  return n_fit;
}

// Overlapped 5a: requests preempted for pages come back before new ones, the most urgent first
// (rl_slot_urgency), of those the oldest admission, each once the pages for all it has to
// recompute fit.  Under --policy priority only those at least as urgent as the most urgent
// pending request come back here; *bound is then the urgency of the most urgent one left (no
// limit when none is), and admission takes only pending requests more urgent than it.  Returns
// whether every preempted request that may come back did (new requests are admitted only then:
// a preempted request is never overtaken by one that is not more urgent).
RL_FN bool rl_resume_preempted(const RlContext& c, RlShared* sh, uint32_t* bound) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  *bound = 0xFFFFFFFFu;
  uint32_t* rank = c.work_a;  // per slot: its rank among preempted slots
  RL_FOR(s, cfg.n_slots) rank[s] = c.slots[s].state == RL_SLOT_PREEMPTED ? 1u : 0u;
  RL_SYNC();
  uint32_t n_preempted = rl_exclusive_scan(rank, cfg.n_slots, sh);
  if (n_preempted == 0) return true;
  uint32_t* key = c.work_c;  // per slot: oldest admission sorts first
  RL_FOR(s, cfg.n_slots) {
    const RlSlot& sl = c.slots[s];
    key[s] = ~(st.admit_seq - sl.admit_seq);
    if (sl.state == RL_SLOT_PREEMPTED) c.work_b[rank[s]] = s;
  }
  RL_SYNC();
  uint32_t* order = rl_radix_sort(key, c.work_b, c.work_d, c.work_a, n_preempted, sh);
  uint32_t n_may = n_preempted;  // a prefix of order: those at least as urgent as any pending
  if (cfg.policy == RL_POLICY_PRIORITY) {
    RL_FOR(s, cfg.n_slots) key[s] = rl_slot_urgency(cfg, c.slots[s], st.step);
    RL_SYNC();  // a stable sort by urgency keeps the admission order among equals
    order = rl_radix_sort(key, order, order == c.work_b ? c.work_d : c.work_b, c.work_a,
                          n_preempted, sh);
    uint32_t my_urgent = 0xFFFFFFFFu;
    RL_FOR(j, st.n_pending) {
      const RlSqEntry& e = c.pending[j];
      if (e.op == RL_OP_GENERATE)
        my_urgent = rl_min_u32(my_urgent, rl_priority_key(cfg, e.priority, e.arrival, st.step));
    }
    const uint32_t urgent = rl_block_min(my_urgent, sh);
    uint32_t my_may = 0;
    RL_FOR(k, n_preempted) my_may += key[order[k]] <= urgent;
    n_may = rl_block_sum(my_may, sh);
    if (n_may < n_preempted) *bound = key[order[n_may]];
    if (n_may == 0) return true;
  }
  uint32_t* at = c.work_a;       // per candidate: the pages it would take, then its fresh ones
  uint32_t* matched = c.work_e;  // per candidate: its pages the prefix cache holds
  RL_FOR(k, n_may) {
    const RlSlot& sl = c.slots[order[k]];
    at[k] = rl_pages_for(cfg, sl.fill_len);
    uint32_t cap = cfg.prefix_caching ? (sl.fill_len - 1) / cfg.page_size : 0u;
    // prompt logprobs still to lay out: only the pages of positions already scored may match
    if ((sl.flags & RL_FLAG_PROMPT_LOGPROBS) && sl.n_scored + 1u < sl.prompt_len)
      cap = rl_min_u32(cap, sl.n_scored / cfg.page_size);
    matched[k] = cap < sl.n_keyed ? cap : sl.n_keyed;  // its own pages, if still cached
  }
  RL_SYNC();
  if (cfg.prefix_caching) rl_lookup_prefixes(c, sh, order, n_may, matched, at);
  uint32_t taken;
  const uint32_t n_resume = rl_fitting_prefix(c, sh, at, n_may, &taken);
  if (n_resume == 0) return false;
  RL_FOR(k, n_resume) at[k] = rl_pages_for(cfg, c.slots[order[k]].fill_len) - matched[k];
  const uint32_t from = rl_claim_pages(c, sh, order, n_resume, matched, at);
  const uint32_t n_queued = st.n_queued;
  RL_FOR(k, n_resume) {
    uint32_t s = order[k];
    RlSlot& sl = c.slots[s];
    sl.n_pages = matched[k];
    rl_take_pages(c, sl, s, rl_pages_for(cfg, sl.fill_len) - matched[k], from + at[k]);
    sl.n_prefilled = sl.kv_done = matched[k] * cfg.page_size;
    sl.n_cached = matched[k];
    sl.state = RL_SLOT_PREFILL;
    c.prefill_queue[n_queued + k] = s;
  }
  RL_SYNC();
  if (RL_LEADER) {
    st.n_free_pages = from;
    st.n_queued = n_queued + n_resume;
  }
  RL_SYNC();
  return n_resume == n_may;
}

// A penalized request's token counts (the sampler's penalties read them): its slot's row zeroed,
// then RL_PROMPT_MARK on each token of its prompt (threads that mark one token twice store the
// same word).  Work only for requests with a penalty; the rows of others are left stale, which
// their neutral penalties ignore.
RL_FN void rl_reset_token_counts(const RlContext& c, const uint32_t* slot_for, uint32_t n_admit) {
  const RlConfig& cfg = *c.cfg;
  if (cfg.vocab_size == 0) return;
  for (uint32_t k = 0; k < n_admit; ++k) {
    const RlSlot& sl = c.slots[slot_for[k]];
    if (!(sl.flags & RL_FLAG_PENALIZED)) continue;
    int32_t* row = c.token_counts + (size_t)slot_for[k] * cfg.vocab_size;
    RL_FOR(v, cfg.vocab_size) row[v] = 0;
    RL_SYNC();
    const int32_t* tokens = rl_slot_tokens(c, slot_for[k]);
    RL_FOR(t, sl.prompt_len) {
      uint32_t tok = (uint32_t)tokens[t];
      if (tok < cfg.vocab_size) row[tok] = RL_PROMPT_MARK;
    }
    RL_SYNC();
  }
}

// Overlapped 5: moves pending requests into free slots (FIFO, or priority with aging; or static
// batching, the baseline that admits only into an empty batch) as far as the KV pages of their
// prompts fit, gives them those pages, copies their prompts into device memory and queues them
// for prefill in admission order.
RL_FN void rl_admit(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  rl_compact_prefill_queue(c, sh);
  uint32_t bound;  // admit only pending requests more urgent than this (a preempted one waits)
  if (!rl_resume_preempted(c, sh, &bound)) {
    if (st.has_cancelled) rl_compact_pending(c, sh);
    return;
  }
  uint32_t n_pending = st.n_pending;
  uint32_t my_free = 0;
  RL_FOR(s, cfg.n_slots) my_free += c.slots[s].state == RL_SLOT_FREE;
  uint32_t n_free = rl_block_sum(my_free, sh);
  uint32_t* live = c.work_a;  // per pending entry: its rank among live GENERATE entries
  RL_FOR(j, n_pending) live[j] = c.pending[j].op == RL_OP_GENERATE ? 1u : 0u;
  RL_SYNC();
  uint32_t n_live = rl_exclusive_scan(live, n_pending, sh);
  uint32_t n_admit = n_free < n_live ? n_free : n_live;
  // Static batching (a baseline): a new batch starts only once the whole last one has finished.
  if (cfg.policy == RL_POLICY_STATIC && n_free < cfg.n_slots) n_admit = 0;
  if (n_admit == 0) {
    if (st.has_cancelled) rl_compact_pending(c, sh);
    return;
  }
  // The admission order: live entries in arrival order, sorted by priority under that policy
  // (slots and pages both go to the most urgent first).
  uint32_t* order = c.work_b;
  RL_FOR(j, n_pending)
    if (c.pending[j].op == RL_OP_GENERATE) order[live[j]] = j;
  RL_SYNC();
  if (cfg.policy == RL_POLICY_PRIORITY) {
    uint32_t* key = c.work_a;  // live ranks are spent
    RL_FOR(j, n_pending)
      key[j] = rl_priority_key(cfg, c.pending[j].priority, c.pending[j].arrival, st.step);
    RL_SYNC();
    if (bound != 0xFFFFFFFFu) {  // those not more urgent than a preempted request wait behind it
      uint32_t my_before = 0;
      RL_FOR(j, n_pending) my_before += c.pending[j].op == RL_OP_GENERATE && key[j] < bound;
      const uint32_t n_before = rl_block_sum(my_before, sh);
      if (n_before < n_admit) n_admit = n_before;
    }
    if (n_live > 1) order = rl_radix_sort(key, order, c.work_c, c.work_d, n_live, sh);
  }
  // Slots: the k-th candidate goes to the k-th free slot.
  uint32_t* free_rank = c.work_a;  // per slot: its rank among free slots
  uint32_t* slot_for = c.work_d;   // the k-th free slot
  RL_FOR(s, cfg.n_slots) free_rank[s] = c.slots[s].state == RL_SLOT_FREE ? 1u : 0u;
  RL_SYNC();
  rl_exclusive_scan(free_rank, cfg.n_slots, sh);
  RL_FOR(s, cfg.n_slots)
    if (c.slots[s].state == RL_SLOT_FREE && free_rank[s] < n_admit) slot_for[free_rank[s]] = s;
  // Memory: the first n_admit in order are admitted as far as their prompts' pages fit, less
  // the pages the prefix cache holds for them.
  uint32_t* at = order == c.work_b ? c.work_c : c.work_b;  // per candidate: pages, then fresh ones
  uint32_t* matched = c.work_e;  // per candidate: the pages of its prefix found cached
  RL_FOR(k, n_admit) {
    const RlSqEntry& e = c.pending[order[k]];
    at[k] = rl_pages_for(cfg, e.prompt_len);
    // a request asking for prompt logprobs matches nothing: its prefill scores every position
    // (its pages are still cached for the requests after it)
    const bool scores = (e.flags & RL_FLAG_PROMPT_LOGPROBS) != 0u;
    matched[k] =
        cfg.prefix_caching && e.prompt_len && !scores ? (e.prompt_len - 1) / cfg.page_size : 0u;
  }
  RL_SYNC();
  if (cfg.prefix_caching) {
    // the prompt's page keys, which the host wrote after it in the arena, into the slot's row
    uint32_t* start = c.work_f;
    RL_FOR(k, n_admit) start[k] = c.pending[order[k]].prompt_len / cfg.page_size;
    RL_SYNC();
    const uint32_t n_keys = rl_exclusive_scan(start, n_admit, sh);
    RL_FOR(i, n_keys) {
      uint32_t k = rl_owner_of(start, n_admit, i), j = i - start[k];
      const RlSqEntry& e = c.pending[order[k]];
      uint32_t w = e.prompt_off + e.prompt_len + 2u * j;
      uint64_t lo = (uint32_t)rl_host_read(&c.arena[w & (cfg.arena_size - 1u)]);
      uint64_t hi = (uint32_t)rl_host_read(&c.arena[(w + 1u) & (cfg.arena_size - 1u)]);
      c.slot_keys[(size_t)slot_for[k] * cfg.pages_per_slot + j] = lo | (hi << 32);
    }
    RL_SYNC();
    rl_lookup_prefixes(c, sh, slot_for, n_admit, matched, at);
  }
  uint32_t taken;
  n_admit = rl_fitting_prefix(c, sh, at, n_admit, &taken);
  if (n_admit == 0) {
    if (st.has_cancelled) rl_compact_pending(c, sh);
    return;
  }
  RL_FOR(k, n_admit) at[k] = rl_pages_for(cfg, c.pending[order[k]].prompt_len) - matched[k];
  const uint32_t from = rl_claim_pages(c, sh, slot_for, n_admit, matched, at);
  uint64_t admit_now = rl_now_ns();
  const uint32_t n_queued = st.n_queued, admit_seq = st.admit_seq;
  uint32_t my_queries = 0, my_hits = 0;
  RL_FOR(k, n_admit) {
    RlSqEntry& e = c.pending[order[k]];
    uint32_t s = slot_for[k];
    RlSlot& sl = c.slots[s];
    sl.handle = e.handle;
    sl.prompt_off = e.prompt_off;
    sl.prompt_len = e.prompt_len;
    sl.fill_len = e.prompt_len;
    sl.admit_seq = admit_seq + k;
    sl.priority = e.priority;
    sl.arrival = e.arrival;
    sl.n_pages = matched[k];  // the matched pages are in its block table already
    rl_take_pages(c, sl, s, rl_pages_for(cfg, e.prompt_len) - matched[k], from + at[k]);
    sl.n_prefilled = sl.kv_done = matched[k] * cfg.page_size;  // a hit's prefill is skipped
    sl.n_keyed = cfg.prefix_caching ? e.prompt_len / cfg.page_size : 0u;
    sl.n_cached = matched[k];
    my_queries += e.prompt_len;
    my_hits += matched[k] * cfg.page_size;
    sl.n_generated = 0;
    sl.n_scored = 0;
    sl.max_tokens = e.max_tokens;
    sl.flags = e.flags;
    sl.sampling = e.sampling;
    sl.last_token = -1;
    sl.n_stop = e.n_stop < RL_MAX_STOP_IDS ? e.n_stop : RL_MAX_STOP_IDS;
    for (uint32_t q = 0; q < RL_MAX_STOP_IDS; ++q) sl.stop_ids[q] = e.stop_ids[q];
    rl_grammar_admit(c, sl, e.grammar_off);
    sl.spec_k = rl_spec_k_at_admission(cfg, sl);
    sl.spec_match = RL_NO_MATCH;
    sl.n_draft = sl.draft_from = sl.spec_result = sl.spec_wait = sl.spec_misses = 0;
    sl.sampled = 0;
    sl.ev_token = 0;
    sl.finish = RL_FINISH_NONE;
    sl.queued_us = rl_clamp_us(admit_now - e.drained_ns);
    sl.state = RL_SLOT_PREFILL;
    c.prefill_queue[n_queued + k] = s;
    e.op = RL_OP_NONE;  // admitted: removed by the compaction below
  }
  const uint32_t queries = rl_block_sum(my_queries, sh), hits = rl_block_sum(my_hits, sh);
  // Prompts into the slots' token rows in device memory, one request at a time, its tokens
  // spread over the block.  The host wrote them before publishing sq_tail, which an earlier
  // drain acquired.
  for (uint32_t k = 0; k < n_admit; ++k) {
    const RlSlot& sl = c.slots[slot_for[k]];
    int32_t* tokens = rl_slot_tokens(c, slot_for[k]);
    uint32_t off = sl.prompt_off, len = sl.prompt_len;
    RL_FOR(t, len) tokens[t] = rl_host_read(&c.arena[(off + t) & (cfg.arena_size - 1)]);
  }
  RL_SYNC();
  rl_reset_token_counts(c, slot_for, n_admit);
  if (RL_LEADER) {
    st.n_queued = n_queued + n_admit;
    st.admitted += n_admit;
    st.admit_seq = admit_seq + n_admit;
    st.n_free_pages = from;
    st.prefix_queries += queries;
    st.prefix_hits += hits;
  }
  rl_compact_pending(c, sh);
}

// Leader only, cfg.plan_ahead: the next step's bucket, published while the step before it
// computes, so the graph that will run it picks its branch off the critical path.  The next
// critical phase hands over a step in exactly this bucket (void if all its rows ended).
RL_FN void rl_publish_plan(const RlContext& c, uint32_t bucket) {
  RlSchedState& st = *c.sched;
  const uint32_t parity = (uint32_t)st.step & 1u;  // st.step: the next step's seq
  st.plan_bucket = bucket;
  *(volatile uint32_t*)&c.launch->plan_bucket[parity] = bucket;
  rl_store_turn(&c.launch->plan_seq[parity], (uint32_t)st.step + 1u);  // release: the bucket first
}

// The overlapped phase, run while the step the critical phase built computes (step_built), or
// after an idle critical phase.  Returns RL_STEP_SHUTDOWN when the loop must end (the host
// asked, or the run budget is spent; its RL_EXIT_* reason in sh->u[RL_SH_STOP]; the caller
// marks the exit once no step of its own is in flight), RL_STEP_RUN when the next critical
// phase has work (slots in use, or SQ entries behind a full pending queue), else RL_STEP_IDLE.
RL_FN uint32_t sched_overlapped(const RlContext& c, RlShared* sh, bool step_built) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  uint64_t began = rl_now_ns();
  if (RL_LEADER) {  // the only reads of host indices in a step, and the one look at shutdown
    sh->u[RL_SH_STOP] = rl_stop_reason_leader(c, began);
    sh->u[RL_SH_AQ_TAIL] = rl_load_acquire(&c.ctl->aq_tail);
    sh->u[RL_SH_SQ_TAIL] = rl_load_acquire(&c.ctl->sq_tail);
  }
  RL_SYNC();
  if (sh->u[RL_SH_STOP] != RL_EXIT_NONE) return RL_STEP_SHUTDOWN;
  rl_apply_aborts(c, sh);
  rl_drain_sq(c, sh);
  rl_cache_written_pages(c, sh);  // before emit frees ending slots: their pages are cached too
  if (!rl_emit_events(c, sh)) return RL_STEP_SHUTDOWN;
  if (cfg.spec_tokens) {  // speculative decoding's bookkeeping (sched_spec.h)
    rl_count_verifications(c, sh);
    rl_find_matches(c, sh);
  }
  rl_release_pages(c, sh);
  rl_compact_lru_when_due(c, sh);
  rl_grow_pages_ahead(c, sh);
  rl_admit(c, sh);
  // What the next step will hold at most: every decoding slot whose sample in flight cannot
  // end it by length, and the prefill chunks the budget allows (the full build lays out no
  // more), and whether it repeats the step in flight (sched_critical's steady state).  Leaving
  // out the certain ends keeps a plan from a void step when requests end by max_tokens.
  // Slot counts (each at most n_slots < 2^16) go two to a word: three block sums, not five.
  uint32_t my_active_decode = 0, my_joining_ending = 0, my_want = 0, my_drafts = 0;
  RL_FOR(s, cfg.n_slots) {
    const RlSlot& sl = c.slots[s];
    my_active_decode +=
        (sl.state != RL_SLOT_FREE ? 1u : 0u) | (sl.state == RL_SLOT_DECODE ? 1u << 16 : 0u);
    my_joining_ending +=
        (sl.state == RL_SLOT_PREFILL || sl.state == RL_SLOT_ABORTED ? 1u : 0u) |
        (sl.state == RL_SLOT_DECODE && rl_ends_by_length_next(cfg, sl) ? 1u << 16 : 0u);
    if (sl.state == RL_SLOT_PREFILL) {  // clamped: the sum stays in 32 bits and min() the same
      uint32_t want = sl.fill_len - sl.n_prefilled;
      my_want += want < cfg.token_budget ? want : cfg.token_budget;
    }
    // a slot with a match may lay out a draft next: its rows at most (and no steady step)
    if (cfg.spec_tokens && sl.state == RL_SLOT_DECODE && sl.spec_match != RL_NO_MATCH &&
        !rl_ends_by_length_next(cfg, sl))
      my_drafts += sl.spec_k;
  }
  const uint32_t drafts = cfg.spec_tokens ? rl_block_sum(my_drafts, sh) : 0u;
  const uint32_t active_decode = rl_block_sum(my_active_decode, sh);
  const uint32_t joining_ending = rl_block_sum(my_joining_ending, sh);
  const uint32_t wanted = rl_block_sum(my_want, sh);
  const uint32_t n_active = active_decode & 0xFFFFu, n_decode = active_decode >> 16;
  // draft rows the next step may hold: none while more than cfg.spec_max_batch slots decode
  const uint32_t draft_rows = n_decode <= cfg.spec_max_batch ? drafts : 0u;
  const uint32_t joining = joining_ending & 0xFFFFu, ending = joining_ending >> 16;
  bool more = n_active > 0 || sh->u[RL_SH_SQ_TAIL] != st.sq_head;
  if (RL_LEADER) {
    uint64_t now = rl_now_ns();
    st.n_active = n_active;
    uint32_t in_flight = c.step->n_tokens;
    st.steady_rows = step_built && joining == 0 && ending == 0 && !st.pages_short && n_decode > 0 &&
                             draft_rows == 0 && c.step->n_decode == in_flight &&
                             n_decode == in_flight
                         ? n_decode
                         : 0u;
    uint32_t rows = n_decode - ending + wanted + draft_rows;
    uint32_t planned = rows < cfg.token_budget ? rows : cfg.token_budget;
    if (cfg.plan_ahead && planned > 0) rl_publish_plan(c, rl_bucket_for(cfg, planned));
    *(volatile uint32_t*)&c.launch->idle = more ? 0u : 1u;
    if (!more) {
      st.chained = 0;  // the next step is not waited for: its gap is idle time, not bubble
      if (!step_built) st.idle_polls += 1;
    }
    if (step_built) {
      uint64_t* t = c.trace + ((st.step - 1) & (cfg.trace_len - 1)) * RL_TRACE_FIELDS;
      t[RL_TRACE_OVERLAP_BEGIN] = began;
      t[RL_TRACE_OVERLAP_END] = now;
    }
    // Mirror when due, and when idle with news: idle means nothing pending or active, and
    // every other counter moves with steps or finished requests.  An idle pass without news
    // mirrors only by time (the heartbeat), not on every poll.
    bool news = st.step != st.mirrored_step || st.finished != st.mirrored_finished;
    if ((!more && news) || st.step - st.mirrored_step >= RL_MIRROR_STEPS ||
        now - st.mirrored_ns >= RL_MIRROR_NS)
      rl_mirror_counters(c, now);
  }
  RL_SYNC();
  return more ? RL_STEP_RUN : RL_STEP_IDLE;
}
