// Structured output where the batch is decided (ipc/automaton.py's format, RL_AUTO_*): a
// constrained slot's automaton state, advanced by each token it samples in the critical phase,
// and the mask its next sample reads (sample_mask).  Device memory only: the host copied the
// automaton into `grammar` before it published the request.
#pragma once

RL_FN bool rl_constrained(const RlSlot& sl) {
  return sl.grammar_off != RL_NO_GRAMMAR;
}

// State s's record in automaton a.
RL_FN const int32_t* rl_auto_state(const int32_t* a, uint32_t s) {
  return a + a[RL_AUTO_H_STATES_AT] + s * RL_AUTO_STATE_WORDS;
}

// The word offset in `grammar` of the bitmask the slot's next sample must obey, or
// RL_AUTO_NO_MASK for a slot without a constraint.
RL_FN int32_t rl_grammar_mask(const RlContext& c, const RlSlot& sl) {
  if (!rl_constrained(sl)) return RL_AUTO_NO_MASK;
  const int32_t* a = c.grammar + sl.grammar_off;
  const int32_t* st = rl_auto_state(a, sl.grammar_state);
  return (int32_t)sl.grammar_off + a[RL_AUTO_H_MASKS_AT] +
         st[RL_AUTO_S_MASK] * a[RL_AUTO_H_MASK_WORDS];
}

// The state token `tok` leads to from state s: two dependent reads, its class, then the next
// table's entry; RL_AUTO_END for an EOS, and for a token the state does not allow (which the
// sampler never draws).
RL_FN int32_t rl_grammar_next(const int32_t* a, uint32_t s, int32_t tok) {
  if (tok < 0 || tok >= a[RL_AUTO_H_VOCAB]) return RL_AUTO_END;
  const int32_t cls = a[a[RL_AUTO_H_CLASSES_AT] + tok];
  return a[a[RL_AUTO_H_NEXT_AT] + (int32_t)s * a[RL_AUTO_H_N_CLASSES] + cls];
}

// A constrained slot's sampled token consumed: its state advanced.  Returns whether the
// constraint ends the request (`stop`): an EOS in an accepting state (under ignore_eos an EOS
// leaves the state as it was, and the request goes on), or a TERMINAL state reached (accepting,
// and nothing but an EOS could follow: no step is spent on that EOS).
RL_FN bool rl_grammar_advance(const RlContext& c, RlSlot& sl, int32_t tok) {
  const int32_t* a = c.grammar + sl.grammar_off;
  int32_t next = rl_grammar_next(a, sl.grammar_state, tok);
  if (next == RL_AUTO_END) {
    if (sl.flags & RL_FLAG_IGNORE_EOS)
      for (uint32_t k = 0; k < c.cfg->n_eos; ++k)
        if (c.cfg->eos_ids[k] == tok) return false;
    return true;
  }
  sl.grammar_state = (uint32_t)next;
  return (rl_auto_state(a, (uint32_t)next)[RL_AUTO_S_FLAGS] & RL_AUTO_TERMINAL) != 0;
}

// At admission: the slot takes its request's automaton, at its initial state.
RL_FN void rl_grammar_admit(const RlContext& c, RlSlot& sl, uint32_t grammar_off) {
  sl.grammar_off = grammar_off;
  sl.grammar_state =
      grammar_off == RL_NO_GRAMMAR ? 0u : (uint32_t)c.grammar[grammar_off + RL_AUTO_H_INITIAL];
}
