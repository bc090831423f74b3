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
