// The persistent loop and the step graph's side of the hand-over, shared by both builds: the
// kernel (kernel.cu) runs them as the scheduler block and the step graph's wait/signal nodes,
// the CPU build (cpu_entry.cpp) on host threads, so tests run the very loop the GPU runs,
// its failure and stop paths included.
//
// The hand-over word ctx.turn (device memory): the scheduler writes SCHED -> COMPUTE once a
// step is built (then launch.released = its seq + 1), the step's signal writes COMPUTE -> SCHED
// once next_token is written, and the scheduler writes EXIT when its loop ends for any reason
// (a stop, a deadline, a failed init), which ends the step graph's wait.  The wait also ends by
// itself when no scheduler is left to answer: state EXITED or FAILED, or shutdown before the
// scheduler ever ran.
//
// Two launches read it.  Resident: one WHILE graph, [wait -> SWITCH(bucket) -> signal] per step.
// Ping-pong (cfg.plan_ahead): two WHILE graphs on two streams, graph p running the steps whose
// seq has parity p: [plan wait -> SWITCH(planned bucket) -> {gate -> step} -> signal].  Graph p
// waits for the plan of its next step (its slot of launch.plan_seq, published by the overlapped
// phase while the step before computes), takes its branch, and parks in the gate, a one-thread
// kernel already resident when the critical phase hands the step over (launch.released); its
// loop's re-arm and the SWITCH run while the other graph's step computes.
#pragma once

#define RL_SH_TURN_EXIT 3
#define RL_SH_STEADY_DONE 8        // and sh->w[0]: when the steady try began
#define RL_STOP_POLL_ROUNDS 4096u  // polls of `turn` between two looks at shutdown (PCIe reads)

// Leader only: waits for the step graph to hand the turn back (at once when no step is out).
// Returns RL_EXIT_NONE once it has, or RL_EXIT_DEADLINE when a stop was asked and compute kept
// the turn past the grace.  Looks at shutdown only every RL_STOP_POLL_ROUNDS polls, so the
// hand-off it waits for is never behind a PCIe read for long.
RL_FN uint32_t rl_wait_for_turn(const RlContext& ctx) {
  uint32_t round = 0;
  uint64_t stop_seen = 0;
  while (rl_peek_turn(ctx.turn) != RL_TURN_SCHED) {
    if (++round % RL_STOP_POLL_ROUNDS == 0) {
      uint64_t now = rl_now_ns();
      if (rl_stop_reason_leader(ctx, now) != RL_EXIT_NONE) {
        if (stop_seen == 0)
          stop_seen = now;
        else if (now - stop_seen > ctx.sched->stop_grace_ns)
          return RL_EXIT_DEADLINE;
      }
    }
    rl_pause_expecting();
  }
  rl_fence_acquire();  // the step's writes (next_token, its records) before our reads
  rl_mark_turn_seen();
  return RL_EXIT_NONE;
}

// Hands the step just laid out to compute: every thread's layout writes, then (leader) the
// turn and the released seq.  WARP: only warp 0 wrote them.
template <bool WARP>
RL_FN void rl_hand_over(const RlContext& ctx) {
  rl_fence_device();
  if (WARP)
    rl_warp_sync();
  else
    RL_SYNC();
  if (RL_LEADER) {
    rl_store_turn(ctx.turn, RL_TURN_COMPUTE);
    rl_store_turn(&ctx.launch->released, (uint32_t)ctx.sched->step);  // seq + 1, as noted
    rl_mark_handed_over();
  }
}

// Before EXIT: a plan published for a step that will not be handed over has a graph parked in
// its gate (ping-pong), which EXIT releases into the step: make that step all pad rows.
RL_FN void rl_void_planned_step(const RlContext& ctx) {
  const RlSchedState& st = *ctx.sched;
  uint32_t bucket = st.plan_bucket;
  if (bucket == 0) return;
  rl_pad_rows(ctx, 0, bucket);
  if (RL_LEADER) ctx.step->n_samples = 0;
  rl_fence_device();
  RL_SYNC();
}

