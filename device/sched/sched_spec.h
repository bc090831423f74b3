// Speculative decoding, decided where the batch is built: prompt-lookup (n-gram) drafts that
// the scheduler proposes, lays out as verification rows and accepts or rejects, with no host
// work per step.  Part of the one scheduler source (build.py joins it after sched_grammar.h).
//
// A decoding slot's *match* (RlSlot.spec_match) is a position of its slot_tokens, before its
// newest token, whose token equals the newest and whose preceding tokens equal the ones before
// it (at least cfg.spec_ngram_min of them): the request is repeating text it has seen, so the
// tokens after the match are its draft.  The overlapped phase finds a match for the slots that
// have none (rl_find_matches: longest n-gram first, then the latest place, over the last
// cfg.spec_window positions, every (slot, place) pair on its own thread); the critical phase
// only follows one (rl_follow_match: O(1) per slot), so the GPU never waits for a search.
//
// Verification: a slot with a draft of d tokens gets d + 1 rows in the next step (its newest
// token, then the draft, at consecutive positions: a short prefill chunk against its KV) and a
// sample entry per row, each with the counter of the token it samples.  Consuming, it takes
// row 0's sample, then row i's while the sample before it equalled draft token i.  That is
// exact for greedy and for sampling alike: a draft from a lookup is one token with probability
// 1, for which the rejection-sampling rule (accept with probability min(1, p/q) = p(token),
// else draw from the residual, p without that token, renormalised) is the same as drawing from
// p and comparing; and since each row draws with its token's own counter (the RNG is a hash of
// seed and counter), a seeded request samples exactly the tokens it would without drafts.
// Rejected rows wrote KV at positions beyond the request's tokens: nothing reads them (kv_done
// stops before), and the rows that later hold those positions write them again.
#pragma once

#define RL_SPEC_WAIT_SHIFTS 6u
#define RL_SPEC_MAX_WAIT (1u << RL_SPEC_WAIT_SHIFTS)  // steps a failing slot waits, at most

// Sample entry i of slot s's row in next_token, step_logprobs and slot_logprobs: the slot's own
// for its first (every step samples there, as without drafts), after the n_slots of those for
// a draft row's.
RL_FN uint32_t rl_sample_out(const RlConfig& cfg, uint32_t s, uint32_t i) {
  return i == 0u ? s : cfg.n_slots + s * cfg.spec_tokens + (i - 1u);
}

// A request's draft length at admission: cfg.spec_tokens, 0 (never drafts) where its sampler
// reads state that draft rows would have to see changed (a penalty's token counts, a
// constraint's automaton state).
RL_FN uint32_t rl_spec_k_at_admission(const RlConfig& cfg, const RlSlot& sl) {
  return (sl.flags & RL_FLAG_PENALIZED) || rl_constrained(sl) ? 0u : cfg.spec_tokens;
}

// The position of slot sl's newest token (last_token: the overlapped phase writes it into
// slot_tokens with its event; every earlier one is there).
RL_FN uint32_t rl_newest_pos(const RlSlot& sl) {
  return sl.prompt_len + sl.n_generated - 1u;
}

// Critical, after slot s consumed the step's tokens (`accepted` of its n_draft, then
// last_token): the newest token continues the match when the position after the matched ones
// holds it; else the slot has no match (the overlapped phase searches again).  The draft length
// adapts: doubled (up to cfg.spec_tokens) when every draft token was accepted, else one more
// than were accepted.
RL_FN void rl_follow_match(const RlContext& c, RlSlot& sl, uint32_t s, uint32_t accepted) {
  const RlConfig& cfg = *c.cfg;
  const uint32_t drafted = sl.n_draft;
  if (drafted) {
    uint32_t k = accepted == drafted ? sl.spec_k * 2u : accepted + 1u;
    sl.spec_k = k < cfg.spec_tokens ? k : cfg.spec_tokens;
    sl.spec_result = drafted | (accepted << 16);
    sl.n_draft = 0;
    // a draft rejected whole: the slot waits before it looks again, twice as long each time
    // in a row (1, 2, 4, .. RL_SPEC_MAX_WAIT steps); one accepted token ends the streak
    sl.spec_misses = accepted ? 0u : sl.spec_misses + 1u;
    const uint32_t shift = sl.spec_misses ? sl.spec_misses - 1u : 0u;
    sl.spec_wait = accepted ? 0u : (shift >= RL_SPEC_WAIT_SHIFTS ? RL_SPEC_MAX_WAIT : 1u << shift);
  }
  if (sl.spec_match == RL_NO_MATCH) return;
  const uint32_t at = sl.spec_match + accepted + 1u;  // where the newest token must be
  const bool follows =
      accepted == drafted && at < rl_newest_pos(sl) && rl_slot_tokens(c, s)[at] == sl.last_token;
  sl.spec_match = follows ? at : RL_NO_MATCH;
}

