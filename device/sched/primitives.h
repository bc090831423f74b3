// The few primitives sched_step.h is written against, in a GPU form (one thread block, NVRTC)
// and a CPU form (one thread, host C++ compiler).  Everything else in the scheduler is shared text.
#pragma once

#ifdef __CUDACC_RTC__
#define RL_GPU 1
#define RL_FN __device__ __forceinline__
#define RL_SHARED __shared__
#define RL_TID ((uint32_t)threadIdx.x)
#define RL_NTHREADS ((uint32_t)blockDim.x)
#define RL_SYNC() __syncthreads()
// A data-parallel loop: every thread of the block takes a strided share of [0, n).
#define RL_FOR(i, n) for (uint32_t i = threadIdx.x; i < (uint32_t)(n); i += blockDim.x)
#define RL_LEADER (threadIdx.x == 0)
#define RL_MAX_THREADS 1024

RL_FN uint32_t rl_load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
RL_FN void rl_store_release(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
RL_FN uint64_t rl_now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Makes this thread's writes to host memory visible before a leader's release store.
RL_FN void rl_fence_system() { __threadfence_system(); }
RL_FN void rl_backoff(uint32_t round) { __nanosleep(round < 8 ? 64u : 1024u); }

#else  // CPU form
#include <string.h>
#include <time.h>
#include <sched.h>
#define RL_FN static inline
#define RL_SHARED
#define RL_TID 0u
#define RL_NTHREADS 1u
#define RL_SYNC() ((void)0)
#define RL_FOR(i, n) for (uint32_t i = 0; i < (uint32_t)(n); ++i)
#define RL_LEADER true

RL_FN uint32_t rl_load_acquire(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
RL_FN void rl_store_release(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
RL_FN uint64_t rl_now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
RL_FN void rl_fence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
RL_FN void rl_backoff(uint32_t round) {
  if (round < 64) { sched_yield(); return; }
  struct timespec ts = {0, 50000};  // the host is behind: stop burning its core
  nanosleep(&ts, 0);
}
#endif

// Scratch the block shares: scalars broadcast from the leader, and the scan's staging area.
struct RlShared {
  uint32_t u[16];
  uint64_t w[4];
#ifdef RL_GPU
  uint32_t scan[RL_MAX_THREADS];
#endif
};

// In-place exclusive prefix sum of a[0..n); every thread gets the total.
RL_FN uint32_t rl_exclusive_scan(uint32_t* a, uint32_t n, RlShared* sh) {
#ifdef RL_GPU
  uint32_t carry = 0;
  for (uint32_t base = 0; base < n; base += RL_NTHREADS) {
    uint32_t i = base + RL_TID;
    uint32_t mine = i < n ? a[i] : 0u;
    sh->scan[RL_TID] = mine;
    RL_SYNC();
    for (uint32_t d = 1; d < RL_NTHREADS; d <<= 1) {  // Hillis-Steele over the block
      uint32_t add = RL_TID >= d ? sh->scan[RL_TID - d] : 0u;
      RL_SYNC();
      sh->scan[RL_TID] += add;
      RL_SYNC();
    }
    if (i < n) a[i] = carry + sh->scan[RL_TID] - mine;
    uint32_t chunk_total = sh->scan[RL_NTHREADS - 1];
    RL_SYNC();
    carry += chunk_total;
  }
  return carry;
#else
  uint32_t run = 0;
  for (uint32_t i = 0; i < n; ++i) { uint32_t v = a[i]; a[i] = run; run += v; }
  return run;
#endif
}
