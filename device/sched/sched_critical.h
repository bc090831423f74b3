// The critical phase (steps 1-2 of sched_step.h's order): runs between two model steps, so it is
// all the GPU waits for; device memory only.
#pragma once

// One sampled token of slot s, sample entry `i` of its step (0, or a verified draft row's):
// slot progress, the penalized request's count, its logprobs record kept, a constrained
// request's automaton state, and the stop checks (a finished request becomes ENDING; a
// completed constraint is a stop).  Returns the RL_FINISH_* code.
RL_FN uint32_t rl_consume_token(const RlContext& c, RlSlot& sl, uint32_t s, int32_t tok,
                                uint32_t i) {
  const RlConfig& cfg = *c.cfg;
  if (sl.max_tokens == 0) {  // a prompt scored only: its prefill's sample is no output
    sl.finish = RL_FINISH_LENGTH;
    sl.state = RL_SLOT_ENDING;
    sl.kv_done = sl.prompt_len;
    return RL_FINISH_LENGTH;
  }
  sl.n_generated += 1;
  sl.last_token = tok;
  sl.ev_token += 1;
  // a penalized request's output counts, before the next step's sampler reads them
  if ((sl.flags & RL_FLAG_PENALIZED) && (uint32_t)tok < cfg.vocab_size)
    c.token_counts[(size_t)s * cfg.vocab_size + (uint32_t)tok] += 1;
  // the step's record of this sample, kept until its event is written (the next step, which
  // runs beside that, overwrites step_logprobs)
  if (sl.flags & RL_FLAG_LOGPROBS) {
    const uint32_t at = rl_sample_out(cfg, s, i);
    c.slot_logprobs[at] = c.step_logprobs[at];
  }
  const bool completed = rl_constrained(sl) && rl_grammar_advance(c, sl, tok);
  uint32_t why = completed ? (uint32_t)RL_FINISH_STOP : rl_finish_reason(cfg, sl, tok);
  if (why != RL_FINISH_NONE) {
    sl.finish = why;
    sl.state = RL_SLOT_ENDING;
    sl.kv_done = sl.prompt_len + sl.n_generated - 1;  // all but its last token's KV is written
  }
  return why;
}

// One sampled slot's tokens: row 0's sample, then, while the sample before equalled the draft
// token its next row was fed, that row's (sched_spec.h); each accepted draft token goes into
// slot_tokens at once (the event of the newest writes it there).  Then the match is followed.
RL_FN uint32_t rl_consume_slot(const RlContext& c, RlSlot& sl, uint32_t s) {
  const RlConfig& cfg = *c.cfg;
  sl.sampled = 0;
  int32_t tok = c.next_token[s];
  uint32_t why = rl_consume_token(c, sl, s, tok, 0u);
  if (!cfg.spec_tokens) return why;
  int32_t* tokens = rl_slot_tokens(c, s);
  uint32_t accepted = 0;
  while (why == RL_FINISH_NONE && accepted < sl.n_draft &&
         tok == tokens[sl.draft_from + accepted]) {
    tokens[rl_newest_pos(sl)] = tok;
    accepted += 1;
    tok = c.next_token[rl_sample_out(cfg, s, accepted)];
    why = rl_consume_token(c, sl, s, tok, accepted);
  }
  rl_follow_match(c, sl, s, accepted);
  return why;
}

// Critical 1a, only after a step with score entries (prompt logprobs): each entry's record and
// PROMPT event are kept for the overlapped phase (the build below rewrites the score arrays and
// the next step step_prompt_logprobs).  A slot aborted meanwhile (its DONE is out) gets handle 0,
// which the host drops.
RL_FN void rl_keep_scores(const RlContext& c, uint32_t n_score) {
  RL_FOR(i, n_score) {
    const RlSlot& sl = c.slots[(uint32_t)c.score_slot[i]];
    RlCqEvent e;
    e.handle = sl.state == RL_SLOT_ABORTED ? 0u : sl.handle;
    e.kind = (uint8_t)RL_EV_PROMPT;
    e.finish_reason = 0;
    e._pad = 0;
    e.token = c.score_token[i];
    e.index = (uint32_t)c.positions[c.score_row[i]] + 1u;  // the scored token's prompt position
    e.time_ns = 0;
    e.queued_us = 0;
    c.kept_score_events[i] = e;
    c.kept_logprobs[i] = c.step_prompt_logprobs[i];
  }
  if (RL_LEADER) c.sched->n_kept_score = n_score;
  RL_SYNC();  // before an aborted slot is freed below
}

