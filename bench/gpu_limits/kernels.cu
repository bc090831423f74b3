// Kernels for bench/gpu_limits.py.
//
// Compiled at run time by NVRTC to a CUBIN for the device's own arch (sm_90 on
// H100/H200; sm_90 when there is no GPU). Header-free on purpose: no #include,
// memory ordering through inline PTX, so the same text compiles anywhere NVRTC
// runs. Two translation units are made from this one file:
//   -DRL_GROUP_CORE   doorbell, ping-pong, stamps, timer resolution, empty
//   -DRL_GROUP_GRAPH  conditional-graph bodies (use cudaGraphSetConditional)
// so that a problem with the conditional-node builtin cannot take the core
// probes down with it.
//
// The control-block word offsets (RL_CTL_*) and exit codes (RL_EXIT_*) are
// passed in as -D options by gpu_limits.py, which owns their values; the
// fallbacks below only keep the file compilable on its own.
//
// Every kernel here is launched with one block of one thread.

#ifndef RL_CTL_SHUTDOWN
#define RL_CTL_SHUTDOWN 0
#define RL_CTL_DOORBELL 1
#define RL_CTL_ANSWER 2
#define RL_CTL_STARTED 3
#define RL_CTL_EXIT 4
#define RL_CTL_HANDLED 5
#define RL_CTL_POLLS_LO 6
#define RL_CTL_POLLS_HI 7
#define RL_CTL_HEARTBEAT 8
#define RL_CTL_DONE0 9
#define RL_CTL_DONE1 10
#define RL_DOORBELL_STOP 0xFFFFFFFFu
#define RL_EXIT_SHUTDOWN 1
#define RL_EXIT_DEADLINE 2
#define RL_EXIT_STOPWORD 3
#define RL_EXIT_DONE 4
#endif

typedef unsigned int rl_u32;
typedef unsigned long long rl_u64;