// Steps 1-3 of the loop when the step in flight is steady and its rows fit one warp: warp 0
// alone waits for the turn, lays out the next step in place and hands it over, with no block
// barrier on the way; the block meets after.  Returns the wait's exit reason (RL_EXIT_NONE:
// the turn came back); sh->u[RL_SH_STEADY_DONE] says whether the step went out, and
// sh->w[0] when the try began (the full build's trace row starts there if it did not).
RL_FN uint32_t rl_turn_and_steady_warp(const RlContext& ctx, RlShared* sh, uint32_t n,
                                       uint32_t stop) {
  if (RL_IN_WARP0) {
    uint32_t late = rl_warp_broadcast(RL_LEADER ? rl_wait_for_turn(ctx) : 0u);
    uint64_t began = rl_now_ns();
    uint32_t done = 0;
    if (late == RL_EXIT_NONE && stop == RL_EXIT_NONE) {
      done = rl_critical_steady<true>(ctx, n, began);
      if (done) rl_hand_over<true>(ctx);
    }
    if (RL_LEADER) {
      sh->u[RL_SH_TURN_EXIT] = late;
      sh->u[RL_SH_STEADY_DONE] = done;
      sh->w[0] = began;
    }
  }
  RL_SYNC();
  return sh->u[RL_SH_TURN_EXIT];
}

// The scheduler's whole life.  Per iteration: wait for the turn, the critical phase, hand the
// step to compute, then the overlapped phase while it runs.  Every way out writes turn = EXIT,
// a failed init included (state FAILED): a step graph already launched must never wait for a
// scheduler that will not come.
RL_FN void sched_persistent(const RlContext& ctx, RlShared* sh) {
  if (sched_init(ctx) != RL_ERR_NONE) {
    if (RL_LEADER) rl_store_turn(ctx.turn, RL_TURN_EXIT);
    return;
  }
  uint32_t stop = RL_EXIT_NONE;  // a stop the overlapped phase saw while a step was out
  for (;;) {
    // 1. wait for the step graph to hand the turn back; exit if told to stop (or it overstayed).
    // In the steady state with rows that fit one warp, warp 0 also does 2 and 3 at once.
    const uint32_t steady = ctx.sched->steady_rows;
    uint32_t late, built = RL_STEP_IDLE;
    uint64_t began = 0;
    if (steady != 0 && steady <= RL_WARP_SIZE) {
      late = rl_turn_and_steady_warp(ctx, sh, steady, stop);
      built = sh->u[RL_SH_STEADY_DONE] ? RL_STEP_RUN : RL_STEP_IDLE;
      began = sh->w[0];
    } else {
      if (RL_LEADER) sh->u[RL_SH_TURN_EXIT] = rl_wait_for_turn(ctx);
      RL_SYNC();
      late = sh->u[RL_SH_TURN_EXIT];  // every thread sees the same value
    }
    if (late != RL_EXIT_NONE || stop != RL_EXIT_NONE) {
      rl_mark_exited(ctx, late != RL_EXIT_NONE ? late : stop);
      break;
    }
    // 2. the critical phase: the last step's samples in, the next step's layout out
    // 3. hand that step to compute
    if (built != RL_STEP_RUN) {
      built = sched_critical(ctx, sh, began);
      if (built == RL_STEP_RUN) rl_hand_over<false>(ctx);
    }
    // 4. the overlapped phase, beside the step: aborts, SQ drain, CQ events, admission, mirror
    uint32_t next = sched_overlapped(ctx, sh, built == RL_STEP_RUN);
    if (next == RL_STEP_SHUTDOWN) {
      stop = sh->u[RL_SH_STOP];
      if (built != RL_STEP_RUN) {  // no step out: exit now
        rl_mark_exited(ctx, stop);
        break;
      }
      continue;  // exit once the step in flight hands the turn back (or the grace runs out)
    }
    // 5. nothing out and nothing to do: back off before polling the host rings again
    if (built != RL_STEP_RUN && next == RL_STEP_IDLE && RL_LEADER) rl_pause_idle();
    RL_SYNC();
  }
  // The step graph's wait ends on EXIT (or on state EXITED, whichever it sees first).
  rl_void_planned_step(ctx);
  if (RL_LEADER) rl_store_turn(ctx.turn, RL_TURN_EXIT);
}