// Critical 1: the last step's samples become slot progress and the events to write later
// (the overlapped phase also copies each token into slot_tokens as it writes its event).
RL_FN void rl_consume_samples(const RlContext& c) {
  const RlConfig& cfg = *c.cfg;
  const uint32_t n_score = c.step->n_score;  // the step that just ran's (the build rewrites it)
  if (n_score) rl_keep_scores(c, n_score);
  RL_FOR(s, cfg.n_slots) {
    RlSlot& sl = c.slots[s];
    if (sl.state == RL_SLOT_ABORTED) {  // its DONE is out; the step that still used it is over
      sl.state = RL_SLOT_FREE;          // (its pages go back in the overlapped phase)
      sl.sampled = 0;
    } else if (sl.state != RL_SLOT_FREE && sl.sampled) {
      rl_consume_slot(c, sl, s);
    }
  }
  RL_SYNC();
}

// The leader's record of a step laid out: its timeline row (the step and the overlapped phase
// stamp the rest), its seq in the header, the counters.
RL_FN void rl_note_step(const RlContext& c, uint64_t began, uint32_t n_rows, uint32_t flags) {
  RlSchedState& st = *c.sched;
  uint64_t* t = c.trace + (st.step & (c.cfg->trace_len - 1)) * RL_TRACE_FIELDS;
  t[RL_TRACE_STEP_BEGIN] = t[RL_TRACE_STEP_END] = 0;
  t[RL_TRACE_OVERLAP_BEGIN] = t[RL_TRACE_OVERLAP_END] = 0;
  t[RL_TRACE_FLAGS] = (st.chained ? RL_TRACE_CHAINED : 0) | flags;
  t[RL_TRACE_SEQ] = st.step + 1;
  t[RL_TRACE_SCHED_BEGIN] = began;
  t[RL_TRACE_SCHED_END] = rl_now_ns();
  c.step->seq = (uint32_t)st.step;
  st.step += 1;
  st.step_tokens += n_rows;
  st.last_step_tokens = n_rows;
  st.chained = 1;
  st.plan_bucket = 0;  // a published plan is handed over by this step
}

// Critical 0, the steady state (st.steady_rows = n > 0: the step that just computed had n rows,
// all decode rows, and the overlapped phase found that the next one repeats them: no slot
// joins, is aborted or lacks a page).  Row r is segment r and sample entry r of slot
// seg_slot[r]; each row's sample is consumed and, unless some request ended, the layout is
// advanced in place: the row's token, position and sample counter (and a constrained row's
// mask); slot_of, the other sample fields, the counts and the bucket stay as they are.  WARP:
// run by warp 0 alone (n fits it: no block barrier); else by the block.  Returns 1 when it laid out
// the step (and noted it), 0 when some request ended: its rows' samples are consumed, the full
// build follows (and steady_rows is 0 for it).
template <bool WARP>
RL_FN uint32_t rl_critical_steady(const RlContext& c, uint32_t n, uint64_t began) {
  RlSchedState& st = *c.sched;
  uint32_t ended = 0;
#define RL_STEADY_FOR(r) \
  for (uint32_t r = WARP ? RL_LANE : RL_TID; r < n; r += WARP ? RL_LANES : RL_NTHREADS)
  RL_STEADY_FOR(r) {
    uint32_t s = (uint32_t)c.seg_slot[r];
    RlSlot& sl = c.slots[s];
    ended |= rl_consume_slot(c, sl, s) != RL_FINISH_NONE;
    c.token_ids[r] = sl.last_token;
    c.positions[r] = (int32_t)(sl.prompt_len + sl.n_generated - 1);
    c.sample_counter[r] = (int32_t)sl.n_generated;
  }
  ended = WARP ? rl_warp_any(ended) : rl_block_any(ended);
  if (ended) {
    if (RL_LEADER) st.steady_rows = 0;
    return 0;
  }
  RL_STEADY_FOR(r) {  // the same rows on the same threads: no barrier needed
    RlSlot& sl = c.slots[(uint32_t)c.seg_slot[r]];
    sl.kv_done = sl.prompt_len + sl.n_generated - 1;  // as rl_build_step sets it for decode
    sl.sampled = 1;
    if (rl_constrained(sl)) c.sample_mask[r] = rl_grammar_mask(c, sl);
  }
#undef RL_STEADY_FOR
  if (RL_LEADER) {
    if (st.plan_bucket) c.step->bucket = st.plan_bucket;  // rows [n, bucket) are pad rows already
    rl_note_step(c, began, n, 0);
  }
  return 1;
}

