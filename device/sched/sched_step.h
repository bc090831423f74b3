// The continuous-batching scheduler, in two phases per step.
//
// One source, two compilers: NVRTC builds it into the persistent kernel (one thread block, the
// RL_FOR loops spread over its threads), the host C++ compiler into the CPU backend and the
// host-scheduled baseline (RL_FOR is a plain loop).  Requires the generated layout header and
// primitives.h.
//
// sched_critical() runs between two model steps, so it is all the GPU ever waits for.  It
// touches device memory only (no host-shared access: tests/test_sched_phases.py counts them):
//   1. consume the last step's samples: per slot, the token, the stop checks, the event the
//      overlapped phase will write; aborted slots are freed
//   2. build the next step from the slots already admitted: one row per decoding slot first,
//      then prefill chunks in admission order while the token budget lasts; write the layout
// The caller then hands the turn to compute, and runs sched_overlapped() while that step runs:
//   3. read the stop request once; apply the abort ring; drain the SQ into the pending queue
//   4. write the TOKEN/DONE events decided in 1 and for cancelled pending requests; publish
//   5. admit pending requests into the free slots, copying their prompts into device memory,
//      for the step after next
//   6. mirror the counters to the host control block when due
// The price: a request admitted in 5 runs one step later than if admission sat on the critical
// path (one step of TTFT under load; none when the scheduler was idle, since an idle pass runs
// critical again at once).  In exchange nothing between two steps waits on PCIe.
#pragma once

#define RL_SH_SQ_TAIL 0
#define RL_SH_CQ_OK 1
#define RL_SH_STOP 2
#define RL_SH_AQ_TAIL 4  // 3 is kernel.cu's RL_SH_TURN_EXIT

#define RL_MIRROR_STEPS 16u        // counters reach the host at least every this many steps
#define RL_MIRROR_NS 1000000ull    // or after this long, whichever comes first

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
  rl_host_write(&ctl->steps, st.step);
  rl_host_write(&ctl->step_tokens, st.step_tokens);
  rl_host_write(&ctl->generated, st.generated);
  rl_host_write(&ctl->admitted, st.admitted);
  rl_host_write(&ctl->finished, st.finished);
  rl_host_write(&ctl->idle_polls, st.idle_polls);
  rl_host_write(&ctl->cq_stalls, st.cq_stalls);
  rl_host_write(&ctl->aborts, st.aborts);
  rl_host_write(&ctl->pending, (uint64_t)st.n_pending);
  rl_host_write(&ctl->active_slots, (uint64_t)st.n_active);
  rl_host_write(&ctl->last_step_tokens, (uint64_t)st.last_step_tokens);
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

// ---- the critical phase ----------------------------------------------------------------------

// Critical 1: the last step's samples become slot progress and the events to write later.
RL_FN void rl_consume_samples(const RlContext& c) {
  const RlConfig& cfg = *c.cfg;
  RL_FOR(s, cfg.n_slots) {
    RlSlot& sl = c.slots[s];
    if (sl.state == RL_SLOT_ABORTED) {  // its DONE is out; the step that still used it is over
      sl.state = RL_SLOT_FREE;
      sl.sampled = 0;
    } else if (sl.state != RL_SLOT_FREE && sl.sampled) {
      int32_t tok = c.next_token[s];
      sl.sampled = 0;
      sl.n_generated += 1;
      sl.last_token = tok;
      sl.ev_token = 1;
      uint32_t why = rl_finish_reason(cfg, sl, tok);
      if (why != RL_FINISH_NONE) {
        sl.finish = why;
        sl.state = RL_SLOT_ENDING;
      }
    }
  }
  RL_SYNC();
}

