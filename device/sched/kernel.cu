// GPU build of the scheduler: the persistent one-block kernel and the step graph's three small
// kernels.  The loops themselves are shared text (sched_loop.h), which the CPU build runs too;
// here they only get their GPU entry points.  Header-free so NVRTC needs no CUDA include path.

// One block, ever: minBlocks 1 lets ptxas take the registers it needs rather than spill for
// an occupancy this kernel never has.
extern "C" __global__ void __launch_bounds__(RL_MAX_THREADS, 1)
    rl_scheduler_persistent(RlContext ctx) {
  __shared__ RlShared sh;
  sched_persistent(ctx, &sh);
}

// ---- the compute side's small kernels, nodes of the step graph -------------------------------
// Resident mode wraps [rl_step_wait -> SWITCH(bucket) -> rl_step_signal] in a WHILE node; pump
// mode unrolls the same nodes a few times per launch.  Neither reads slot state.

typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);

// Waits until the scheduler hands over a step and picks its bucket's branch of the SWITCH node;
// on EXIT it picks no branch and (resident) ends the WHILE loop.
extern "C" __global__ void rl_step_wait(RlContext ctx, cudaGraphConditionalHandle switch_handle,
                                        cudaGraphConditionalHandle while_handle,
                                        unsigned int use_while) {
  uint32_t turn = rl_wait_for_step(ctx);
  if (turn != RL_TURN_COMPUTE && use_while) cudaGraphSetConditional(while_handle, 0u);
  cudaGraphSetConditional(switch_handle, rl_step_branch(ctx, turn));
}

// The first node of every SWITCH branch: the step's start, stamped inside the step itself (so
// the SWITCH evaluation and the branch launch count as bubble, not as step time).
extern "C" __global__ void rl_step_begin(RlContext ctx) {
  rl_stamp_step(ctx, RL_TRACE_STEP_BEGIN);
}

// Hands the turn back to the scheduler once the step graph has written next_token.
extern "C" __global__ void rl_step_signal(RlContext ctx) {
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
