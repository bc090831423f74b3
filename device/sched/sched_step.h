// The continuous-batching scheduler, in two phases per step.
//
// One source, two compilers: NVRTC builds it into the persistent kernel (one thread block, the
// RL_FOR loops spread over its threads), the host C++ compiler into the CPU backend and the
// host-scheduled baseline (RL_FOR is a plain loop).  Requires the generated layout header and
// primitives.h.
//
// sched_critical() runs between two model steps, so it is all the GPU ever waits for.  It
// touches device memory only (no host-shared access: tests/test_sched_phases.py counts them).
// In the steady state (the step that just ran had decode rows only, and the overlapped phase
// found the next one repeats them) it consumes the samples and, if no request ended, advances
// that layout in place (rl_critical_steady).  Otherwise:
//   1. consume the last step's samples: per slot, the token, the stop checks, the event the
//      overlapped phase will write; aborted slots are freed
//   2. build the next step from the slots already admitted: one row per decoding slot first,
//      then prefill chunks in admission order while the token budget lasts; write the layout
//      (every row's KV page is already in its slot's block table; only when 4 found too few
//      free pages does this phase allocate, preempting the least urgent requests)
// The caller then hands the turn to compute, and runs sched_overlapped() while that step runs:
//   3. read the stop request once; apply the abort ring; drain the SQ into the pending queue
//   4. write the TOKEN/DONE events decided in 1 and for cancelled pending requests; publish;
//      slots that ended or were freed give their KV pages back; each decoding slot takes the
//      page its next row needs, one step ahead
//   5. resume preempted requests, then admit pending requests into free slots, as far as the
//      KV pages of their prompts fit, copying their prompts into device memory, for the step
//      after next
//   6. decide the next step's shape: whether it is steady, and under cfg.plan_ahead its bucket,
//      published for the ping-pong launch (sched_loop.h); mirror the counters when due
// The price: a request admitted in 5 runs one step later than if admission sat on the critical
// path (one step of TTFT under load; none when the scheduler was idle, since an idle pass runs
// critical again at once).  In exchange nothing between two steps waits on PCIe.
//
// The source is split by phase: sched_common.h (shared helpers), sched_critical.h,
// sched_overlapped.h, and this file (the serial form and init); sched_prefix.h is the prefix
// cache over the KV pages (keys, table, lru ring, matching), which 2, 4 and 5 call.
#pragma once

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
  if (cfg.magic != RL_MAGIC)
    err = RL_ERR_BAD_MAGIC;
  else if (cfg.version != RL_LAYOUT_VERSION)
    err = RL_ERR_BAD_VERSION;
  else if (cfg.layout_fingerprint != RL_LAYOUT_FINGERPRINT)
    err = RL_ERR_BAD_FINGERPRINT;
  else if (cfg.token_budget < cfg.n_slots || cfg.n_slots == 0 ||
           (cfg.sq_size & (cfg.sq_size - 1)) || (cfg.cq_size & (cfg.cq_size - 1)) ||
           (cfg.arena_size & (cfg.arena_size - 1)) || cfg.work_len < cfg.n_slots ||
           cfg.work_len < cfg.pending_cap || cfg.n_buckets > RL_MAX_BUCKETS ||
           cfg.n_eos > RL_MAX_EOS_IDS || cfg.trace_len == 0 ||
           (cfg.trace_len & (cfg.trace_len - 1)) || cfg.aq_size == 0 ||
           (cfg.aq_size & (cfg.aq_size - 1)) || cfg.page_size == 0 ||
           (cfg.page_size & (cfg.page_size - 1)) ||
           cfg.pages_per_slot != (cfg.max_ctx + cfg.page_size - 1) / cfg.page_size ||
           cfg.n_pages < cfg.pages_per_slot ||  // one request of max_ctx must fit alone
           (cfg.table_size & (cfg.table_size - 1)) || cfg.table_size / 4 < cfg.n_pages ||
           (cfg.lru_size & (cfg.lru_size - 1)) || cfg.lru_size / 4 < cfg.n_pages ||
           cfg.spec_tokens > RL_MAX_SPEC_TOKENS ||
           (cfg.spec_tokens &&
            (cfg.spec_ngram_min == 0 || cfg.spec_ngram_min > cfg.spec_ngram_max ||
             cfg.spec_ngram_max > RL_MAX_SPEC_NGRAM || cfg.spec_window == 0 ||
             cfg.max_ctx > (1u << 24))))
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
    c.slots[s].n_pages = 0;
    c.slots[s].spec_result = 0;
  }
  RL_FOR(p, cfg.sq_size) c.sq_cancel[p] = 0;
  RL_FOR(p, cfg.n_pages) {  // every page free and uncached; the lowest ids on top, handed out first
    c.pages[p].ref_count = 0;
    c.pages[p].table_pos = RL_NO_POS;
    c.pages[p].lru_pos = RL_NO_POS;
    c.pages[p].key = 0;
    c.free_pages[p] = cfg.n_pages - 1 - p;
  }
  RL_FOR(i, cfg.table_size) c.prefix_table[i] = RL_CELL_EMPTY;
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
    st.n_free_pages = cfg.n_pages;
    c.ctl->exit_reason = RL_EXIT_NONE;
    c.ctl->kv_pages_free = cfg.n_pages;
  }
  RL_SYNC();
  return err;
}
