// The few primitives the scheduler (sched_*.h) is written against, in a GPU form (one thread block,
// NVRTC) and a CPU form (one thread, host C++ compiler).  Everything else in the scheduler is
// shared text.
//
// Host-shared memory (ctl, sq, arena, cq, aq) is touched only through the rl_load_acquire,
// rl_store_release, rl_fence_system, rl_host_read and rl_host_write below; the CPU form counts
// each call per thread, which is how the tests prove the critical phase makes none.
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
#define RL_FULL_WARP 0xFFFFFFFFu

RL_FN uint32_t rl_load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
RL_FN void rl_store_release(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Plain access to host-shared payload (entries, events, mirrored counters); the acquire or
// release of the ring index around it does the ordering.
template <typename T>
RL_FN T rl_host_read(const T* p) {
  return *p;
}
template <typename T>
RL_FN void rl_host_write(T* p, const T& v) {
  *p = v;
}
RL_FN uint64_t rl_now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Makes this thread's writes to host memory visible before a leader's release store.
RL_FN void rl_fence_system() {
  __threadfence_system();
}
// Waiting on the host (CQ room): it may be a while.
RL_FN void rl_backoff(uint32_t round) {
  __nanosleep(round < 8 ? 64u : 1024u);
}
// The scheduler/compute hand-over word (ctx.turn) lives in device memory: acquire/release at
// GPU scope, never a PCIe access.
RL_FN uint32_t rl_load_turn(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
RL_FN void rl_store_turn(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Polling a device-memory word: a relaxed load per poll (an acquire load would invalidate the
// SM's L1 on every one), then rl_fence_acquire() once the awaited value is seen.
RL_FN uint32_t rl_peek_turn(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
RL_FN void rl_fence_acquire() {
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}
// Makes this thread's device-memory writes visible before a leader's turn store.
RL_FN void rl_fence_device() {
  __threadfence();
}
// Warp 0 alone, for work that fits it: no block barrier on the path (the critical phase's
// steady state, sched_critical.h).
#define RL_WARP_SIZE 32u
#define RL_IN_WARP0 (threadIdx.x < 32u)
#define RL_LANE (threadIdx.x & 31u)  // this thread's place in its warp, and the warp's threads
#define RL_LANES 32u
RL_FN void rl_warp_sync() {
  __syncwarp();
}
RL_FN uint32_t rl_warp_any(uint32_t v) {
  return __any_sync(RL_FULL_WARP, v != 0) ? 1u : 0u;
}
RL_FN uint32_t rl_warp_broadcast(uint32_t v) {
  return __shfl_sync(RL_FULL_WARP, v, 0);
}
// Whether any thread of the block passed v != 0 (one barrier).
RL_FN uint32_t rl_block_any(uint32_t v) {
  return __syncthreads_or(v != 0) ? 1u : 0u;
}
// A step is expected soon: stay within ~64 ns of the hand-off (the scheduler owns its SM anyway).
RL_FN void rl_pause_expecting() {
  __nanosleep(32);
}
// Nothing to do: poll the host rings about once a microsecond.
RL_FN void rl_pause_idle() {
  __nanosleep(1024);
}
// Device-memory atomics for the few words threads of the block may hit at once (a KV page's
// reference count, a prefix-table cell); both return the old value.
RL_FN uint32_t rl_atomic_add(uint32_t* p, uint32_t v) {
  return atomicAdd(p, v);
}
RL_FN uint32_t rl_atomic_cas(uint32_t* p, uint32_t expected, uint32_t desired) {
  return atomicCAS(p, expected, desired);
}
RL_FN uint32_t rl_atomic_max(uint32_t* p, uint32_t v) {
  return atomicMax(p, v);
}
// The CPU form counts block barriers around the hand-over (below); nothing to count here.
RL_FN void rl_mark_turn_seen() {}
RL_FN void rl_mark_handed_over() {}
// A WHILE or SWITCH node's handle, which a launch graph's node sets for its graph (sched_loop.h).
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);
typedef cudaGraphConditionalHandle RlCondHandle;
RL_FN void rl_set_conditional(RlCondHandle handle, uint32_t value) {
  cudaGraphSetConditional(handle, value);
}

#else  // CPU form
#include <string.h>
#include <time.h>
#include <sched.h>
#define RL_FN static inline
#define RL_SHARED
#define RL_TID 0u
#define RL_NTHREADS 1u
// Block barriers this thread passed (RL_SYNC, rl_block_any: __syncthreads on a GPU), which the
// tests and sched_micro count: one thread needs none.
static thread_local uint64_t rl_block_barriers;
#define RL_SYNC() ((void)(rl_block_barriers += 1))
#define RL_FOR(i, n) for (uint32_t i = 0; i < (uint32_t)(n); ++i)
#define RL_LEADER true

// Host-shared accesses made by this thread, by kind (read by the benchmark and the tests).
struct RlHostAccesses {
  uint64_t acquire_loads, release_stores, system_fences, loads, stores;
};
static thread_local RlHostAccesses rl_host_accesses;

RL_FN uint32_t rl_load_acquire(const uint32_t* p) {
  rl_host_accesses.acquire_loads += 1;
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
RL_FN void rl_store_release(uint32_t* p, uint32_t v) {
  rl_host_accesses.release_stores += 1;
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
template <typename T>
RL_FN T rl_host_read(const T* p) {
  rl_host_accesses.loads += 1;
  return *p;
}
template <typename T>
RL_FN void rl_host_write(T* p, const T& v) {
  rl_host_accesses.stores += 1;
  *p = v;
}
RL_FN uint64_t rl_now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
RL_FN void rl_fence_system() {
  rl_host_accesses.system_fences += 1;
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
RL_FN void rl_backoff(uint32_t round) {
  if (round < 64) {
    sched_yield();
    return;
  }
  struct timespec ts = {0, 50000};  // the host is behind: stop burning its core
  nanosleep(&ts, 0);
}
// The hand-over word: device memory on a GPU, so these are not host-shared accesses.
RL_FN uint32_t rl_load_turn(const uint32_t* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
RL_FN void rl_store_turn(uint32_t* p, uint32_t v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
RL_FN uint32_t rl_peek_turn(const uint32_t* p) {
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
RL_FN void rl_fence_acquire() {
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
}
RL_FN void rl_fence_device() {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
// One thread is the block and its warp 0.
#define RL_WARP_SIZE 32u
#define RL_IN_WARP0 true
#define RL_LANE 0u  // the one thread is the whole warp: a warp loop strides by 1 here
#define RL_LANES 1u
RL_FN void rl_warp_sync() {}
RL_FN uint32_t rl_warp_any(uint32_t v) {
  return v != 0;
}
RL_FN uint32_t rl_warp_broadcast(uint32_t v) {
  return v;
}
RL_FN uint32_t rl_block_any(uint32_t v) {
  rl_block_barriers += 1;
  return v != 0;
}
// Per hand-over, the block barriers the loop passed between the turn coming back and the next
// step going out, by count (RL_PATH_BINS - 1: that many or more): the tests' proof that the
// steady warp path has none.  Process-wide, since one loop runs at a time.
#define RL_PATH_BINS 16u
struct RlHandOverPath {
  uint64_t at_turn;
  uint64_t by_barriers[RL_PATH_BINS];
};
static RlHandOverPath rl_hand_over_path;
RL_FN void rl_mark_turn_seen() {
  rl_hand_over_path.at_turn = rl_block_barriers;
}
RL_FN void rl_mark_handed_over() {
  uint64_t n = rl_block_barriers - rl_hand_over_path.at_turn;
  rl_hand_over_path.by_barriers[n < RL_PATH_BINS ? n : RL_PATH_BINS - 1] += 1;
}
// Threads stand in for the scheduler block and the step graph here: give the core away.
RL_FN void rl_pause_expecting() {
  sched_yield();
}
RL_FN void rl_pause_idle() {
  struct timespec ts = {0, 1000};
  nanosleep(&ts, 0);
}
// One thread is the whole block here: plain accesses.
RL_FN uint32_t rl_atomic_add(uint32_t* p, uint32_t v) {
  uint32_t old = *p;
  *p = old + v;
  return old;
}
RL_FN uint32_t rl_atomic_cas(uint32_t* p, uint32_t expected, uint32_t desired) {
  uint32_t old = *p;
  if (old == expected) *p = desired;
  return old;
}
RL_FN uint32_t rl_atomic_max(uint32_t* p, uint32_t v) {
  uint32_t old = *p;
  if (v > old) *p = v;
  return old;
}
// A conditional handle is the address of a word here: the host's stand-in for the graph (the
// tests' simulated driver) reads it once the node returns, on the node's own thread.
typedef uint64_t RlCondHandle;
RL_FN void rl_set_conditional(RlCondHandle handle, uint32_t value) {
  *(uint32_t*)(uintptr_t)handle = value;
}
#endif

// Scratch the block shares: scalars broadcast from the leader, and one word per warp for scans
// and reductions (plus the chunk total).
struct RlShared {
  uint32_t u[16];
  uint64_t w[4];
#ifdef RL_GPU
  uint32_t warp[RL_MAX_THREADS / 32 + 1];
#endif
};

RL_FN uint32_t rl_add_u32(uint32_t a, uint32_t b) {
  return a + b;
}
RL_FN uint32_t rl_or_u32(uint32_t a, uint32_t b) {
  return a | b;
}
RL_FN uint32_t rl_and_u32(uint32_t a, uint32_t b) {
  return a & b;
}
RL_FN uint32_t rl_min_u32(uint32_t a, uint32_t b) {
  return a < b ? a : b;
}

#ifdef RL_GPU
// Sum / or / and / min of one value per thread over the block; every thread gets the result.
#define RL_BLOCK_REDUCE(name, combine, identity)                                               \
  RL_FN uint32_t name(uint32_t v, RlShared* sh) {                                              \
    for (uint32_t d = 16; d > 0; d >>= 1) v = combine(v, __shfl_xor_sync(RL_FULL_WARP, v, d)); \
    if ((RL_TID & 31u) == 0) sh->warp[RL_TID >> 5] = v;                                        \
    RL_SYNC();                                                                                 \
    uint32_t all = identity;                                                                   \
    for (uint32_t w = 0; w < (RL_NTHREADS + 31u) >> 5; ++w) all = combine(all, sh->warp[w]);   \
    RL_SYNC();                                                                                 \
    return all;                                                                                \
  }
#else
// One thread holds the whole block's share: its value is the result.
#define RL_BLOCK_REDUCE(name, combine, identity) \
  RL_FN uint32_t name(uint32_t v, RlShared*) {   \
    return v;                                    \
  }
#endif
RL_BLOCK_REDUCE(rl_block_sum, rl_add_u32, 0u)
RL_BLOCK_REDUCE(rl_block_or, rl_or_u32, 0u)
RL_BLOCK_REDUCE(rl_block_and, rl_and_u32, 0xFFFFFFFFu)
RL_BLOCK_REDUCE(rl_block_min, rl_min_u32, 0xFFFFFFFFu)

// In-place exclusive prefix sum of a[0..n); every thread gets the total.  GPU: per chunk of
// one element per thread, a shuffle scan inside each warp, one over the warp totals, 2 barriers.
RL_FN uint32_t rl_exclusive_scan(uint32_t* a, uint32_t n, RlShared* sh) {
#ifdef RL_GPU
  const uint32_t lane = RL_TID & 31u, warp = RL_TID >> 5, n_warps = (RL_NTHREADS + 31u) >> 5;
  uint32_t carry = 0;
  for (uint32_t base = 0; base < n; base += RL_NTHREADS) {
    uint32_t i = base + RL_TID;
    uint32_t mine = i < n ? a[i] : 0u, incl = mine;
    for (uint32_t d = 1; d < 32; d <<= 1) {
      uint32_t up = __shfl_up_sync(RL_FULL_WARP, incl, d);
      if (lane >= d) incl += up;
    }
    if (lane == 31u) sh->warp[warp] = incl;
    RL_SYNC();
    if (warp == 0) {  // warp totals -> each warp's offset; the chunk total after them
      uint32_t total = lane < n_warps ? sh->warp[lane] : 0u, wincl = total;
      for (uint32_t d = 1; d < 32; d <<= 1) {
        uint32_t up = __shfl_up_sync(RL_FULL_WARP, wincl, d);
        if (lane >= d) wincl += up;
      }
      __syncwarp();
      if (lane < n_warps) sh->warp[lane] = wincl - total;
      if (lane == 31u) sh->warp[RL_MAX_THREADS / 32] = wincl;
    }
    RL_SYNC();
    if (i < n) a[i] = carry + sh->warp[warp] + incl - mine;
    carry += sh->warp[RL_MAX_THREADS / 32];
    RL_SYNC();  // the next chunk rewrites sh->warp
  }
  return carry;
#else
  uint32_t run = 0;
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t v = a[i];
    a[i] = run;
    run += v;
  }
  return run;
#endif
}

// Stable ascending sort of idx[0..n) by key[idx[i]]: a least-significant-bit-first radix sort
// over only the bits where the keys differ, each bit one stable split (a scan), so O(n) per bit
// and never an O(n^2) ranking.  tmp and zeros hold n entries each; returns the buffer (idx or
// tmp) that holds the sorted order.
RL_FN uint32_t* rl_radix_sort(const uint32_t* key, uint32_t* idx, uint32_t* tmp, uint32_t* zeros,
                              uint32_t n, RlShared* sh) {
  uint32_t any = 0, all = 0xFFFFFFFFu;
  RL_FOR(i, n) {
    uint32_t k = key[idx[i]];
    any |= k;
    all &= k;
  }
  uint32_t differ = rl_block_or(any, sh) & ~rl_block_and(all, sh);
  for (uint32_t b = 0; b < 32; ++b) {
    if (!((differ >> b) & 1u)) continue;
    RL_FOR(i, n) zeros[i] = (key[idx[i]] >> b) & 1u ? 0u : 1u;
    RL_SYNC();
    uint32_t n_zero = rl_exclusive_scan(zeros, n, sh);  // zeros[i]: zero bits before i
    RL_FOR(i, n) {
      uint32_t dest = (key[idx[i]] >> b) & 1u ? n_zero + (i - zeros[i]) : zeros[i];
      tmp[dest] = idx[i];
    }
    RL_SYNC();
    uint32_t* t = idx;
    idx = tmp;
    tmp = t;
  }
  return idx;
}
