// sched_step(): one iteration of the continuous-batching scheduler.
//
// One source, two compilers: NVRTC builds it into the persistent kernel (one thread block, the
// RL_FOR loops spread over its threads), the host C++ compiler into the CPU backend and the
// host-scheduled baseline (RL_FOR is a plain loop).  Requires the generated layout header and
// primitives.h.  Order of one step:
//   1. apply the abort ring (pending entries cancelled, slots aborted, or undrained SQ entries
//      marked in sq_cancel), then drain the SQ into the pending queue
//   2. consume the last step's samples: TOKEN events, stop checks, DONE events, free slots;
//      DONE for cancelled pending requests; all events reserved and published at once
//   3. admit pending requests into free slots (FIFO, or priority with aging; or static batching,
//      the baseline that admits only into an empty batch)
//   4. build the step: one row per decoding slot first, then prefill chunks in admission order
//      while the token budget lasts; write the layout the model step reads
// 1-4 repeat while the step has no rows, pending is empty and the SQ still holds entries.
#pragma once

#define RL_SH_SQ_TAIL 0
#define RL_SH_CQ_OK 1
#define RL_SH_STOP 2
#define RL_SH_AQ_TAIL 4  // 3 is kernel.cu's RL_SH_TURN_EXIT
#define RL_SH_ABORT_HANDLE 5
#define RL_SH_ABORT_POS 6
#define RL_SH_ABORT_HIT 7

// Why the scheduler should stop now (RL_EXIT_*), or RL_EXIT_NONE.  Leader thread only: the host
// may write shutdown between two threads' reads, so one thread reads and the block is told.
RL_FN uint32_t rl_stop_reason_leader(const RlContext& c, uint64_t now) {
  if (rl_load_acquire(&c.ctl->shutdown) != 0) return RL_EXIT_SHUTDOWN;
  const RlSchedState& st = *c.sched;
  if (st.run_budget_ns != 0 && now - st.started_ns > st.run_budget_ns) return RL_EXIT_BUDGET;
  return RL_EXIT_NONE;
}

// The stop decision for this step, read once by the leader and broadcast to every thread.
RL_FN uint32_t rl_poll_stop(const RlContext& c, RlShared* sh, uint64_t now) {
  if (RL_LEADER) sh->u[RL_SH_STOP] = rl_stop_reason_leader(c, now);
  RL_SYNC();
  uint32_t why = sh->u[RL_SH_STOP];
  RL_SYNC();  // nobody reuses sh->u before every thread has read it
  return why;
}