// Leader only, and only when decode is out of pages: preempts running requests until the
// `wanted` new pages fit, the least urgent first (rl_slot_urgency: under --policy priority the
// lowest aged priority), of those the youngest by admission, so the oldest of the most urgent
// always advances.  Each victim lets go of all its pages (its cached ones stay cached: its
// recompute may find them) and waits as PREEMPTED to recompute its prompt and the tokens it
// already produced (those streamed are not sent again: the recompute's last row samples the
// next one).  A serial scan per victim; victims are rare and few.
RL_FN void rl_preempt_least_urgent(const RlContext& c, uint32_t wanted) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  while (wanted > rl_pages_unheld(st)) {
    uint32_t victim = cfg.n_slots, victim_key = 0, youngest_age = 0xFFFFFFFFu;
    for (uint32_t s = 0; s < cfg.n_slots; ++s) {
      const RlSlot& sl = c.slots[s];
      if (!rl_slot_runs(sl)) continue;
      uint32_t key = rl_slot_urgency(cfg, sl, st.step);
      uint32_t age = st.admit_seq - sl.admit_seq;  // wraps safely: admissions, not steps
      if (victim == cfg.n_slots || key > victim_key || (key == victim_key && age < youngest_age)) {
        victim = s;
        victim_key = key;
        youngest_age = age;
      }
    }
    if (victim == cfg.n_slots) return;  // unreachable: a needy slot runs, and is a victim itself
    RlSlot& sl = c.slots[victim];
    if (rl_needs_page(cfg, sl, 0)) wanted -= 1;
    // its newest token's event (which copies it into slot_tokens) is not written yet
    if (sl.n_generated)
      rl_slot_tokens(c, victim)[sl.prompt_len + sl.n_generated - 1] = sl.last_token;
    rl_release_slot_serial(c, sl, victim);
    sl.state = RL_SLOT_PREEMPTED;
    sl.spec_match = RL_NO_MATCH;  // looked for again once it decodes
    sl.fill_len = sl.prompt_len + sl.n_generated;
    sl.n_prefilled = 0;
    st.preemptions += 1;
  }
}

// Critical 2a, only when the overlapped phase could not hand every decoding slot the page its
// next row needs (rl_grow_pages_ahead): the least urgent requests are preempted until they fit.
// Otherwise the critical phase moves no page at all.
RL_FN void rl_grow_pages_short(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  RlSchedState& st = *c.sched;
  if (!st.pages_short) return;
  uint32_t wanted = rl_count_page_needs(c, sh, 0);
  if (wanted > rl_pages_unheld(st)) {
    if (RL_LEADER) rl_preempt_least_urgent(c, wanted);
    RL_SYNC();
    wanted = rl_count_page_needs(c, sh, 0);
  }
  rl_evict_for(c, sh, wanted);
  rl_take_needed_pages(c, sh, wanted, 0);
  if (RL_LEADER) st.pages_short = 0;
  RL_SYNC();
}

// Prompt logprobs: of a slot's prefill positions [from, to), those whose next token is a prompt
// token not yet scored (a request that did not ask: none).  They are a run: [lo, hi).
RL_FN uint32_t rl_scored_rows(const RlSlot& sl, uint32_t from, uint32_t to) {
  if (!(sl.flags & RL_FLAG_PROMPT_LOGPROBS)) return 0u;
  uint32_t lo = from > sl.n_scored ? from : sl.n_scored;
  uint32_t hi = sl.prompt_len > 0u && to > sl.prompt_len - 1u ? sl.prompt_len - 1u : to;
  return hi > lo ? hi - lo : 0u;
}

