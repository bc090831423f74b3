// What both scheduler phases share: shared-memory slots, the counter mirror, the exit record,
// the stop checks and the CQ event writer.  Part of the one scheduler source (see sched_step.h
// for the whole step order); build.py concatenates primitives.h, this file, sched_critical.h,
// sched_overlapped.h and sched_step.h, in that order.
#pragma once

#define RL_SH_SQ_TAIL 0
#define RL_SH_CQ_OK 1
#define RL_SH_STOP 2
#define RL_SH_AQ_TAIL 4  // 3 is sched_loop.h's RL_SH_TURN_EXIT

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
