// CPU build of the scheduler: the same scheduler source as the kernel (build.SCHEDULER_SOURCES),
// one thread, C ABI for ctypes.
extern "C" {

uint64_t rl_layout_fingerprint() {
  return RL_LAYOUT_FINGERPRINT;
}

uint32_t rl_sched_init(const RlContext* ctx) {
  return sched_init(*ctx);
}

// The prefix cache's key of one full page (sched_prefix.h), to prove it equal to the host's
// (ipc/prefix_keys.py).
uint64_t rl_prefix_page_key(const RlConfig* cfg, uint64_t parent, const int32_t* tokens) {
  return rl_page_key(*cfg, parent, tokens);
}

// Both phases, serially (the CPU backend and the tests).
uint32_t rl_sched_step(const RlContext* ctx) {
  RlShared sh;
  return sched_step(*ctx, &sh);
}

// The phases one at a time, for a caller that overlaps the model step with the second (the
// host-scheduled CUDA baseline, the microbenchmark).  A stop is marked as the exit here.
uint32_t rl_sched_critical(const RlContext* ctx) {
  RlShared sh;
  return sched_critical(*ctx, &sh);
}

uint32_t rl_sched_overlapped(const RlContext* ctx, uint32_t step_built) {
  RlShared sh;
  uint32_t next = sched_overlapped(*ctx, &sh, step_built != 0);
  if (next == RL_STEP_SHUTDOWN) rl_mark_exited(*ctx, sh.u[RL_SH_STOP]);
  return next;
}

// The persistent loop on the calling thread, as the kernel runs it (returns when it exits or
// its init fails).
void rl_sched_persistent(const RlContext* ctx) {
  RlShared sh;
  sched_persistent(*ctx, &sh);
}

// The launch graphs' nodes (kernel.cu's kernels of the same names and parameters, the context
// by address), for threads that stand in for the graphs: a conditional handle is the address of
// a uint32 word the node sets as cudaGraphSetConditional would.  The gate also returns what it
// saw (RL_TURN_COMPUTE or RL_TURN_EXIT).
void rl_step_wait(const RlContext* ctx, RlCondHandle switch_handle, RlCondHandle while_handle,
                  uint32_t use_while) {
  rl_step_wait_node(*ctx, switch_handle, while_handle, use_while);
}

void rl_step_begin(const RlContext* ctx) {
  rl_stamp_step(*ctx, RL_TRACE_STEP_BEGIN);
}

void rl_step_signal(const RlContext* ctx) {
  rl_signal_step_done(*ctx);
}

void rl_plan_wait(const RlContext* ctx, RlCondHandle switch_handle, RlCondHandle while_handle,
                  uint32_t parity) {
  rl_plan_wait_node(*ctx, switch_handle, while_handle, parity);
}

uint32_t rl_step_gate(const RlContext* ctx, uint32_t parity) {
  return rl_gate_step(*ctx, parity);
}

void rl_signal_pingpong(const RlContext* ctx, uint32_t parity) {
  rl_signal_pingpong_done(*ctx, parity);
}

// The host-scheduled graph's stamps (kernel.cu), to test the shared text on the CPU.
void rl_host_step_begin(const RlContext* ctx) {
  rl_stamp_host_step(*ctx, RL_TRACE_STEP_BEGIN);
}

void rl_host_step_end(const RlContext* ctx) {
  rl_stamp_host_step(*ctx, RL_TRACE_STEP_END);
}

// This thread's host-shared accesses since its last reset: acquire loads, release stores,
// system fences, plain loads, plain stores.
void rl_host_access_counts(uint64_t* out) {
  out[0] = rl_host_accesses.acquire_loads;
  out[1] = rl_host_accesses.release_stores;
  out[2] = rl_host_accesses.system_fences;
  out[3] = rl_host_accesses.loads;
  out[4] = rl_host_accesses.stores;
}

void rl_host_access_reset() {
  rl_host_accesses = RlHostAccesses();
}

// This thread's block barriers (RL_SYNC, rl_block_any) since its start.
uint64_t rl_block_barrier_count() {
  return rl_block_barriers;
}

// The persistent loop's hand-overs by the block barriers on their path (RL_PATH_BINS counts),
// and their reset.
uint32_t rl_hand_over_path_bins() {
  return RL_PATH_BINS;
}

void rl_hand_over_path_counts(uint64_t* out) {
  for (uint32_t i = 0; i < RL_PATH_BINS; ++i) out[i] = rl_hand_over_path.by_barriers[i];
}

void rl_hand_over_path_reset() {
  rl_hand_over_path = RlHandOverPath();
}

}  // extern "C"