// Leader, only when some chunk would score: the chunks share cfg.score_rows score entries in
// admission order; a chunk is cut where its share runs out (the rows before its first scored
// one are free), and one left with no row waits for the next step (rank and want 0, as a
// chunk not live).  pre_rank and want are per prefill_queue entry, before their scans.
RL_FN void rl_cap_scored_chunks(const RlContext& c, uint32_t n_queued, uint32_t* pre_rank,
                                uint32_t* want) {
  if (RL_LEADER) {
    uint32_t left = c.cfg->score_rows;
    for (uint32_t q = 0; q < n_queued; ++q) {
      const RlSlot& sl = c.slots[c.prefill_queue[q]];
      if (!pre_rank[q]) continue;
      uint32_t scored = rl_scored_rows(sl, sl.n_prefilled, sl.fill_len);
      if (scored <= left) {
        left -= scored;
        continue;
      }
      uint32_t lo = sl.n_prefilled > sl.n_scored ? sl.n_prefilled : sl.n_scored;
      want[q] = lo - sl.n_prefilled + left;
      left = 0;
      if (want[q] == 0u) pre_rank[q] = 0u;
    }
  }
  RL_SYNC();
}

// Slot s's chunk of n rows from row `row0` (positions from n_prefilled on): its score entries
// from `at` on, each the row whose logits score the next prompt token, that token and the
// count of alternatives its request asked for.
RL_FN void rl_lay_out_scores(const RlContext& c, RlSlot& sl, uint32_t s, int32_t row0, uint32_t n,
                             uint32_t at) {
  uint32_t k = rl_scored_rows(sl, sl.n_prefilled, sl.n_prefilled + n);
  if (k == 0u) return;
  uint32_t lo = sl.n_prefilled > sl.n_scored ? sl.n_prefilled : sl.n_scored;
  const int32_t* tokens = rl_slot_tokens(c, s);
  for (uint32_t j = 0; j < k; ++j) {
    c.score_row[at + j] = row0 + (int32_t)(lo + j - sl.n_prefilled);
    c.score_token[at + j] = tokens[lo + j + 1u];
    c.score_top[at + j] = sl.sampling.prompt_logprobs;
    c.score_slot[at + j] = (int32_t)s;
  }
  sl.n_scored = lo + k;
}