// Records why the loop ended; `state = EXITED` is published after it (release).
RL_FN void rl_mark_exited(const RlContext& c, uint32_t why) {
  if (!RL_LEADER) return;
  c.ctl->exit_reason = why;
  rl_fence_system();
  rl_store_release(&c.ctl->state, RL_STATE_EXITED);
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

RL_FN void rl_put_event(const RlContext& c, uint32_t pos, uint32_t handle, uint32_t kind,
                        uint32_t reason, int32_t token, uint32_t index, uint64_t now,
                        uint32_t queued_us = 0) {
  RlCqEvent& e = c.cq[pos & (c.cfg->cq_size - 1)];
  e.handle = handle;
  e.kind = (uint8_t)kind;
  e.finish_reason = (uint8_t)reason;
  e._pad = 0;
  e.token = token;
  e.index = index;
  e.time_ns = now;
  e.queued_us = queued_us;
}

// Phase 1a: applies every new abort entry.  Aborts are rare, so each is handled in turn: the
// leader reads it from host memory once and the block searches pending entries and slots.
RL_FN void rl_apply_aborts(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  uint32_t head = st.aq_head, tail = sh->u[RL_SH_AQ_TAIL];
  if (head == tail) return;
  uint32_t sq_head = st.sq_head, n_pending = st.n_pending;
  uint32_t slot_aborts = 0;  // leader's tally
  for (uint32_t a = head; a != tail; ++a) {
    if (RL_LEADER) {
      RlAbortEntry e = c.aq[a & (cfg.aq_size - 1)];
      sh->u[RL_SH_ABORT_HANDLE] = e.handle;
      sh->u[RL_SH_ABORT_POS] = e.sq_pos;
      sh->u[RL_SH_ABORT_HIT] = 0;
    }
    RL_SYNC();
    uint32_t h = sh->u[RL_SH_ABORT_HANDLE], pos = sh->u[RL_SH_ABORT_POS];
    if ((int32_t)(pos - sq_head) >= 0) {
      // its GENERATE is still in the SQ, maybe not even published: the drain applies the mark
      if (RL_LEADER) c.sq_cancel[pos & (cfg.sq_size - 1)] = h;
    } else {  // drained: pending or running, or already finished (then nothing matches)
      RL_FOR(j, n_pending)
        if (c.pending[j].op == RL_OP_GENERATE && c.pending[j].handle == h)
          c.pending[j].op = RL_OP_CANCELLED;
      RL_FOR(s, cfg.n_slots) {
        RlSlot& sl = c.slots[s];
        if (sl.state != RL_SLOT_FREE && sl.handle == h && !sl.abort) {
          sl.abort = 1;
          sh->u[RL_SH_ABORT_HIT] = 1;  // a live handle is in at most one slot: one writer
        }
      }
    }
    RL_SYNC();
    if (RL_LEADER) slot_aborts += sh->u[RL_SH_ABORT_HIT];
  }
  if (RL_LEADER) {
    st.aq_head = tail;
    c.ctl->aborts += slot_aborts;  // cancelled pending entries are counted as their DONE goes out
    rl_store_release(&c.ctl->aq_head, tail);  // the host may now reuse those entries
  }
}

// Phase 1: applies the abort ring, then copies new SQ entries into pending.  Aborts go first and
// regardless of room, so a full SQ or pending queue never holds one back.
RL_FN void rl_drain_sq(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  if (RL_LEADER) {
    sh->u[RL_SH_AQ_TAIL] = rl_load_acquire(&c.ctl->aq_tail);
    sh->u[RL_SH_SQ_TAIL] = rl_load_acquire(&c.ctl->sq_tail);
  }
  RL_SYNC();
  rl_apply_aborts(c, sh);
  uint32_t head = st.sq_head, tail = sh->u[RL_SH_SQ_TAIL];
  uint32_t n_pending = st.n_pending;
  uint32_t room = cfg.pending_cap - n_pending;
  uint32_t n_take = tail - head;
  if (n_take > room) n_take = room;  // backpressure: the rest stays in the SQ, marks and all
  uint64_t now = rl_now_ns();
  RL_FOR(i, n_take) {
    uint32_t p = (head + i) & (cfg.sq_size - 1);
    RlSqEntry e = c.sq[p];
    if (c.sq_cancel[p] == e.handle) e.op = RL_OP_CANCELLED;  // aborted while in the SQ
    c.sq_cancel[p] = 0;
    e.arrival = (uint32_t)st.step;
    e.drained_ns = now;
    c.pending[n_pending + i] = e;
  }
  rl_fence_system();
  RL_SYNC();
  if (n_take == 0) return;
  if (RL_LEADER) {
    st.sq_head = head + n_take;
    st.n_pending = n_pending + n_take;
    rl_store_release(&c.ctl->sq_head, head + n_take);  // the host may now reuse those entries
  }
  RL_SYNC();
}

// Phase 2: events for last step's samples, finished slots and cancelled pending requests.
// Returns false if a stop arrived while waiting for CQ space (its reason in sh->u[RL_SH_STOP]).
RL_FN bool rl_emit_events(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  // Events per slot packed as tokens + (dones << 16), so one scan yields both counts
  // (n_slots < 65536) and a slot's first event is at low + high of its prefix.
  uint32_t* count = c.work_a;
  uint32_t* reason = c.work_b;  // finish reason per slot
  uint32_t* pcount = c.work_c;  // DONE per cancelled pending entry, then offsets
  RL_FOR(s, cfg.n_slots) {
    RlSlot& sl = c.slots[s];
    uint32_t n = 0, why = RL_FINISH_NONE;
    if (sl.state != RL_SLOT_FREE) {
      if (sl.abort) {
        why = RL_FINISH_ABORT;  // an aborted request gets no further tokens
      } else if (sl.sampled) {
        sl.n_generated += 1;
        n = 1;
        why = rl_finish_reason(cfg, sl, c.next_token[s]);
      }
      if (why != RL_FINISH_NONE) n += 1u << 16;
    }
    count[s] = n;
    reason[s] = why;
  }
  uint32_t n_pending = st.n_pending;
  RL_FOR(j, n_pending) pcount[j] = c.pending[j].op == RL_OP_CANCELLED ? 1u : 0u;
  RL_SYNC();
  uint32_t packed = rl_exclusive_scan(count, cfg.n_slots, sh);
  uint32_t n_tokens = packed & 0xFFFFu, n_slot_dones = packed >> 16;
  uint32_t n_slot_events = n_tokens + n_slot_dones;
  uint32_t n_pending_events = rl_exclusive_scan(pcount, n_pending, sh);
  uint32_t total = n_slot_events + n_pending_events;
  if (total == 0) return true;
  uint32_t tail = st.cq_tail;
  // A full CQ makes the scheduler wait (and count it), never drop an event.
  if (RL_LEADER) {
    uint32_t round = 0;
    bool ok = true;
    while (tail + total - rl_load_acquire(&c.ctl->cq_head) > cfg.cq_size) {
      if (round == 0) c.ctl->cq_stalls += 1;
      uint32_t why = rl_stop_reason_leader(c, rl_now_ns());
      if (why != RL_EXIT_NONE) { sh->u[RL_SH_STOP] = why; ok = false; break; }
      rl_backoff(round++);
    }
    sh->u[RL_SH_CQ_OK] = ok;
  }
  RL_SYNC();
  if (!sh->u[RL_SH_CQ_OK]) return false;
  uint64_t now = rl_now_ns();
  RL_FOR(s, cfg.n_slots) {
    RlSlot& sl = c.slots[s];
    uint32_t pos = tail + (count[s] & 0xFFFFu) + (count[s] >> 16);
    uint32_t why = reason[s];
    if (sl.state == RL_SLOT_FREE) continue;
    if (sl.sampled && !sl.abort) {
      int32_t tok = c.next_token[s];
      rl_put_event(c, pos++, sl.handle, RL_EV_TOKEN, 0, tok, sl.n_generated - 1, now);
      sl.last_token = tok;
    }
    sl.sampled = 0;
    if (why != RL_FINISH_NONE) {
      rl_put_event(c, pos, sl.handle, RL_EV_DONE, why, -1, sl.n_generated, now, sl.queued_us);
      sl.state = RL_SLOT_FREE;
      sl.abort = 0;
    }
  }
  RL_FOR(j, n_pending) {
    RlSqEntry& e = c.pending[j];
    if (e.op != RL_OP_CANCELLED) continue;
    uint64_t waited = (now - e.drained_ns) / 1000u;
    rl_put_event(c, tail + n_slot_events + pcount[j], e.handle, RL_EV_DONE, RL_FINISH_ABORT,
                 -1, 0, now, waited > 0xFFFFFFFFull ? 0xFFFFFFFFu : (uint32_t)waited);
    e.op = RL_OP_NONE;
  }
  rl_fence_system();
  RL_SYNC();
  if (RL_LEADER) {
    st.cq_tail = tail + total;
    rl_store_release(&c.ctl->cq_tail, tail + total);
    c.ctl->generated += n_tokens;
    c.ctl->finished += n_slot_dones + n_pending_events;
    if (n_pending_events) c.ctl->aborts += n_pending_events;  // all of them are aborts
  }
  RL_SYNC();
  return true;
}

// Effective priority with aging: one level per aging_steps waited, so nothing starves.
RL_FN int64_t rl_effective_priority(const RlConfig& cfg, const RlSqEntry& e, uint64_t step) {
  uint32_t waited = (uint32_t)step - e.arrival;
  return (int64_t)e.priority + (int64_t)(waited / (cfg.aging_steps ? cfg.aging_steps : 1u));
}

// Phase 3: move pending requests into free slots, then compact the pending queue.
RL_FN void rl_admit(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  uint32_t n_pending = st.n_pending;
  uint32_t* free_rank = c.work_a;  // per slot: its rank among free slots
  uint32_t* live_rank = c.work_b;  // per pending entry: its rank among live GENERATE entries
  uint32_t* order = c.work_c;      // per pending entry: admission order (>= n_admit: stays)
  RL_FOR(s, cfg.n_slots) free_rank[s] = c.slots[s].state == RL_SLOT_FREE ? 1u : 0u;
  RL_FOR(j, n_pending) live_rank[j] = c.pending[j].op == RL_OP_GENERATE ? 1u : 0u;
  RL_SYNC();
  uint32_t n_free = rl_exclusive_scan(free_rank, cfg.n_slots, sh);
  uint32_t n_live = rl_exclusive_scan(live_rank, n_pending, sh);
  uint32_t n_admit = n_free < n_live ? n_free : n_live;
  // Static batching (a baseline): a new batch starts only once the whole last one has finished.
  if (cfg.policy == RL_POLICY_STATIC && n_free < cfg.n_slots) n_admit = 0;
  bool by_priority = cfg.policy == RL_POLICY_PRIORITY && n_live > n_free;
  RL_FOR(j, n_pending) {
    const RlSqEntry& e = c.pending[j];
    uint32_t rank = 0xFFFFFFFFu;
    if (e.op == RL_OP_GENERATE) {
      if (!by_priority) {
        rank = live_rank[j];  // FIFO: arrival order is pending order
      } else {
        int64_t mine = rl_effective_priority(cfg, e, st.step);
        rank = 0;
        for (uint32_t k = 0; k < n_pending; ++k) {
          const RlSqEntry& o = c.pending[k];
          if (o.op != RL_OP_GENERATE || k == j) continue;
          int64_t theirs = rl_effective_priority(cfg, o, st.step);
          if (theirs > mine || (theirs == mine && k < j)) rank += 1;
        }
      }
    }
    order[j] = rank;
  }
  RL_SYNC();
  uint64_t admit_now = rl_now_ns();
  uint32_t* slot_for = c.work_b;  // live_rank is spent: reuse as "k-th free slot"
  RL_FOR(s, cfg.n_slots)
    if (c.slots[s].state == RL_SLOT_FREE && free_rank[s] < n_admit) slot_for[free_rank[s]] = s;
  RL_SYNC();
  RL_FOR(j, n_pending) {
    uint32_t k = order[j];
    if (k >= n_admit) continue;
    const RlSqEntry& e = c.pending[j];
    RlSlot& sl = c.slots[slot_for[k]];
    sl.handle = e.handle;
    sl.prompt_off = e.prompt_off;
    sl.prompt_len = e.prompt_len;
    sl.n_prefilled = 0;
    sl.n_generated = 0;
    sl.max_tokens = e.max_tokens;
    sl.flags = e.flags;
    sl.temperature = e.temperature;
    sl.top_p = e.top_p;
    sl.top_k = e.top_k;
    sl.last_token = -1;
    sl.seed = e.seed;
    sl.n_stop = e.n_stop < RL_MAX_STOP_IDS ? e.n_stop : RL_MAX_STOP_IDS;
    for (uint32_t q = 0; q < RL_MAX_STOP_IDS; ++q) sl.stop_ids[q] = e.stop_ids[q];
    sl.sampled = 0;
    sl.abort = 0;
    sl.admit_seq = st.admit_seq + k;
    uint64_t waited = (admit_now - e.drained_ns) / 1000u;
    sl.queued_us = waited > 0xFFFFFFFFull ? 0xFFFFFFFFu : (uint32_t)waited;
    sl.state = RL_SLOT_PREFILL;
  }
  RL_SYNC();
  // Compaction keeps live entries that were not admitted, in arrival order.
  uint32_t* keep = c.work_a;
  RL_FOR(j, n_pending) keep[j] = (c.pending[j].op == RL_OP_GENERATE && order[j] >= n_admit);
  RL_SYNC();
  uint32_t n_keep = rl_exclusive_scan(keep, n_pending, sh);
  RL_FOR(j, n_pending)
    if (c.pending[j].op == RL_OP_GENERATE && order[j] >= n_admit) c.pending_tmp[keep[j]] = c.pending[j];
  RL_SYNC();
  RL_FOR(j, n_keep) c.pending[j] = c.pending_tmp[j];
  RL_SYNC();
  if (RL_LEADER) {
    st.n_pending = n_keep;
    st.admit_seq += n_admit;
    c.ctl->admitted += n_admit;
    c.ctl->pending = n_keep;
  }
  RL_SYNC();
}

// Phase 4: lay out one step under the token budget.  Returns the number of token rows.
RL_FN uint32_t rl_build_step(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  uint32_t* dec_rank = c.work_a;  // per slot: rank among decoding slots
  uint32_t* pre_rank = c.work_b;  // per slot: rank among prefilling slots by admission order
  uint32_t* scan = c.work_c;      // per prefill rank: remaining prompt, then its prefix sum
  RL_FOR(s, cfg.n_slots) {
    const RlSlot& sl = c.slots[s];
    dec_rank[s] = sl.state == RL_SLOT_DECODE ? 1u : 0u;
    uint32_t r = 0;
    if (sl.state == RL_SLOT_PREFILL)
      for (uint32_t t = 0; t < cfg.n_slots; ++t)
        r += c.slots[t].state == RL_SLOT_PREFILL && c.slots[t].admit_seq < sl.admit_seq;
    pre_rank[s] = r;
  }
  RL_SYNC();
  uint32_t n_decode = rl_exclusive_scan(dec_rank, cfg.n_slots, sh);
  RL_FOR(s, cfg.n_slots) scan[s] = c.slots[s].state == RL_SLOT_PREFILL ? 1u : 0u;
  RL_SYNC();
  uint32_t n_prefill = rl_exclusive_scan(scan, cfg.n_slots, sh);
  RL_FOR(s, cfg.n_slots) {
    const RlSlot& sl = c.slots[s];
    if (sl.state == RL_SLOT_PREFILL) scan[pre_rank[s]] = sl.prompt_len - sl.n_prefilled;
  }
  RL_SYNC();
  uint32_t wanted = rl_exclusive_scan(scan, n_prefill, sh);  // scan[r]: wanted by ranks before r
  uint32_t budget = cfg.token_budget - n_decode;  // decode rows first: they protect TPOT
  // Segments: decode slots at [0, n_decode), prefill chunks after, in admission order.
  // Samples: decode slots, then prefill slots whose chunk completes the prompt.
  uint32_t* sample_flag = c.work_a;  // reused per segment once dec_rank is no longer needed
  RL_FOR(s, cfg.n_slots) {
    RlSlot& sl = c.slots[s];
    if (sl.state == RL_SLOT_DECODE) {
      uint32_t seg = dec_rank[s];
      c.seg_slot[seg] = (int32_t)s;
      c.seg_row_start[seg] = (int32_t)seg;
      c.seg_n_rows[seg] = 1;
    } else if (sl.state == RL_SLOT_PREFILL) {
      uint32_t before = scan[pre_rank[s]];
      uint32_t want = sl.prompt_len - sl.n_prefilled;
      uint32_t chunk = before >= budget ? 0u : (budget - before < want ? budget - before : want);
      if (chunk > 0) {
        uint32_t seg = n_decode + pre_rank[s];
        c.seg_slot[seg] = (int32_t)s;
        c.seg_row_start[seg] = (int32_t)(n_decode + before);
        c.seg_n_rows[seg] = (int32_t)chunk;
      }
    }
  }
  RL_SYNC();
  // Chunks go to a prefix of the admission order (remaining > 0, so scan is strictly rising):
  // the prefill segments are the ranks whose prefix sum is still under the budget.
  uint32_t lo = 0, hi = n_prefill;
  while (lo < hi) {
    uint32_t mid = (lo + hi) / 2;
    if (scan[mid] < budget) lo = mid + 1; else hi = mid;
  }
  uint32_t n_seg = n_decode + lo;
  uint32_t n_rows = n_decode + (wanted < budget ? wanted : budget);
  RL_FOR(g, n_seg) {
    const RlSlot& sl = c.slots[c.seg_slot[g]];
    bool last_chunk = sl.state == RL_SLOT_DECODE ||
                      sl.n_prefilled + (uint32_t)c.seg_n_rows[g] == sl.prompt_len;
    sample_flag[g] = last_chunk ? 1u : 0u;
  }
  RL_SYNC();
  uint32_t n_samples = rl_exclusive_scan(sample_flag, n_seg, sh);
  // Rows: token, position and slot, found per row by a binary search over segment starts.
  RL_FOR(row, n_rows) {
    uint32_t lo = 0, hi = n_seg;
    while (hi - lo > 1) {
      uint32_t mid = (lo + hi) / 2;
      if ((uint32_t)c.seg_row_start[mid] <= row) lo = mid; else hi = mid;
    }
    uint32_t s = (uint32_t)c.seg_slot[lo];
    const RlSlot& sl = c.slots[s];
    uint32_t k = row - (uint32_t)c.seg_row_start[lo];
    if (sl.state == RL_SLOT_DECODE) {
      c.token_ids[row] = sl.last_token;
      c.positions[row] = (int32_t)(sl.prompt_len + sl.n_generated - 1);
    } else {
      uint32_t p = sl.n_prefilled + k;
      c.token_ids[row] = c.arena[(sl.prompt_off + p) & (cfg.arena_size - 1)];
      c.positions[row] = (int32_t)p;
    }
    c.slot_of[row] = (int32_t)s;
  }
  RL_SYNC();
  // Sampling parameters per sample, and slot progress for the rows just laid out.
  RL_FOR(g, n_seg) {
    uint32_t s = (uint32_t)c.seg_slot[g];
    RlSlot& sl = c.slots[s];
    uint32_t n = (uint32_t)c.seg_n_rows[g];
    bool samples = sl.state == RL_SLOT_DECODE || sl.n_prefilled + n == sl.prompt_len;
    if (samples) {
      uint32_t q = sample_flag[g];
      c.sample_row[q] = c.seg_row_start[g] + (int32_t)n - 1;
      c.sample_slot[q] = (int32_t)s;
      c.sample_temperature[q] = sl.temperature;
      c.sample_top_p[q] = sl.top_p;
      c.sample_top_k[q] = sl.top_k;
      c.sample_seed[q] = sl.seed;
      c.sample_counter[q] = (int32_t)sl.n_generated;
      sl.sampled = 1;
    }
    if (sl.state == RL_SLOT_PREFILL) {
      sl.n_prefilled += n;
      if (sl.n_prefilled == sl.prompt_len) sl.state = RL_SLOT_DECODE;
    }
  }
  // Pad rows up to the bucket so a captured graph of that size can run the step.
  uint32_t bucket = n_rows;
  for (uint32_t b = 0; b < cfg.n_buckets; ++b)
    if (n_rows > 0 && cfg.buckets[b] >= n_rows) { bucket = cfg.buckets[b]; break; }
  if (bucket > cfg.token_budget) bucket = cfg.token_budget;
  RL_FOR(row, bucket - n_rows) {
    c.token_ids[n_rows + row] = 0;
    c.positions[n_rows + row] = 0;
    c.slot_of[n_rows + row] = -1;
  }
  RL_SYNC();
  if (RL_LEADER) {
    c.step->n_tokens = n_rows;
    c.step->bucket = bucket;
    c.step->n_segments = n_seg;
    c.step->n_samples = n_samples;
    c.step->n_decode = n_decode;
  }
  RL_SYNC();
  return n_rows;
}

// One scheduler iteration.  Returns RL_STEP_RUN when the layout holds rows for the model step,
// RL_STEP_IDLE when there is nothing to run, RL_STEP_SHUTDOWN when the loop must end (the host
// asked, or the run budget is spent; ctl->exit_reason says which and state becomes EXITED).
RL_FN uint32_t sched_step(const RlContext& c, RlShared* sh) {
  uint64_t began = rl_now_ns();
  if (RL_LEADER) c.ctl->heartbeat_ns = began;
  uint32_t stop = rl_poll_stop(c, sh, began);
  if (stop != RL_EXIT_NONE) {
    rl_mark_exited(c, stop);
    return RL_STEP_SHUTDOWN;
  }
  uint32_t n_rows;
  do {
    rl_drain_sq(c, sh);
    if (!rl_emit_events(c, sh)) {
      rl_mark_exited(c, sh->u[RL_SH_STOP]);
      return RL_STEP_SHUTDOWN;
    }
    rl_admit(c, sh);
    n_rows = rl_build_step(c, sh);
    // Nothing to run and pending empty, yet the SQ holds more (all that fitted were aborted):
    // take the next entries now, since an idle step sends the host-side loops to sleep.
  } while (n_rows == 0 && c.sched->n_pending == 0 && sh->u[RL_SH_SQ_TAIL] != c.sched->sq_head);
  if (RL_LEADER) {
    RlControl& ctl = *c.ctl;
    if (n_rows > 0) {
      // the timeline row of this step: the step kernels stamp the other two fields
      uint64_t* t = c.trace + (c.sched->step & (c.cfg->trace_len - 1)) * RL_TRACE_FIELDS;
      t[RL_TRACE_SCHED_BEGIN] = began;
      t[RL_TRACE_SCHED_END] = rl_now_ns();
      c.step->seq = (uint32_t)c.sched->step;
      c.sched->step += 1;
      ctl.steps += 1;
      ctl.step_tokens += n_rows;
      ctl.last_step_tokens = n_rows;
    } else {
      ctl.idle_polls += 1;
    }
  }
  RL_FOR(s, c.cfg->n_slots) c.work_a[s] = c.slots[s].state != RL_SLOT_FREE;
  RL_SYNC();
  uint32_t active = rl_exclusive_scan(c.work_a, c.cfg->n_slots, sh);
  if (RL_LEADER) c.ctl->active_slots = active;
  RL_SYNC();
  return n_rows > 0 ? RL_STEP_RUN : RL_STEP_IDLE;
}

// Checks the config the host wrote and clears the scheduler's state.
RL_FN uint32_t sched_init(const RlContext& c) {
  const RlConfig& cfg = *c.cfg;
  uint32_t err = RL_ERR_NONE;
  if (cfg.magic != RL_MAGIC) err = RL_ERR_BAD_MAGIC;
  else if (cfg.version != RL_LAYOUT_VERSION) err = RL_ERR_BAD_VERSION;
  else if (cfg.layout_fingerprint != RL_LAYOUT_FINGERPRINT) err = RL_ERR_BAD_FINGERPRINT;
  else if (cfg.token_budget < cfg.n_slots || cfg.n_slots == 0 ||
           (cfg.sq_size & (cfg.sq_size - 1)) || (cfg.cq_size & (cfg.cq_size - 1)) ||
           (cfg.arena_size & (cfg.arena_size - 1)) || cfg.work_len < cfg.n_slots ||
           cfg.work_len < cfg.pending_cap || cfg.n_buckets > RL_MAX_BUCKETS ||
           cfg.n_eos > RL_MAX_EOS_IDS || cfg.trace_len == 0 ||
           (cfg.trace_len & (cfg.trace_len - 1)) || cfg.aq_size == 0 ||
           (cfg.aq_size & (cfg.aq_size - 1)))
    err = RL_ERR_BAD_CONFIG;
  if (RL_LEADER) {
    c.ctl->error_code = err;
    c.ctl->state = err == RL_ERR_NONE ? RL_STATE_RUNNING : RL_STATE_FAILED;
  }
  if (err != RL_ERR_NONE) return err;
  RL_FOR(s, cfg.n_slots) {
    c.slots[s].state = RL_SLOT_FREE;
    c.slots[s].sampled = 0;
    c.slots[s].abort = 0;
  }
  RL_FOR(p, cfg.sq_size) c.sq_cancel[p] = 0;
  if (RL_LEADER) {
    c.sched->step = 0;
    c.sched->n_pending = 0;
    c.sched->admit_seq = 0;
    c.sched->sq_head = c.ctl->sq_head;
    c.sched->cq_tail = c.ctl->cq_tail;
    c.sched->aq_head = c.ctl->aq_head;
    c.sched->started_ns = rl_now_ns();
    c.sched->stop_grace_ns = c.ctl->stop_grace_ns;
    c.sched->run_budget_ns = c.ctl->run_budget_ns;
    c.ctl->exit_reason = RL_EXIT_NONE;
  }
  RL_SYNC();
  return err;
}