// For a waiter on the compute side, every RL_STOP_POLL_ROUNDS polls (PCIe reads): whether no
// scheduler is left to write EXIT (state EXITED or FAILED, or shutdown while it is not RUNNING).
RL_FN bool rl_scheduler_gone(const RlContext& ctx) {
  uint32_t state = rl_load_acquire(&ctx.ctl->state);
  return state == RL_STATE_EXITED || state == RL_STATE_FAILED ||
         (state != RL_STATE_RUNNING && rl_load_acquire(&ctx.ctl->shutdown));
}

// The step graph's wait: returns RL_TURN_COMPUTE when the scheduler hands over a step, or
// RL_TURN_EXIT when the loop must end: the scheduler wrote EXIT, or no scheduler is left to
// write it (state EXITED or FAILED, or shutdown while the scheduler is not RUNNING, as when its
// launch failed).  It spins within ~64 ns while the scheduler is busy (a step is coming) and
// backs off to ~1 us only while the scheduler reports idle.
RL_FN uint32_t rl_wait_for_step(const RlContext& ctx) {
  uint32_t round = 0;
  for (;;) {
    uint32_t turn = rl_peek_turn(ctx.turn);
    if (turn != RL_TURN_SCHED) {
      rl_fence_acquire();  // the layout the scheduler wrote before the turn
      return turn;
    }
    if ((++round % RL_STOP_POLL_ROUNDS) == 0 && rl_scheduler_gone(ctx)) return RL_TURN_EXIT;
    if (*(volatile const uint32_t*)&ctx.launch->idle)
      rl_pause_idle();
    else
      rl_pause_expecting();
  }
}

// The SWITCH branch of the step the scheduler handed over: its bucket's index, or n_buckets
// (no branch runs) when the turn is not COMPUTE.
RL_FN uint32_t rl_step_branch(const RlContext& ctx, uint32_t turn) {
  const RlConfig& cfg = *ctx.cfg;
  if (turn != RL_TURN_COMPUTE) return cfg.n_buckets;
  uint32_t bucket = ctx.step->bucket;
  for (uint32_t b = 0; b < cfg.n_buckets; ++b)
    if (cfg.buckets[b] == bucket) return b;
  return cfg.n_buckets;
}

// The step's start and end on the device timeline.
RL_FN void rl_stamp_step(const RlContext& ctx, uint32_t field) {
  const RlConfig& cfg = *ctx.cfg;
  ctx.trace[(ctx.step->seq & (cfg.trace_len - 1)) * RL_TRACE_FIELDS + field] = rl_now_ns();
}

// Host-scheduled mode's stamps around each replayed step.  The CPU scheduler writes its row of
// the host's trace on the host's clock; these write the device trace's row of the same step on
// the device's, so both modes' bubbles are one definition on one clock (device_timeline.py).
RL_FN void rl_stamp_host_step(const RlContext& ctx, uint32_t field) {
  const RlConfig& cfg = *ctx.cfg;
  uint32_t seq = ctx.step->seq;
  uint64_t* t = ctx.trace + (seq & (cfg.trace_len - 1)) * RL_TRACE_FIELDS;
  if (field == RL_TRACE_STEP_BEGIN) {  // a row an older step left: its end is not this step's
    t[RL_TRACE_STEP_END] = 0;
    t[RL_TRACE_SEQ] = (uint64_t)seq + 1;
  }
  t[field] = rl_now_ns();
}

// Hands the turn back once the step has written next_token.  It never ends the loop itself:
// only the wait does, on the scheduler's EXIT, so a stop that lands mid-step cannot leave the
// scheduler holding a built step that nobody will run.
RL_FN void rl_signal_step_done(const RlContext& ctx) {
  if (rl_load_turn(ctx.turn) != RL_TURN_COMPUTE) return;  // exit path: the wait already ended
  rl_stamp_step(ctx, RL_TRACE_STEP_END);
  rl_fence_device();
  rl_store_turn(ctx.turn, RL_TURN_SCHED);
}

// ---- the ping-pong launch (cfg.plan_ahead) --------------------------------------------------