// Critical 2: lays out one step under the token budget, every row's page in its slot's block
// table (prefill pages came at admission, decode pages with rl_grow_pages_ahead).  Returns the
// number of token rows.
RL_FN uint32_t rl_build_step(const RlContext& c, RlShared* sh) {
  rl_grow_pages_short(c, sh);
  const RlConfig& cfg = *c.cfg;
  const RlSchedState& st = *c.sched;
  const uint32_t n_queued = st.n_queued;
  uint32_t* dec_rank = c.work_a;  // per slot: rank among decoding slots
  uint32_t* pre_rank = c.work_b;  // per prefill_queue entry: rank among those still prefilling
  uint32_t* before = c.work_c;    // per prefill_queue entry: prompt tokens wanted by earlier ones
  RL_FOR(s, cfg.n_slots) {
    RlSlot& sl = c.slots[s];
    dec_rank[s] = sl.state == RL_SLOT_DECODE ? 1u : 0u;
    // every step laid out so far has completed: their rows' KV is written (the prefix cache
    // takes full pages up to here)
    if (sl.state == RL_SLOT_DECODE) sl.kv_done = sl.prompt_len + sl.n_generated - 1;
    if (sl.state == RL_SLOT_PREFILL) sl.kv_done = sl.n_prefilled;
  }
  uint32_t my_scoring = 0;
  RL_FOR(q, n_queued) {
    const RlSlot& sl = c.slots[c.prefill_queue[q]];
    bool live = sl.state == RL_SLOT_PREFILL;  // an aborted or preempted one waits for compaction
    pre_rank[q] = live ? 1u : 0u;
    before[q] = live ? sl.fill_len - sl.n_prefilled : 0u;
    my_scoring |= live && rl_scored_rows(sl, sl.n_prefilled, sl.fill_len) > 0u;
  }
  // prompt logprobs: the chunks that score share cfg.score_rows (rl_cap_scored_chunks)
  const bool scoring = rl_block_any(my_scoring) != 0u;
  if (scoring) rl_cap_scored_chunks(c, n_queued, pre_rank, before);
  uint32_t n_decode = rl_exclusive_scan(dec_rank, cfg.n_slots, sh);
  rl_exclusive_scan(pre_rank, n_queued, sh);
  uint32_t wanted = rl_exclusive_scan(before, n_queued, sh);
  // decode rows first: they protect TPOT.  A published plan bounds the rows by its bucket (the
  // plan counted every row this build can lay out, so this only restates it)
  uint32_t limit =
      st.plan_bucket && st.plan_bucket < cfg.token_budget ? st.plan_bucket : cfg.token_budget;
  // speculative decoding: each decoding slot's draft rows right after its row, while at most
  // cfg.spec_max_batch slots decode and all drafts fit the rows left (sched_spec.h)
  uint32_t* draft_at = c.work_d;  // per slot: its draft rows, then how many come before them
  uint32_t n_drafted = 0;
  if (cfg.spec_tokens && n_decode <= cfg.spec_max_batch) {
    RL_FOR(s, cfg.n_slots) {
      RlSlot& sl = c.slots[s];
      draft_at[s] = sl.n_draft = rl_draft_len(cfg, sl);
      sl.draft_from = sl.spec_match + 1u;  // its draft's first token (unused without one)
    }
    RL_SYNC();
    n_drafted = rl_exclusive_scan(draft_at, cfg.n_slots, sh);
    if (n_decode + n_drafted > limit) {  // rare (a small budget): no drafts this step
      RL_FOR(s, cfg.n_slots) draft_at[s] = c.slots[s].n_draft = 0;
      n_drafted = 0;
    }
  } else if (cfg.spec_tokens) {
    RL_FOR(s, cfg.n_slots) draft_at[s] = c.slots[s].n_draft = 0;
  }
  const uint32_t n_decode_rows = n_decode + n_drafted;
  uint32_t budget = limit > n_decode_rows ? limit - n_decode_rows : 0u;
  // Segments: decode slots at [0, n_decode), prefill chunks after, in admission order.  A
  // prefilling slot wants at least one token, so `before` rises strictly over live entries and
  // the ones with a chunk are a prefix of them in admission order.
  uint32_t my_prefill_segs = 0;
  RL_FOR(s, cfg.n_slots) {
    if (c.slots[s].state != RL_SLOT_DECODE) continue;
    uint32_t seg = dec_rank[s];
    c.seg_slot[seg] = (int32_t)s;
    c.seg_row_start[seg] = (int32_t)(seg + (cfg.spec_tokens ? draft_at[s] : 0u));
    c.seg_n_rows[seg] = (int32_t)(1u + (cfg.spec_tokens ? c.slots[s].n_draft : 0u));
  }
  RL_FOR(q, n_queued) {
    uint32_t s = c.prefill_queue[q];
    const RlSlot& sl = c.slots[s];
    // its rows wanted, as capped: the scan's step to the next entry
    uint32_t want = (q + 1u < n_queued ? before[q + 1u] : wanted) - before[q];
    if (sl.state != RL_SLOT_PREFILL || want == 0u || before[q] >= budget) continue;
    uint32_t seg = n_decode + pre_rank[q];
    c.seg_slot[seg] = (int32_t)s;
    c.seg_row_start[seg] = (int32_t)(n_decode_rows + before[q]);
    c.seg_n_rows[seg] = (int32_t)(budget - before[q] < want ? budget - before[q] : want);
    my_prefill_segs += 1;
  }
  uint32_t n_seg = n_decode + rl_block_sum(my_prefill_segs, sh);  // its barrier publishes seg_*
  uint32_t n_rows = n_decode_rows + (wanted < budget ? wanted : budget);
  uint32_t* sample_flag = c.work_a;  // per segment: its samples; dec_rank is no longer needed
  uint32_t* score_at = c.work_b;     // per segment: its score entries, then where they start
  RL_FOR(g, n_seg) {
    const RlSlot& sl = c.slots[c.seg_slot[g]];
    // a decoding slot samples every row (its draft's verification), a prefill its last chunk's last
    bool last_chunk = sl.n_prefilled + (uint32_t)c.seg_n_rows[g] == sl.fill_len;
    sample_flag[g] = sl.state == RL_SLOT_DECODE ? (uint32_t)c.seg_n_rows[g] : last_chunk ? 1u : 0u;
    if (scoring)
      score_at[g] =
          sl.state == RL_SLOT_PREFILL
              ? rl_scored_rows(sl, sl.n_prefilled, sl.n_prefilled + (uint32_t)c.seg_n_rows[g])
              : 0u;
  }
  RL_SYNC();
  uint32_t n_samples = rl_exclusive_scan(sample_flag, n_seg, sh);
  uint32_t n_score = scoring ? rl_exclusive_scan(score_at, n_seg, sh) : 0u;
  // Rows: token, position and slot, found per row by a binary search over segment starts.
  const uint32_t* seg_start = (const uint32_t*)c.seg_row_start;  // never negative
  RL_FOR(row, n_rows) {
    uint32_t lo = rl_owner_of(seg_start, n_seg, row);
    uint32_t s = (uint32_t)c.seg_slot[lo];
    const RlSlot& sl = c.slots[s];
    uint32_t k = row - (uint32_t)c.seg_row_start[lo];
    if (sl.state == RL_SLOT_DECODE) {  // its newest token, then its draft's
      c.token_ids[row] = k == 0u ? sl.last_token : rl_slot_tokens(c, s)[sl.draft_from + k - 1u];
      c.positions[row] = (int32_t)(rl_newest_pos(sl) + k);
    } else {
      uint32_t p = sl.n_prefilled + k;
      c.token_ids[row] = rl_slot_tokens(c, s)[p];
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
    if (sl.state == RL_SLOT_DECODE) {  // each row samples the token after it
      for (uint32_t i = 0; i < n; ++i) {
        uint32_t q = sample_flag[g] + i;
        c.sample_row[q] = c.seg_row_start[g] + (int32_t)i;
        c.sample_slot[q] = (int32_t)rl_sample_out(cfg, s, i);
        c.sample_params[q] = sl.sampling;
        c.sample_mask[q] = rl_grammar_mask(c, sl);  // a constrained slot has no draft
        c.sample_counter[q] = (int32_t)(sl.n_generated + i);
      }
      sl.sampled = 1;
    } else if (sl.n_prefilled + n == sl.fill_len) {
      uint32_t q = sample_flag[g];
      c.sample_row[q] = c.seg_row_start[g] + (int32_t)n - 1;
      c.sample_slot[q] = (int32_t)s;
      c.sample_params[q] = sl.sampling;
      c.sample_mask[q] = rl_grammar_mask(c, sl);
      c.sample_counter[q] = (int32_t)sl.n_generated;
      sl.sampled = 1;
    }
    if (sl.state == RL_SLOT_PREFILL) {
      if (scoring) rl_lay_out_scores(c, sl, s, c.seg_row_start[g], n, score_at[g]);
      sl.n_prefilled += n;
      if (sl.n_prefilled == sl.fill_len) sl.state = RL_SLOT_DECODE;
    }
  }
  // Pad rows up to the bucket so a captured graph of that size can run the step: the
  // published plan's, whose graph already chose its branch, else the smallest that holds them.
  uint32_t bucket = st.plan_bucket ? st.plan_bucket : rl_bucket_for(cfg, n_rows);
  rl_pad_rows(c, n_rows, bucket);
  RL_SYNC();
  if (RL_LEADER) {
    c.step->n_tokens = n_rows;
    c.step->bucket = bucket;
    c.step->n_segments = n_seg;
    c.step->n_samples = n_samples;
    c.step->n_decode = n_decode;
    c.step->n_score = n_score;
  }
  RL_SYNC();
  return n_rows;
}

// The critical phase: the last step's samples in, the next step's layout out, device memory
// only.  Returns RL_STEP_RUN when the layout holds rows for the model step (or, a plan being
// published, a void step of pad rows only), else RL_STEP_IDLE.  began: when the caller's warp
// began it (the persistent loop's steady try), else 0.
RL_FN uint32_t sched_critical(const RlContext& c, RlShared* sh, uint64_t began = 0) {
  RlSchedState& st = *c.sched;
  if (st.n_active == 0) return RL_STEP_IDLE;  // every slot is FREE: nothing to consume or build
  if (began == 0) began = rl_now_ns();
  uint32_t steady = st.steady_rows;
  if (steady && rl_critical_steady<false>(c, steady, began)) return RL_STEP_RUN;
  rl_consume_samples(c);
  uint32_t n_rows = rl_build_step(c, sh);
  const bool void_step = n_rows == 0 && st.plan_bucket != 0;
  if (n_rows == 0 && !void_step) return RL_STEP_IDLE;
  if (RL_LEADER) rl_note_step(c, began, n_rows, void_step ? RL_TRACE_VOID : 0);
  return RL_STEP_RUN;
}