// Critical 2: lays out one step under the token budget.  Returns the number of token rows.
RL_FN uint32_t rl_build_step(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  const RlSchedState& st = *c.sched;
  const uint32_t n_queued = st.n_queued;
  uint32_t* dec_rank = c.work_a;  // per slot: rank among decoding slots
  uint32_t* pre_rank = c.work_b;  // per prefill_queue entry: rank among those still prefilling
  uint32_t* before = c.work_c;    // per prefill_queue entry: prompt tokens wanted by earlier ones
  RL_FOR(s, cfg.n_slots) dec_rank[s] = c.slots[s].state == RL_SLOT_DECODE ? 1u : 0u;
  RL_FOR(q, n_queued) {
    const RlSlot& sl = c.slots[c.prefill_queue[q]];
    bool live = sl.state == RL_SLOT_PREFILL;  // an aborted one waits for compaction
    pre_rank[q] = live ? 1u : 0u;
    before[q] = live ? sl.prompt_len - sl.n_prefilled : 0u;
  }
  RL_SYNC();
  uint32_t n_decode = rl_exclusive_scan(dec_rank, cfg.n_slots, sh);
  rl_exclusive_scan(pre_rank, n_queued, sh);
  uint32_t wanted = rl_exclusive_scan(before, n_queued, sh);
  uint32_t budget = cfg.token_budget - n_decode;  // decode rows first: they protect TPOT
  // Segments: decode slots at [0, n_decode), prefill chunks after, in admission order.  A
  // prefilling slot wants at least one token, so `before` rises strictly over live entries and
  // the ones with a chunk are a prefix of them in admission order.
  uint32_t my_prefill_segs = 0;
  RL_FOR(s, cfg.n_slots) {
    if (c.slots[s].state != RL_SLOT_DECODE) continue;
    uint32_t seg = dec_rank[s];
    c.seg_slot[seg] = (int32_t)s;
    c.seg_row_start[seg] = (int32_t)seg;
    c.seg_n_rows[seg] = 1;
  }
  RL_FOR(q, n_queued) {
    uint32_t s = c.prefill_queue[q];
    const RlSlot& sl = c.slots[s];
    if (sl.state != RL_SLOT_PREFILL || before[q] >= budget) continue;
    uint32_t want = sl.prompt_len - sl.n_prefilled;
    uint32_t seg = n_decode + pre_rank[q];
    c.seg_slot[seg] = (int32_t)s;
    c.seg_row_start[seg] = (int32_t)(n_decode + before[q]);
    c.seg_n_rows[seg] = (int32_t)(budget - before[q] < want ? budget - before[q] : want);
    my_prefill_segs += 1;
  }
  uint32_t n_seg = n_decode + rl_block_sum(my_prefill_segs, sh);  // its barrier publishes seg_*
  uint32_t n_rows = n_decode + (wanted < budget ? wanted : budget);
  uint32_t* sample_flag = c.work_a;  // per segment; dec_rank is no longer needed
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
      c.token_ids[row] = c.prompt_copy[(sl.prompt_off + p) & (cfg.arena_size - 1)];
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

// The critical phase: the last step's samples in, the next step's layout out, device memory
// only.  Returns RL_STEP_RUN when the layout holds rows for the model step, else RL_STEP_IDLE.
RL_FN uint32_t sched_critical(const RlContext& c, RlShared* sh) {
  RlSchedState& st = *c.sched;
  if (st.n_active == 0) return RL_STEP_IDLE;  // every slot is FREE: nothing to consume or build
  uint64_t began = rl_now_ns();
  rl_consume_samples(c);
  uint32_t n_rows = rl_build_step(c, sh);
  if (n_rows == 0) return RL_STEP_IDLE;
  if (RL_LEADER) {  // the step's timeline row; the step and the overlapped phase stamp the rest
    uint64_t* t = c.trace + (st.step & (c.cfg->trace_len - 1)) * RL_TRACE_FIELDS;
    t[RL_TRACE_STEP_BEGIN] = t[RL_TRACE_STEP_END] = 0;
    t[RL_TRACE_OVERLAP_BEGIN] = t[RL_TRACE_OVERLAP_END] = 0;
    t[RL_TRACE_FLAGS] = st.chained ? RL_TRACE_CHAINED : 0;
    t[RL_TRACE_SEQ] = st.step + 1;
    t[RL_TRACE_SCHED_BEGIN] = began;
    t[RL_TRACE_SCHED_END] = rl_now_ns();
    c.step->seq = (uint32_t)st.step;
    st.step += 1;
    st.step_tokens += n_rows;
    st.last_step_tokens = n_rows;
    st.chained = 1;
  }
  return RL_STEP_RUN;
}

// ---- the overlapped phase --------------------------------------------------------------------

// Whether `h` is among sorted[0..n) (ascending).
RL_FN bool rl_sorted_contains(const uint32_t* sorted, uint32_t n, uint32_t h) {
  uint32_t lo = 0, hi = n;
  while (lo < hi) {
    uint32_t mid = (lo + hi) / 2;
    if (sorted[mid] < h) lo = mid + 1; else hi = mid;
  }
  return lo < n && sorted[lo] == h;
}

// Overlapped 3a: applies every new abort entry, in batches of up to work_len: the block reads a
// batch from host memory at once; an abort whose GENERATE is still in the SQ (maybe not even
// published) is parked in sq_cancel for the drain; the handles of the others are radix-sorted
// so each pending entry and each slot looks itself up once (O(n log n), not one scan of every
// pending entry and slot per abort).  An abort whose request already finished matches nothing.
// A running request's DONE is written in this same phase; its slot stays out of every new step
// and is freed by the next critical phase, once the step in flight no longer uses it.
RL_FN void rl_apply_aborts(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  const uint32_t head = st.aq_head, tail = sh->u[RL_SH_AQ_TAIL];
  if (head == tail) return;
  const uint32_t sq_head = st.sq_head, n_pending = st.n_pending;
  uint32_t* key = c.work_a;  // per batch entry: the handle if drained, else 0 (handles are never 0)
  uint32_t my_slot_aborts = 0, my_cancelled = 0;
  for (uint32_t base = head; base != tail;) {
    uint32_t m = tail - base < cfg.work_len ? tail - base : cfg.work_len;
    uint32_t my_drained = 0;
    RL_FOR(i, m) {
      RlAbortEntry e = rl_host_read(&c.aq[(base + i) & (cfg.aq_size - 1)]);
      bool in_sq = (int32_t)(e.sq_pos - sq_head) >= 0;
      if (in_sq) c.sq_cancel[e.sq_pos & (cfg.sq_size - 1)] = e.handle;
      key[i] = in_sq ? 0u : e.handle;
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
        if ((sl.state != RL_SLOT_PREFILL && sl.state != RL_SLOT_DECODE) ||
            !rl_sorted_contains(sorted, m, sl.handle))
          continue;
        if (sl.ev_token) {  // an aborted request gets no further tokens
          sl.ev_token = 0;
          sl.n_generated -= 1;
        }
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
    count[s] = sl.state == RL_SLOT_FREE ? 0u : sl.ev_token + (sl.finish != RL_FINISH_NONE ? 1u << 16 : 0u);
  }
  uint32_t n_pending = st.has_cancelled ? st.n_pending : 0u;  // no scan over pending otherwise
  RL_FOR(j, n_pending) pcount[j] = c.pending[j].op == RL_OP_CANCELLED ? 1u : 0u;
  RL_SYNC();
  uint32_t packed = rl_exclusive_scan(count, cfg.n_slots, sh);
  uint32_t n_tokens = packed & 0xFFFFu, n_slot_dones = packed >> 16;
  uint32_t n_slot_events = n_tokens + n_slot_dones;
  uint32_t n_pending_events = rl_exclusive_scan(pcount, n_pending, sh);
  uint32_t total = n_slot_events + n_pending_events;
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
    if (sl.state == RL_SLOT_FREE) continue;
    uint32_t pos = tail + (count[s] & 0xFFFFu) + (count[s] >> 16);
    if (sl.ev_token) {
      rl_put_event(c, pos++, sl.handle, RL_EV_TOKEN, 0, sl.last_token, sl.n_generated - 1, now);
      sl.ev_token = 0;
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
    rl_put_event(c, tail + n_slot_events + pcount[j], e.handle, RL_EV_DONE, RL_FINISH_ABORT,
                 -1, 0, now, rl_clamp_us(now - e.drained_ns));
    e.op = RL_OP_NONE;  // removed by the next compaction
  }
  rl_fence_system();
  RL_SYNC();
  if (RL_LEADER) {
    st.cq_tail = tail + total;
    rl_store_release(&c.ctl->cq_tail, tail + total);
    st.generated += n_tokens;
    st.finished += n_slot_dones + n_pending_events;
    st.aborts += n_pending_events;  // every cancelled pending entry is an abort
  }
  RL_SYNC();
  return true;
}

// Effective priority with aging: one level per aging_steps waited, so nothing starves.  As an
// ascending sort key: the highest priority sorts first; clamped to 32 bits.
RL_FN uint32_t rl_priority_key(const RlConfig& cfg, const RlSqEntry& e, uint64_t step) {
  uint32_t waited = (uint32_t)step - e.arrival;
  int64_t p = (int64_t)e.priority + (int64_t)(waited / (cfg.aging_steps ? cfg.aging_steps : 1u));
  if (p > 0x7FFFFFFFll) p = 0x7FFFFFFFll;
  if (p < -0x80000000ll) p = -0x80000000ll;
  return ~((uint32_t)(int32_t)p ^ 0x80000000u);
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

// Overlapped 5: moves pending requests into free slots (FIFO, or priority with aging; or static
// batching, the baseline that admits only into an empty batch), copies their prompts into
// device memory and queues them for prefill in admission order.
RL_FN void rl_admit(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  rl_compact_prefill_queue(c, sh);
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
  // The admission order: live entries in arrival order, sorted by priority when it decides.
  uint32_t* order = c.work_b;
  RL_FOR(j, n_pending)
    if (c.pending[j].op == RL_OP_GENERATE) order[live[j]] = j;
  RL_SYNC();
  if (cfg.policy == RL_POLICY_PRIORITY && n_live > n_free) {
    uint32_t* key = c.work_a;  // live ranks are spent
    RL_FOR(j, n_pending) key[j] = rl_priority_key(cfg, c.pending[j], st.step);
    RL_SYNC();
    order = rl_radix_sort(key, order, c.work_c, c.work_d, n_live, sh);
  }
  uint32_t* free_rank = c.work_a;  // per slot: its rank among free slots
  uint32_t* slot_for = c.work_d;   // the k-th free slot
  RL_FOR(s, cfg.n_slots) free_rank[s] = c.slots[s].state == RL_SLOT_FREE ? 1u : 0u;
  RL_SYNC();
  rl_exclusive_scan(free_rank, cfg.n_slots, sh);
  RL_FOR(s, cfg.n_slots)
    if (c.slots[s].state == RL_SLOT_FREE && free_rank[s] < n_admit) slot_for[free_rank[s]] = s;
  RL_SYNC();
  uint64_t admit_now = rl_now_ns();
  const uint32_t n_queued = st.n_queued;
  RL_FOR(k, n_admit) {
    RlSqEntry& e = c.pending[order[k]];
    uint32_t s = slot_for[k];
    RlSlot& sl = c.slots[s];
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
    sl.ev_token = 0;
    sl.finish = RL_FINISH_NONE;
    sl.queued_us = rl_clamp_us(admit_now - e.drained_ns);
    sl.state = RL_SLOT_PREFILL;
    c.prefill_queue[n_queued + k] = s;
    e.op = RL_OP_NONE;  // admitted: removed by the compaction below
  }
  RL_SYNC();
  // Prompts into device memory, one request at a time, its tokens spread over the block.  The
  // host wrote them before publishing sq_tail, which an earlier drain acquired.
  for (uint32_t k = 0; k < n_admit; ++k) {
    const RlSlot& sl = c.slots[slot_for[k]];
    uint32_t off = sl.prompt_off, len = sl.prompt_len;
    RL_FOR(t, len) {
      uint32_t p = (off + t) & (cfg.arena_size - 1);
      c.prompt_copy[p] = rl_host_read(&c.arena[p]);
    }
  }
  RL_SYNC();
  if (RL_LEADER) {
    st.n_queued = n_queued + n_admit;
    st.admitted += n_admit;
  }
  rl_compact_pending(c, sh);
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
  if (!rl_emit_events(c, sh)) return RL_STEP_SHUTDOWN;
  rl_admit(c, sh);
  uint32_t my_active = 0;
  RL_FOR(s, cfg.n_slots) my_active += c.slots[s].state != RL_SLOT_FREE;
  uint32_t n_active = rl_block_sum(my_active, sh);
  bool more = n_active > 0 || sh->u[RL_SH_SQ_TAIL] != st.sq_head;
  if (RL_LEADER) {
    uint64_t now = rl_now_ns();
    st.n_active = n_active;
    st.idle = more ? 0u : 1u;
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

// The serial form of one scheduler iteration, for a caller that runs the model step after it
// (the CPU backend, tests): critical, then overlapped; when nothing was built but the
// overlapped phase left work (requests just admitted, aborted slots to free, SQ entries behind a
// full pending queue) both run again, so RL_STEP_IDLE means there is nothing to do.  Returns
// RL_STEP_SHUTDOWN once the exit is marked.  Each pass may publish up to n_slots tokens and
// n_slots + pending_cap DONEs; a caller that reads the CQ on this same thread (not a server,
// whose reader runs beside it) must leave room for every pass, or the call waits for room.
RL_FN uint32_t sched_step(const RlContext& c, RlShared* sh) {
  for (;;) {
    uint32_t built = sched_critical(c, sh);
    uint32_t next = sched_overlapped(c, sh, built == RL_STEP_RUN);
    if (next == RL_STEP_SHUTDOWN) {
      rl_mark_exited(c, sh->u[RL_SH_STOP]);
      return RL_STEP_SHUTDOWN;
    }
    if (built == RL_STEP_RUN || next == RL_STEP_IDLE) return built;
  }
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
    c.slots[s].ev_token = 0;
    c.slots[s].finish = RL_FINISH_NONE;
  }
  RL_FOR(p, cfg.sq_size) c.sq_cancel[p] = 0;
  if (RL_LEADER) {
    RlSchedState& st = *c.sched;
    st = RlSchedState();
    st.sq_head = c.ctl->sq_head;
    st.cq_tail = c.ctl->cq_tail;
    st.cq_head_seen = c.ctl->cq_head;
    st.aq_head = c.ctl->aq_head;
    st.started_ns = rl_now_ns();
    st.mirrored_ns = st.started_ns;
    st.stop_grace_ns = c.ctl->stop_grace_ns;
    st.run_budget_ns = c.ctl->run_budget_ns;
    c.ctl->exit_reason = RL_EXIT_NONE;
  }
  RL_SYNC();
  return err;
}
