// GPU build of the scheduler: a persistent one-block kernel looping over the same sched_step().
// It hands each built step to the compute stream through ctx.turn (device memory) and waits for
// the step graph to hand it back.  Header-free so NVRTC needs no CUDA include path.

__device__ __forceinline__ uint32_t rl_load_turn(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void rl_store_turn(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

extern "C" __global__ void __launch_bounds__(RL_MAX_THREADS)
rl_scheduler_persistent(RlContext ctx) {
  __shared__ RlShared sh;
  if (sched_init(ctx) != RL_ERR_NONE) return;
  for (;;) {
    if (threadIdx.x == 0) {
      uint32_t round = 0;
      while (rl_load_turn(ctx.turn) != RL_TURN_SCHED) rl_backoff(round++);
    }
    __syncthreads();
    uint32_t r = sched_step(ctx, &sh);
    if (r == RL_STEP_SHUTDOWN) break;
    if (r == RL_STEP_RUN) {
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) rl_store_turn(ctx.turn, RL_TURN_COMPUTE);
    } else if (threadIdx.x == 0) {
      rl_backoff(8);  // idle: poll the SQ again soon
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    rl_store_turn(ctx.turn, RL_TURN_EXIT);
    ctx.ctl->state = RL_STATE_EXITED;
    rl_fence_system();
  }
}

// ---- the compute side's two small kernels, nodes of the step graph -----------------------------
// Resident mode wraps [rl_step_wait -> SWITCH(bucket) -> rl_step_signal] in a WHILE node; pump
// mode unrolls the same three nodes a few times per launch.  Neither reads slot state.

typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);

// Waits until the scheduler hands over a step; picks the bucket's branch of the SWITCH node.
// On exit (scheduler gone or host shutdown) it selects no branch and ends the WHILE loop.
extern "C" __global__ void rl_step_wait(RlContext ctx, cudaGraphConditionalHandle switch_handle,
                                        cudaGraphConditionalHandle while_handle,
                                        unsigned int use_while) {
  uint32_t round = 0, turn;
  for (;;) {
    turn = rl_load_turn(ctx.turn);
    if (turn != RL_TURN_SCHED) break;
    if ((round & 1023u) == 1023u && rl_load_acquire(&ctx.ctl->shutdown)) { turn = RL_TURN_EXIT; break; }
    rl_backoff(round++);
  }
  const RlConfig& cfg = *ctx.cfg;
  uint32_t branch = cfg.n_buckets;  // out of range: no branch runs
  if (turn == RL_TURN_COMPUTE) {
    uint32_t bucket = ctx.step->bucket;
    for (uint32_t b = 0; b < cfg.n_buckets; ++b)
      if (cfg.buckets[b] == bucket) { branch = b; break; }
    ctx.trace[(ctx.step->seq & (cfg.trace_len - 1)) * RL_TRACE_FIELDS + RL_TRACE_STEP_BEGIN] =
        rl_now_ns();
  } else if (use_while) {
    cudaGraphSetConditional(while_handle, 0u);
  }
  cudaGraphSetConditional(switch_handle, branch);
}

// Hands the turn back to the scheduler once the step graph has written next_token.
extern "C" __global__ void rl_step_signal(RlContext ctx, cudaGraphConditionalHandle while_handle,
                                          unsigned int use_while) {
  uint32_t turn = rl_load_turn(ctx.turn);
  if (turn != RL_TURN_COMPUTE) return;  // exit path: rl_step_wait already ended the loop
  const RlConfig& cfg = *ctx.cfg;
  ctx.trace[(ctx.step->seq & (cfg.trace_len - 1)) * RL_TRACE_FIELDS + RL_TRACE_STEP_END] =
      rl_now_ns();
  __threadfence();
  rl_store_turn(ctx.turn, RL_TURN_SCHED);
  if (use_while) cudaGraphSetConditional(while_handle, rl_load_acquire(&ctx.ctl->shutdown) ? 0u : 1u);
}
