"""gpu_limits: measure the floors under ringleader's scheduler targets.

Needs numpy, cuda-python (``cuda.bindings``: driver and NVRTC) and, for
probes 4-6 and 10, torch; every driver call goes through the runtime's own helpers
(``device/backends/cuda_driver.py``). The kernels live in ``kernels.cu`` next
to this file; NVRTC compiles them to a CUBIN for the device's own arch (sm_90
when there is no GPU) and the driver API loads and launches them.

Run ``python -m ringleader.bench.lab.gpu_limits [options]`` from the repository root.
Modules: __main__ (CLI, run loop), common (budget, records, statistics,
rescue), report (tee, JSON, table), kernels (control block, NVRTC), device
(context, memory, streams, Probe), then one module per probe: doorbell (1),
handoff (2), launch + conditional (3), torchgraph (4), blocking (5),
roofline (6), memops (7), devlaunch (8), graphpair (9), stepwhile (10).

Probes (``--only 1,3`` runs a subset):
  1 doorbell    host -> device doorbell round trip through pinned host words,
                device polling by spinning and with __nanosleep 0/100/1000 ns
  2 handoff     device -> device one-way latency between two resident kernels
                on two streams through a device-memory flag (%globaltimer)
  3 launch      empty kernel launch, one-node graph launch, per-iteration cost
                of a WHILE conditional graph, and of WHILE + 4-way SWITCH
  4 torchgraph  a torch CUDA graph as a child node inside a WHILE body: does it
                run, does its output match eager torch
  5 blocking    with a persistent kernel on its own non-blocking stream: what
                completes and what blocks (allocations, copies, kernels on other
                streams); does process exit hang with the kernel running
  6 roofline    device-to-device copy bandwidth, bf16 matmul TFLOP/s
  7 memops      cuStreamWaitValue32/WriteValue32 handoff latency across two
                streams; does stream capture turn them into graph nodes
  8 devlaunch   graphs launched from the device: launch -> first kernel in the
                fire-and-forget, tail and sibling modes; a graph that
                tail-launches itself; a persistent kernel launching graphs,
                as a graph node and plain (may it, how soon, how many)
  9 graphpair   two resident WHILE graphs on two streams taking turns through
                a device flag vs one WHILE graph: idle time between steps
 10 stepwhile   a WHILE (no SWITCH) around the real 1-row decode step graph
                (--step-model, default llama-1b): per iteration vs the step's
                own device time, same sampled token

Output: a table on stdout, and in --out-dir (default bench/results)
``<date>-<device>-gpu-limits.json`` and ``.log`` (a tee of stdout/stderr).
``--quick`` and ``--only`` runs get a ``-quick`` / ``-only-N-M`` suffix.

Without a CUDA device (or with --compile-only) the script compiles every
kernel for sm_90, prints its resource use and exits 0.

Safety rules this script keeps: every CUDA call's result is checked; every
persistent kernel polls a shutdown word and has its own time budget
(%globaltimer), so it ends even if the host dies; the host never calls a
device-wide synchronize while a persistent kernel may run; each probe runs in
its own thread with a timeout and a probe that overruns is recorded as
{"status": "timeout"}; a whole-run watchdog writes what it has and exits.
"""
