// CPU build of the scheduler: the same sched_step() text as the kernel, one thread, C ABI for ctypes.
extern "C" {

uint64_t rl_layout_fingerprint() { return RL_LAYOUT_FINGERPRINT; }

uint32_t rl_sched_init(const RlContext* ctx) { return sched_init(*ctx); }

uint32_t rl_sched_step(const RlContext* ctx) {
  RlShared sh;
  return sched_step(*ctx, &sh);
}

}  // extern "C"