// Critical: the draft slot sl verifies in the next step, the tokens after its match, as many as
// its draft length, the tokens known (slot_tokens holds every position before the newest), its
// request's tokens left after the next one, the context and the pages it holds allow (a draft
// takes no page: rl_grow_pages_ahead gives a drafting slot its next page early instead).
RL_FN uint32_t rl_draft_len(const RlConfig& cfg, const RlSlot& sl) {
  if (sl.state != RL_SLOT_DECODE || sl.spec_match == RL_NO_MATCH || sl.spec_k == 0u) return 0u;
  const uint32_t newest = rl_newest_pos(sl);
  uint32_t k = sl.spec_k;
  const uint32_t known = newest - sl.spec_match - 1u;
  const uint32_t left = sl.max_tokens - sl.n_generated - 1u;  // a running slot has one at least
  const uint32_t held = sl.n_pages * cfg.page_size;
  const uint32_t reach = (held < cfg.max_ctx ? held : cfg.max_ctx) - 1u - newest;
  k = k < known ? k : known;
  k = k < left ? k : left;
  return k < reach ? k : reach;
}

// Whether decoding slot sl looks for a match: it may draft, has none, is not waiting after
// rejected drafts, and has tokens enough.
RL_FN bool rl_wants_match(const RlConfig& cfg, const RlSlot& sl) {
  return sl.state == RL_SLOT_DECODE && sl.spec_k && sl.spec_match == RL_NO_MATCH &&
         sl.spec_wait == 0u && rl_newest_pos(sl) >= cfg.spec_ngram_min;
}

// Overlapped, after the events (slot_tokens then holds every token of every slot): each
// decoding slot that may draft and has no match looks for its last n tokens earlier in its
// prompt and output, n from cfg.spec_ngram_max down to cfg.spec_ngram_min, the latest place
// of the longest; a place is the position of the token equal to the newest.  One thread per
// (slot, place): the best as key (n << 24 | place) by an atomic max.
RL_FN void rl_find_matches(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  uint32_t* searching = c.work_a;  // per slot, then its place among the searching
  uint32_t* which = c.work_b;      // the searching slots, in slot order
  uint32_t* best = c.work_c;       // per slot: the best key found (0: none)
  RL_FOR(s, cfg.n_slots) {
    RlSlot& sl = c.slots[s];
    if (sl.spec_wait && sl.state == RL_SLOT_DECODE) sl.spec_wait -= 1u;  // a step waited
    searching[s] = rl_wants_match(cfg, sl) ? 1u : 0u;
    best[s] = 0u;
  }
  RL_SYNC();
  const uint32_t n_searching = rl_exclusive_scan(searching, cfg.n_slots, sh);
  if (n_searching) {
    RL_FOR(s, cfg.n_slots)
      if (rl_wants_match(cfg, c.slots[s])) which[searching[s]] = s;
    RL_SYNC();
    const uint32_t window = cfg.spec_window;
    RL_FOR(i, n_searching * window) {
      const uint32_t s = which[i / window];
      const RlSlot& sl = c.slots[s];
      const uint32_t newest = rl_newest_pos(sl), back = i % window + 1u;
      if (back > newest) continue;  // place newest - back, at least 0
      const uint32_t place = newest - back;
      const int32_t* tokens = rl_slot_tokens(c, s);
      uint32_t n = 0;
      while (n < cfg.spec_ngram_max && n <= place && tokens[place - n] == tokens[newest - n]) ++n;
      if (n >= cfg.spec_ngram_min) rl_atomic_max(&best[s], (n << 24) | place);
    }
    RL_SYNC();
  }
  RL_FOR(s, cfg.n_slots)
    if (best[s]) c.slots[s].spec_match = best[s] & 0xFFFFFFu;
  RL_SYNC();
}

// Overlapped: the last verifications' drafted and accepted tokens into the counters.
RL_FN void rl_count_verifications(const RlContext& c, RlShared* sh) {
  const RlConfig& cfg = *c.cfg;
  uint32_t my_drafts = 0, my_accepted = 0;
  RL_FOR(s, cfg.n_slots) {
    RlSlot& sl = c.slots[s];
    if (!sl.spec_result) continue;
    my_drafts += (1u << 16) | (sl.spec_result & 0xFFFFu);  // verifications << 16 | drafted
    my_accepted += sl.spec_result >> 16;
    sl.spec_result = 0;
  }
  const uint32_t drafts = rl_block_sum(my_drafts, sh), accepted = rl_block_sum(my_accepted, sh);
  if (RL_LEADER) {
    RlSchedState& st = *c.sched;
    st.spec_drafts += drafts >> 16;
    st.spec_draft_tokens += drafts & 0xFFFFu;
    st.spec_accepted += accepted;
  }
}
