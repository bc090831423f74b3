// Kernels for bench/gpu_limits.py.
//
// Compiled at run time by NVRTC to a CUBIN for the device's own arch (sm_90 on
// H100/H200; sm_90 when there is no GPU). Header-free on purpose: no #include,
// memory ordering through inline PTX, so the same text compiles anywhere NVRTC
// runs. Three translation units are made from this one file:
//   -DRL_GROUP_CORE   doorbell, ping-pong, stamps, timer resolution, empty
//   -DRL_GROUP_GRAPH  conditional-graph bodies (use cudaGraphSetConditional)
//   -DRL_GROUP_DEVLAUNCH  device-side graph launch (use cudaGraphLaunch)
// so that a problem with either graph builtin cannot take the other probes
// down with it.
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
#define RL_EXIT_LAUNCH_ERROR 5
#define RL_EXIT_NOT_RUN 6
#endif

typedef unsigned int rl_u32;
typedef unsigned long long rl_u64;

// ---------------------------------------------------------------- helpers
static __device__ __forceinline__ rl_u64 gtimer() {
    rl_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

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

#ifdef RL_GROUP_CORE

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

// Two resident WHILE graphs on two streams taking turns (ping-pong), and the
// one-graph baseline. Each body is gate -> work -> release:
//   gate     spins until the shared flag says it is this role's turn
//            (flag == 2i + role), then stamps its wake-up;
//   work     stamps its start and holds the SM for work_ns (a stand-in step);
//   release  stamps, hands the turn over (flag = 2i + role + 1) and re-arms
//            the loop while iterations remain.
// The baseline body is work -> release with role RL_PP_SOLO (no flag, no gate).
// state (u32, per role): [0] iterations done, [1] iterations wanted, [2] the
// reason a gate gave up (0 = none); stamps: 3 per iteration (wake, work start,
// release). A gate gives up after wait_ns without its turn or on the shutdown
// word; the loop then ends instead of spinning forever.
#define RL_PP_SOLO 2u

extern "C" __global__ void rl_pp_gate(rl_u32 *flag, rl_u32 role, rl_u32 *state, rl_u64 *stamps, rl_u32 cap,
                                      rl_u32 *ctl, rl_u64 wait_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const rl_u32 i = state[0];
    if (state[2] != 0u) return;
    const rl_u32 want = 2u * i + role;
    const rl_u64 t0 = gtimer();
    rl_u32 spins = 0;
    while ((int)(ld_acquire_gpu(flag) - want) < 0) {
        if ((++spins & 255u) == 0u) {
            if (ld_acquire_sys(ctl + RL_CTL_SHUTDOWN) != 0u) { state[2] = RL_EXIT_SHUTDOWN; return; }
            if (gtimer() - t0 > wait_ns) { state[2] = RL_EXIT_DEADLINE; return; }
        }
    }
    if (i < cap) stamps[3u * i] = gtimer();
}

extern "C" __global__ void rl_pp_work(rl_u32 *state, rl_u64 *stamps, rl_u32 cap, rl_u64 work_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const rl_u32 i = state[0];
    const rl_u64 t0 = gtimer();
    if (i < cap) stamps[3u * i + 1u] = t0;
    if (state[2] != 0u) return;
    while (gtimer() - t0 < work_ns) {
    }
}

extern "C" __global__ void rl_pp_release(cudaGraphConditionalHandle h, rl_u32 *flag, rl_u32 role, rl_u32 *state,
                                         rl_u64 *stamps, rl_u32 cap) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const rl_u32 i = state[0];
    if (i < cap) stamps[3u * i + 2u] = gtimer();
    const rl_u32 c = i + 1u;
    state[0] = c;
    if (role != RL_PP_SOLO) st_release_gpu(flag, 2u * i + role + 1u);
    cudaGraphSetConditional(h, (c < state[1] && c < cap && state[2] == 0u) ? 1u : 0u);
}

#endif  // RL_GROUP_GRAPH

#ifdef RL_GROUP_DEVLAUNCH

// Device-side graph launch. Declared by hand like cudaGraphSetConditional: the
// driver resolves it at load; NVRTC's built-in header has the types. The
// stream handles are the device runtime's named launch modes.
extern "C" __device__ __cudart_builtin__ cudaError_t cudaGraphLaunch(cudaGraphExec_t graph, cudaStream_t stream);
#define RL_MODE_FIRE_AND_FORGET 0u
#define RL_MODE_TAIL 1u
#define RL_MODE_SIBLING 2u

static __device__ __forceinline__ cudaStream_t launch_stream(rl_u32 mode) {
    const unsigned long long named = mode == RL_MODE_TAIL      ? 0x0100000000000000ull
                                     : mode == RL_MODE_SIBLING ? 0x0300000000000000ull
                                                               : 0x0200000000000000ull;
    return (cudaStream_t)named;
}