// ---------------------------------------------------------------- helpers
static __device__ __forceinline__ rl_u64 gtimer() {
    rl_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

#ifdef RL_GROUP_CORE

// acquire/release at system scope (pinned host words) and gpu scope (device flags)
static __device__ __forceinline__ rl_u32 ld_acquire_sys(const rl_u32 *p) {
    rl_u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ void st_release_sys(rl_u32 *p, rl_u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
static __device__ __forceinline__ rl_u32 ld_acquire_gpu(const rl_u32 *p) {
    rl_u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ void st_release_gpu(rl_u32 *p, rl_u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

extern "C" __global__ void rl_empty() {}

// Host -> device doorbell, answered through a second pinned word.
// ctl: a control block in pinned, device-mapped host memory (see RL_CTL_*).
// The host writes a new sequence number into DOORBELL; the kernel echoes it
// into ANSWER. RL_DOORBELL_STOP in DOORBELL, a non-zero SHUTDOWN word, or the
// budget (ns of %globaltimer since start) ends the kernel.
// flags bit 0: write a heartbeat (low 32 bits of %globaltimer) every 64 polls.
extern "C" __global__ void rl_doorbell(rl_u32 *ctl, rl_u32 sleep_ns, rl_u32 use_sleep,
                                       rl_u32 flags, rl_u64 budget_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const rl_u64 t0 = gtimer();
    rl_u32 last = ld_acquire_sys(ctl + RL_CTL_DOORBELL);
    st_release_sys(ctl + RL_CTL_STARTED, 1u);
    rl_u32 handled = 0, reason = 0;
    rl_u64 polls = 0;
    for (;;) {
        const rl_u32 v = ld_acquire_sys(ctl + RL_CTL_DOORBELL);
        ++polls;
        if (v != last) {
            if (v == RL_DOORBELL_STOP) { reason = RL_EXIT_STOPWORD; break; }
            st_release_sys(ctl + RL_CTL_ANSWER, v);
            last = v;
            ++handled;
            continue;
        }
        if ((polls & 63u) == 0u) {
            if (ld_acquire_sys(ctl + RL_CTL_SHUTDOWN) != 0u) { reason = RL_EXIT_SHUTDOWN; break; }
            const rl_u64 now = gtimer();
            if (now - t0 > budget_ns) { reason = RL_EXIT_DEADLINE; break; }
            if (flags & 1u) st_release_sys(ctl + RL_CTL_HEARTBEAT, (rl_u32)now);
        }
        if (use_sleep) __nanosleep(sleep_ns);
    }
    ctl[RL_CTL_HANDLED] = handled;
    ctl[RL_CTL_POLLS_LO] = (rl_u32)polls;
    ctl[RL_CTL_POLLS_HI] = (rl_u32)(polls >> 32);
    __threadfence_system();
    st_release_sys(ctl + RL_CTL_EXIT, reason);
}

// Device -> device handoff through one flag in device memory, between two
// resident kernels (role 0 = ping, role 1 = pong) on two streams.
// Iteration i: ping stamps t_send[i] and publishes 2i+1; pong sees it, stamps
// t_recv[i] (= its t_send[i]) and publishes 2i+2; ping sees that, stamps
// t_recv[i]. So pong.t_recv[i] - ping.t_send[i] is the ping->pong one-way
// latency and ping.t_recv[i] - pong.t_send[i] the pong->ping one.
// ctl (pinned host) supplies SHUTDOWN; the count of finished iterations goes to
// ctl[DONE0 + role]; the budget bounds the whole run.
extern "C" __global__ void rl_pingpong(rl_u32 *flag, rl_u32 role, rl_u32 n, rl_u64 *t_send,
                                       rl_u64 *t_recv, rl_u32 *ctl, rl_u64 budget_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const rl_u64 t0 = gtimer();
    rl_u32 done = 0, reason = RL_EXIT_DONE;
    for (rl_u32 i = 0; i < n; ++i) {
        const rl_u32 want = role == 0u ? 2u * i + 2u : 2u * i + 1u;
        if (role == 0u) {
            t_send[i] = gtimer();
            st_release_gpu(flag, 2u * i + 1u);
        }
        rl_u32 spins = 0;
        bool bail = false;
        for (;;) {
            const rl_u32 v = ld_acquire_gpu(flag);
            if ((int)(v - want) >= 0) break;
            if ((++spins & 1023u) == 0u) {
                if (ld_acquire_sys(ctl + RL_CTL_SHUTDOWN) != 0u) { reason = RL_EXIT_SHUTDOWN; bail = true; break; }
                if (gtimer() - t0 > budget_ns) { reason = RL_EXIT_DEADLINE; bail = true; break; }
            }
        }
        if (bail) break;
        const rl_u64 now = gtimer();
        t_recv[i] = now;
        if (role == 1u) {
            t_send[i] = now;
            st_release_gpu(flag, 2u * i + 2u);
        }
        done = i + 1u;
    }
    st_release_sys(ctl + RL_CTL_DONE0 + role, done);
    __threadfence_system();
    if (role == 0u) st_release_sys(ctl + RL_CTL_EXIT, reason);
}

// out[idx] = %globaltimer (a device-side timestamp between stream operations).
extern "C" __global__ void rl_stamp(rl_u64 *out, rl_u32 idx) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    out[idx] = gtimer();
}

// %globaltimer granularity: out[0] = smallest non-zero step seen, out[1] =
// number of changes, out[2] = span between the first and last reading (ns).
extern "C" __global__ void rl_timer_res(rl_u64 *out, rl_u32 n) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    rl_u64 prev = gtimer();
    const rl_u64 first = prev;
    rl_u64 minstep = ~0ull, changes = 0;
    for (rl_u32 i = 0; i < n; ++i) {
        const rl_u64 t = gtimer();
        if (t != prev) {
            const rl_u64 d = t - prev;
            if (d < minstep) minstep = d;
            ++changes;
            prev = t;
        }
    }
    out[0] = minstep;
    out[1] = changes;
    out[2] = prev - first;
}

#endif  // RL_GROUP_CORE

#ifdef RL_GROUP_GRAPH

// Declared by hand (header-free, no -rdc); the driver resolves it at load.
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);

// Body of a WHILE loop: state[0] counts iterations, state[1] is the limit;
// the condition becomes 0 once the count reaches the limit. Iteration c
// (1-based) stamps stamps[c-1] while c <= cap. state[2] is a hard cap: should
// the condition never reach the graph (a broken cudaGraphSetConditional), the
// kernel traps there instead of looping forever (a sticky error the host sees,
// rather than a hang).
static __device__ __forceinline__ rl_u32 count_iteration(rl_u32 *state, rl_u64 *stamps, rl_u32 cap) {
    const rl_u32 c = state[0] + 1u;
    state[0] = c;
    if (c > state[2]) asm volatile("trap;");
    if (c <= cap) stamps[c - 1u] = gtimer();
    return c;
}

extern "C" __global__ void rl_while_body(cudaGraphConditionalHandle h, rl_u32 *state, rl_u64 *stamps,
                                         rl_u32 cap) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const rl_u32 c = count_iteration(state, stamps, cap);
    cudaGraphSetConditional(h, c < state[1] ? 1u : 0u);
}

// Same, and also selects branch (c-1) % 4 of a SWITCH node that follows it in
// the body graph.
extern "C" __global__ void rl_switch_ctl(cudaGraphConditionalHandle h_while, cudaGraphConditionalHandle h_switch,
                                         rl_u32 *state, rl_u64 *stamps, rl_u32 cap) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const rl_u32 c = count_iteration(state, stamps, cap);
    cudaGraphSetConditional(h_switch, (c - 1u) & 3u);
    cudaGraphSetConditional(h_while, c < state[1] ? 1u : 0u);
}

// One SWITCH branch: counts how often branch k ran.
extern "C" __global__ void rl_branch(rl_u32 *counters, rl_u32 k) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    counters[k] += 1u;
}

#endif  // RL_GROUP_GRAPH