// Graph p's first node: waits for the plan of its next step (seq graph_seq[p], in plan slot p)
// and returns the SWITCH branch of its bucket, or n_buckets (no branch; the caller ends the
// WHILE) on exit.  EXIT is looked at first: a plan made void at exit stays published, and the
// graph that ran its void step must end, not take it again.
RL_FN uint32_t rl_wait_for_plan(const RlContext& ctx, uint32_t parity) {
  const RlConfig& cfg = *ctx.cfg;
  const uint32_t want = *(volatile const uint32_t*)&ctx.launch->graph_seq[parity] + 1u;
  uint32_t round = 0;
  for (;;) {
    if (rl_peek_turn(ctx.turn) == RL_TURN_EXIT) return cfg.n_buckets;
    if (rl_peek_turn(&ctx.launch->plan_seq[parity]) == want) {
      rl_fence_acquire();  // the bucket was written before plan_seq
      uint32_t bucket = *(volatile const uint32_t*)&ctx.launch->plan_bucket[parity];
      for (uint32_t b = 0; b < cfg.n_buckets; ++b)
        if (cfg.buckets[b] == bucket) return b;
      return cfg.n_buckets;  // unreachable: the scheduler plans only buckets of cfg
    }
    if ((++round % RL_STOP_POLL_ROUNDS) == 0 && rl_scheduler_gone(ctx)) return cfg.n_buckets;
    if (*(volatile const uint32_t*)&ctx.launch->idle)
      rl_pause_idle();
    else
      rl_pause_expecting();
  }
}

// The gate, each branch's first node, parked until the scheduler hands over graph p's step
// (launch.released == its seq + 1): returns RL_TURN_COMPUTE and stamps the step's start, or
// RL_TURN_EXIT (the step then runs the all-pad layout rl_void_planned_step wrote).  The step's
// first kernel follows it as a plain graph edge.
RL_FN uint32_t rl_gate_step(const RlContext& ctx, uint32_t parity) {
  const uint32_t want = *(volatile const uint32_t*)&ctx.launch->graph_seq[parity] + 1u;
  uint32_t round = 0;
  for (;;) {
    if (rl_peek_turn(&ctx.launch->released) == want) {
      rl_fence_acquire();  // the layout, written before the release
      rl_stamp_step(ctx, RL_TRACE_STEP_BEGIN);
      return RL_TURN_COMPUTE;
    }
    if (rl_peek_turn(ctx.turn) == RL_TURN_EXIT) return RL_TURN_EXIT;
    if ((++round % RL_STOP_POLL_ROUNDS) == 0 && rl_scheduler_gone(ctx)) return RL_TURN_EXIT;
    rl_pause_expecting();  // a planned step always comes (a void one at worst)
  }
}

// Graph p's last node: hands the turn back (as rl_signal_step_done) and moves the graph on to
// its next step, two seqs on.  Nothing when the loop is ending.
RL_FN void rl_signal_pingpong_done(const RlContext& ctx, uint32_t parity) {
  if (rl_load_turn(ctx.turn) != RL_TURN_COMPUTE) return;
  uint32_t* mine = &ctx.launch->graph_seq[parity];
  if (rl_load_turn(&ctx.launch->released) != *mine + 1u) return;  // not ours: an exit path
  *(volatile uint32_t*)mine = *mine + 2u;
  rl_signal_step_done(ctx);
}

// ---- the launch graphs' nodes, entered alike by both builds ----------------------------------
// kernel.cu's kernels and cpu_entry.cpp's exports of the same names take the same parameters
// and call these, so the tests run the nodes the GPU runs, in the graphs launch_graph.py builds.

// Resident and pump: waits for the step and picks its bucket's SWITCH branch; on exit no branch,
// and (use_while) the WHILE ends.
RL_FN void rl_step_wait_node(const RlContext& ctx, RlCondHandle switch_handle,
                             RlCondHandle while_handle, uint32_t use_while) {
  uint32_t turn = rl_wait_for_step(ctx);
  if (turn != RL_TURN_COMPUTE && use_while) rl_set_conditional(while_handle, 0u);
  rl_set_conditional(switch_handle, rl_step_branch(ctx, turn));
}

// Ping-pong graph p: waits for the plan of its next step and picks its bucket's branch; on exit
// no branch, and the WHILE ends.
RL_FN void rl_plan_wait_node(const RlContext& ctx, RlCondHandle switch_handle,
                             RlCondHandle while_handle, uint32_t parity) {
  uint32_t branch = rl_wait_for_plan(ctx, parity);
  if (branch >= ctx.cfg->n_buckets) rl_set_conditional(while_handle, 0u);
  rl_set_conditional(switch_handle, branch);
}
