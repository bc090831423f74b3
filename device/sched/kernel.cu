// GPU build of the scheduler: the persistent one-block kernel and the step graph's three small
// kernels.  The loops themselves are shared text (sched_loop.h), which the CPU build runs too;
// here they only get their GPU entry points.  Header-free so NVRTC needs no CUDA include path.

// The launch's dynamic shared memory, in bytes.
__device__ __forceinline__ uint32_t rl_dynamic_smem_bytes() {
  uint32_t n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}

// Leader only: points `c` at shared-memory homes for the scheduler's working state
// (layout.SHARED_PLACEMENT, in order, each array while the launch's dynamic shared memory still
// holds it; the rest stays in device memory).  Returns the config's home, or null when it stayed.
__device__ RlConfig* rl_place_in_shared(RlContext& c, unsigned char* base, uint32_t bytes) {
  const RlConfig& cfg = *c.cfg;  // the device copy: the counts below read it before it moves
  RlConfig* cfg_home = 0;
  uint32_t used = 0;
#define RL_PLACE(name, type, count)                                             \
  {                                                                             \
    uint32_t need = ((uint32_t)(sizeof(type) * (count)) + 15u) & ~15u;          \
    if (used + need <= bytes) {                                                 \
      if ((void*)&c.name == (void*)&c.cfg) cfg_home = (RlConfig*)(base + used); \
      c.name = (type*)(base + used);                                            \
      used += need;                                                             \
    }                                                                           \
  }
  RL_SHARED_PLACEMENT(RL_PLACE)
#undef RL_PLACE
  return cfg_home;
}

// One block, ever: minBlocks 1 lets ptxas take the registers it needs rather than spill for
// an occupancy this kernel never has.  Its working state lives in shared memory for the
// kernel's life (rl_place_in_shared): the critical phase's accesses to it never wait on an L2
// that each step's weights have flushed.  sched and slots go back to device memory at exit.
extern "C" __global__ void __launch_bounds__(RL_MAX_THREADS, 1)
    rl_scheduler_persistent(RlContext ctx) {
  __shared__ RlShared sh;
  __shared__ RlContext placed;
  extern __shared__ __align__(16) unsigned char rl_dyn[];
  if (RL_LEADER) {
    placed = ctx;
    sh.w[1] = (uint64_t)rl_place_in_shared(placed, rl_dyn, rl_dynamic_smem_bytes());
  }
  __syncthreads();
  if (sh.w[1]) {  // the config, copied word by word into its home
    const uint32_t* from = (const uint32_t*)ctx.cfg;
    uint32_t* to = (uint32_t*)placed.cfg;
    for (uint32_t i = threadIdx.x; i < sizeof(RlConfig) / 4u; i += blockDim.x) to[i] = from[i];
  }
  __syncthreads();
  sched_persistent(placed, &sh);
  __syncthreads();
  const RlConfig& cfg = *placed.cfg;
#define RL_BACK(name, type, count)                                                               \
  if (placed.name != ctx.name) {                                                                 \
    const uint32_t* from = (const uint32_t*)placed.name;                                         \
    uint32_t* to = (uint32_t*)ctx.name;                                                          \
    for (uint32_t i = threadIdx.x; i < (uint32_t)(sizeof(type) * (count)) / 4u; i += blockDim.x) \
      to[i] = from[i];                                                                           \
  }
  RL_SHARED_WRITE_BACK(RL_BACK)
#undef RL_BACK
}

// ---- the compute side's small kernels, nodes of the step graph -------------------------------
// Resident mode wraps [rl_step_wait -> SWITCH(bucket) -> rl_step_signal] in a WHILE node; pump
// mode unrolls the same nodes a few times per launch (with --step-signal in-step the signal is
// each branch's step graph's last node instead).  Neither reads slot state.

// Waits until the scheduler hands over a step and picks its bucket's branch of the SWITCH node;
// on EXIT it picks no branch and (resident) ends the WHILE loop.
extern "C" __global__ void rl_step_wait(RlContext ctx, cudaGraphConditionalHandle switch_handle,
                                        cudaGraphConditionalHandle while_handle,
                                        unsigned int use_while) {
  rl_step_wait_node(ctx, switch_handle, while_handle, use_while);
}

// The first node of every SWITCH branch: the step's start, stamped inside the step itself (so
// the SWITCH evaluation and the branch launch count as bubble, not as step time).
extern "C" __global__ void rl_step_begin(RlContext ctx) {
  rl_stamp_step(ctx, RL_TRACE_STEP_BEGIN);
}

// The signal kernels may sit in the step graph itself, after its last kernels by programmatic
// edges (launch_graph.py, --step-signal in-step): then they start before those end, and wait
// here for their completion and their writes.  Without such an edge this returns at once.
__device__ __forceinline__ void rl_wait_for_prior_kernels() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Hands the turn back to the scheduler once the step graph has written next_token.
extern "C" __global__ void rl_step_signal(RlContext ctx) {
  rl_wait_for_prior_kernels();
  rl_signal_step_done(ctx);
}

// Host-scheduled mode's graph per bucket: [rl_host_step_begin -> step graph -> rl_host_step_end]
// (launch_graph.HostStampedGraphs), the step's device-clock start and end.
extern "C" __global__ void rl_host_step_begin(RlContext ctx) {
  rl_stamp_host_step(ctx, RL_TRACE_STEP_BEGIN);
}

extern "C" __global__ void rl_host_step_end(RlContext ctx) {
  rl_stamp_host_step(ctx, RL_TRACE_STEP_END);
}

// ---- the ping-pong launch: two WHILE graphs, graph p running the steps of seq parity p --------
// [rl_plan_wait -> SWITCH(planned bucket) -> {rl_step_gate -> step graph} -> rl_signal_pingpong]

// Waits for the plan of graph p's next step and picks its bucket's branch; on exit no branch,
// and the WHILE ends.
extern "C" __global__ void rl_plan_wait(RlContext ctx, cudaGraphConditionalHandle switch_handle,
                                        cudaGraphConditionalHandle while_handle,
                                        unsigned int parity) {
  rl_plan_wait_node(ctx, switch_handle, while_handle, parity);
}

// Parked, one thread, until the scheduler hands over graph p's step; stamps its start.
extern "C" __global__ void rl_step_gate(RlContext ctx, unsigned int parity) {
  rl_gate_step(ctx, parity);
}

// Hands the turn back once the step graph has written next_token; graph p moves two seqs on.
extern "C" __global__ void rl_signal_pingpong(RlContext ctx, unsigned int parity) {
  rl_wait_for_prior_kernels();
  rl_signal_pingpong_done(ctx, parity);
}
