// GPU build of the scheduler: a persistent one-block kernel looping over the same two phases as
// the CPU build.  It hands each step the critical phase built to the compute stream through
// ctx.turn (device memory), runs the overlapped phase while that step computes, and waits for
// the step graph to hand the turn back.  Header-free so NVRTC needs no CUDA include path.

__device__ __forceinline__ uint32_t rl_load_turn(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void rl_store_turn(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

#define RL_SH_TURN_EXIT 3
#define RL_STOP_POLL_ROUNDS 4096u  // polls of `turn` between two looks at shutdown (PCIe reads)

// A step is expected soon: stay within ~64 ns of the hand-off (the scheduler owns its SM anyway).
__device__ __forceinline__ void rl_pause_expecting() {
  __nanosleep(32);
}
// Nothing to do: poll the host rings about once a microsecond.
__device__ __forceinline__ void rl_pause_idle() {
  __nanosleep(1024);
}

// Leader only: waits for the step graph to hand the turn back (at once when no step is out).
// Returns RL_EXIT_NONE once it has, or RL_EXIT_DEADLINE when a stop was asked and compute kept
// the turn past the grace.  Looks at shutdown only every RL_STOP_POLL_ROUNDS polls, so the
// hand-off it waits for is never behind a PCIe read for long.
__device__ uint32_t rl_wait_for_turn(const RlContext& ctx) {
  uint32_t round = 0;
  uint64_t stop_seen = 0;
  while (rl_load_turn(ctx.turn) != RL_TURN_SCHED) {
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
  return RL_EXIT_NONE;
}

// One block, ever: minBlocks 1 lets ptxas take the registers it needs rather than spill for
// an occupancy this kernel never has.  Per iteration: wait for the turn, the critical phase,
// hand the step to compute, then the overlapped phase while it runs.
extern "C" __global__ void __launch_bounds__(RL_MAX_THREADS, 1)
    rl_scheduler_persistent(RlContext ctx) {
  __shared__ RlShared sh;
  if (sched_init(ctx) != RL_ERR_NONE) return;
  uint32_t stop = RL_EXIT_NONE;  // a stop the overlapped phase saw while a step was out
  for (;;) {
    // 1. wait for the step graph to hand the turn back; exit if told to stop (or it overstayed)
    if (threadIdx.x == 0) sh.u[RL_SH_TURN_EXIT] = rl_wait_for_turn(ctx);
    __syncthreads();
    uint32_t late = sh.u[RL_SH_TURN_EXIT];  // every thread sees the same value
    if (late != RL_EXIT_NONE || stop != RL_EXIT_NONE) {
      rl_mark_exited(ctx, late != RL_EXIT_NONE ? late : stop);
      break;
    }
    // 2. the critical phase: the last step's samples in, the next step's layout out
    uint32_t built = sched_critical(ctx, &sh);
    // 3. hand that step to compute
    if (built == RL_STEP_RUN) {
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) rl_store_turn(ctx.turn, RL_TURN_COMPUTE);
    }
    // 4. the overlapped phase, beside the step: aborts, SQ drain, CQ events, admission, mirror
    uint32_t next = sched_overlapped(ctx, &sh, built == RL_STEP_RUN);
    if (next == RL_STEP_SHUTDOWN) {
      stop = sh.u[RL_SH_STOP];
      if (built != RL_STEP_RUN) {  // no step out: exit now
        rl_mark_exited(ctx, stop);
        break;
      }
      continue;  // exit once the step in flight hands the turn back (or the grace runs out)
    }
    // 5. nothing out and nothing to do: back off before polling the host rings again
    if (built != RL_STEP_RUN && next == RL_STEP_IDLE && threadIdx.x == 0) rl_pause_idle();
    __syncthreads();
  }
  // The step graph's wait kernel ends on EXIT (or on state EXITED, whichever it sees first).
  if (threadIdx.x == 0) rl_store_turn(ctx.turn, RL_TURN_EXIT);
}

// ---- the compute side's two small kernels, nodes of the step graph -----------------------------
// Resident mode wraps [rl_step_wait -> SWITCH(bucket) -> rl_step_signal] in a WHILE node; pump
// mode unrolls the same three nodes a few times per launch.  Neither reads slot state.

typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);

// Waits until the scheduler hands over a step; picks the bucket's branch of the SWITCH node.
// The scheduler alone decides the end: it answers shutdown by writing EXIT, and then this
// selects no branch and ends the WHILE loop.  It also ends when no scheduler runs to answer
// (state EXITED, or shutdown before it ever started), so a graph launch never outlives it.
// It spins within ~64 ns while the scheduler is busy (a step is coming) and backs off to ~2 us
// only while the scheduler reports idle.
extern "C" __global__ void rl_step_wait(RlContext ctx, cudaGraphConditionalHandle switch_handle,
                                        cudaGraphConditionalHandle while_handle,
                                        unsigned int use_while) {
  uint32_t round = 0, turn;
  for (;;) {
    turn = rl_load_turn(ctx.turn);
    if (turn != RL_TURN_SCHED) break;
    if ((++round & 4095u) == 0) {
      uint32_t state = rl_load_acquire(&ctx.ctl->state);
      if (state == RL_STATE_EXITED ||
          (state != RL_STATE_RUNNING && rl_load_acquire(&ctx.ctl->shutdown))) {
        turn = RL_TURN_EXIT;
        break;
      }
    }
    __nanosleep(*(volatile uint32_t*)&ctx.sched->idle ? 2048u : 32u);
  }
  const RlConfig& cfg = *ctx.cfg;
  uint32_t branch = cfg.n_buckets;  // out of range: no branch runs
  if (turn == RL_TURN_COMPUTE) {
    uint32_t bucket = ctx.step->bucket;
    for (uint32_t b = 0; b < cfg.n_buckets; ++b)
      if (cfg.buckets[b] == bucket) {
        branch = b;
        break;
      }
  } else if (use_while) {
    cudaGraphSetConditional(while_handle, 0u);
  }
  cudaGraphSetConditional(switch_handle, branch);
}

// The first node of every SWITCH branch: the step's start, stamped inside the step itself (so
// the SWITCH evaluation and the branch launch count as bubble, not as step time).
extern "C" __global__ void rl_step_begin(RlContext ctx) {
  const RlConfig& cfg = *ctx.cfg;
  ctx.trace[(ctx.step->seq & (cfg.trace_len - 1)) * RL_TRACE_FIELDS + RL_TRACE_STEP_BEGIN] =
      rl_now_ns();
}

// Hands the turn back to the scheduler once the step graph has written next_token.  It never
// ends the WHILE loop itself: only the wait kernel does, on the scheduler's EXIT, so a stop that
// lands mid-step cannot leave the scheduler holding a built step that nobody will run.
extern "C" __global__ void rl_step_signal(RlContext ctx) {
  uint32_t turn = rl_load_turn(ctx.turn);
  if (turn != RL_TURN_COMPUTE) return;  // exit path: rl_step_wait already ended the loop
  const RlConfig& cfg = *ctx.cfg;
  ctx.trace[(ctx.step->seq & (cfg.trace_len - 1)) * RL_TRACE_FIELDS + RL_TRACE_STEP_END] =
      rl_now_ns();
  __threadfence();
  rl_store_turn(ctx.turn, RL_TURN_SCHED);
}