static __device__ __forceinline__ cudaGraphExec_t current_graph_exec() {
    rl_u64 g;
    asm volatile("mov.u64 %0, %%current_graph_exec;" : "=l"(g));
    return (cudaGraphExec_t)g;
}

// state (u32): [0] launches made, [1] target runs seen. stamps: 2 per launch
// (the launcher's clock just before cudaGraphLaunch, the target's first read).
// errs: cudaGraphLaunch's result per launch.
extern "C" __global__ void rl_dl_launch(cudaGraphExec_t target, rl_u32 mode, rl_u32 *state, rl_u64 *stamps,
                                        int *errs, rl_u32 cap) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const rl_u32 i = state[0];
    if (i >= cap) return;
    state[0] = i + 1u;
    stamps[2u * i] = gtimer();
    errs[i] = (int)cudaGraphLaunch(target, launch_stream(mode));
}

// The launched graph's only node: stamps the launch it belongs to.
extern "C" __global__ void rl_dl_target(rl_u32 *state, rl_u64 *stamps, rl_u32 cap) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const rl_u64 t = gtimer();
    const rl_u32 j = state[1];
    if (j < cap) stamps[2u * j + 1u] = t;
    st_release_gpu(state + 1, j + 1u);
}

// A graph that tail-launches itself until state[0] reaches state[1]: a step
// loop with no WHILE node and no host. stamps[c - 1] = iteration c's start;
// errs[0] = the first failed relaunch's result, errs[1] = its iteration.
extern "C" __global__ void rl_dl_tail_loop(rl_u32 *state, rl_u64 *stamps, int *errs, rl_u32 cap) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const rl_u64 t = gtimer();
    const rl_u32 c = state[0] + 1u;
    state[0] = c;
    if (c <= cap) stamps[c - 1u] = t;
    if (c < state[1] && c < cap) {
        const int e = (int)cudaGraphLaunch(current_graph_exec(), launch_stream(RL_MODE_TAIL));
        if (e != 0 && errs[0] == 0) { errs[0] = e; errs[1] = (int)c; }
    }
}

// A persistent launcher: launches a target fire-and-forget n times, each time
// waiting (up to wait_ns) until that launch has run before the next. Launched
// plainly or as a graph's node, it answers whether a kernel that never returns
// can start step graphs, how soon they start, and how many launches one run of
// its graph allows. Four instantiations of the target take turns, so that a
// launch never finds its graph still finishing the previous run (one instance
// of a graph runs at a time). ctl: DONE0 = launches that ran, EXIT = why it stopped.
extern "C" __global__ void rl_dl_persistent(cudaGraphExec_t g0, cudaGraphExec_t g1, cudaGraphExec_t g2,
                                            cudaGraphExec_t g3, rl_u32 n, rl_u32 *state, rl_u64 *stamps,
                                            int *errs, rl_u32 *ctl, rl_u64 wait_ns, rl_u64 budget_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const rl_u64 t_start = gtimer();
    rl_u32 done = 0, reason = RL_EXIT_DONE;
    for (rl_u32 i = 0; i < n; ++i) {
        const rl_u64 t0 = gtimer();
        stamps[2u * i] = t0;
        state[0] = i + 1u;
        const cudaGraphExec_t target = (i & 3u) == 0u ? g0 : (i & 3u) == 1u ? g1 : (i & 3u) == 2u ? g2 : g3;
        const int e = (int)cudaGraphLaunch(target, launch_stream(RL_MODE_FIRE_AND_FORGET));
        errs[i] = e;
        if (e != 0) { reason = RL_EXIT_LAUNCH_ERROR; break; }
        rl_u32 spins = 0;
        bool bail = false;
        while (ld_acquire_gpu(state + 1) < i + 1u) {
            if ((++spins & 255u) == 0u) {
                const rl_u64 now = gtimer();
                if (now - t0 > wait_ns) { reason = RL_EXIT_NOT_RUN; bail = true; break; }
                if (now - t_start > budget_ns) { reason = RL_EXIT_DEADLINE; bail = true; break; }
                if (ld_acquire_sys(ctl + RL_CTL_SHUTDOWN) != 0u) { reason = RL_EXIT_SHUTDOWN; bail = true; break; }
            }
        }
        if (bail) break;
        done = i + 1u;
    }
    st_release_sys(ctl + RL_CTL_DONE0, done);
    __threadfence_system();
    st_release_sys(ctl + RL_CTL_EXIT, reason);
}

#endif  // RL_GROUP_DEVLAUNCH
