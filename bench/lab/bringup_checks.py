"""The GPU bring-up's own checks, one per stage of bench/lab/gpu_bringup.py, each run in a process of
its own: `python -m ringleader.bench.lab.bringup_checks module|graphs|backend ...`.

Each prints what it found, writes its key figures as JSON to $RL_BRINGUP_RESULT (when set) and
exits 1 when a check failed, so the runner can mark the stage and go on with the next.
  module   compile the scheduler for this GPU, load it (CUBIN; and the PTX on its own, to know
           whether the fallback would work), fetch every kernel
  graphs   capture every bucket's step graph, check that each may sit in a conditional body,
           replay each alone, and compare graph replays with the eager static step over a run
           driven by the real scheduler (fp32: near-exact; bf16: within the tolerance below);
           with --embed MODEL, also build the CUDA backend for MODEL at the server's defaults
           (its step graphs captured, checked and wrapped in the resident WHILE/SWITCH launch
           graph, instantiated and uploaded) without launching anything: what the bubble stages
           run, tried before they need it
  backend  a real server on 127.0.0.1 with the CUDA backend: greedy parity with an eager
           reference (a token may differ only where the reference's top two nearly tie), 32
           concurrent streams with exactly one done each, the launch mode that runs, the
           device counters and timeline, and a bounded stop

A check that starts the scheduler kernel gives it a run budget a little below the stage's
timeout ($RL_BRINGUP_TIMEOUT_S, set by the runner), so a kernel left behind ends by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

# Relative L2 error of graph logits against eager logits: fp32 replays the same kernels, so
# only reduction-order noise is allowed; bf16 operands sit between 1e-3 and 1e-2 of fp64.
LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}


def kernel_run_budget_s(default_stage_s: float = 260.0) -> float:
    """The scheduler kernel's run budget: 20 s less than the stage's timeout (at least 10 s)."""
    return max(10.0, float(os.environ.get("RL_BRINGUP_TIMEOUT_S", default_stage_s)) - 20.0)


def write_result(figures: dict) -> None:
    print("BRINGUP_RESULT " + json.dumps(figures, default=str), flush=True)
    path = os.environ.get("RL_BRINGUP_RESULT")
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=2, default=str)


# ---- module ---------------------------------------------------------------------------------
def check_module() -> dict:
    import torch

    from ringleader.device.backends import cuda_driver as drv
    from ringleader.device.backends.cuda import SCHED_THREADS, device_arch
    from ringleader.device.sched.build import KERNELS, compile_kernel

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # makes torch's primary context current
    arch = device_arch()
    build = compile_kernel(arch, threads=SCHED_THREADS)
    figures = {
        "arch": arch,
        "nvrtc": "%d.%d" % build.nvrtc_version,
        "driver": "%d.%d" % drv.driver_version(),
        "ptx_isa": build.ptx_isa,
        "kernels": {n: vars(r) for n, r in build.resources.items()},
    }
    module, how = drv.load_module(build)
    figures["loaded_from"] = how
    for name in KERNELS:
        drv.get_function(module, name)
    try:  # the fallback path on its own, so a refused CUBIN later is not the first test of it
        ptx_module = drv.check(drv.cu.cuModuleLoadData(build.ptx), "cuModuleLoadData(ptx)")
        for name in KERNELS:
            drv.get_function(ptx_module, name)
        figures["ptx_loads"] = True
    except drv.CudaError as exc:
        figures["ptx_loads"] = f"no: {exc}"
    figures["ok"] = True
    return figures


# ---- graphs ---------------------------------------------------------------------------------
def _submit_all(driver, rng) -> None:
    """Prompts of every length class, greedy and sampled, all running to max_tokens."""
    from ringleader.ipc import layout as L

    requests = [
        (21, 5, 0.0, 1.0, 0, 0),
        (3, 6, 0.8, 0.9, 0, 11),
        (9, 4, 1.0, 1.0, 20, 12),
        (2, 3, 0.0, 1.0, 0, 0),
        (40, 4, 0.7, 0.95, 50, 13),
        (5, 5, 1.2, 1.0, 0, 14),
        (1, 8, 0.0, 1.0, 0, 0),
        (60, 3, 0.0, 1.0, 0, 0),
        (7, 9, 0.9, 0.8, 5, 15),
    ]
    for plen, max_tokens, temperature, top_p, top_k, seed in requests:
        driver.submit(
            rng.integers(3, 250, plen),
            max_tokens,
            flags=L.SqFlag.IGNORE_EOS,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
        )


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_graphs(dtype_name: str, model_name: str = "tiny", *, device: str = "cuda", graphs_cls=None) -> dict:
    """graphs_cls: StepGraphs unless a test passes a stand-in (CUDA graphs need a GPU)."""
    import torch

    from ringleader.device.backends import cuda_driver as drv
    from ringleader.device.backends.cuda import default_buckets
    from ringleader.device.backends.cuda_graph_rules import GraphNotEmbeddable, check_conditional_body
    from ringleader.device.backends.step_graphs import StepGraphs
    from ringleader.device.model import LlamaModel
    from ringleader.device.step.static_step import GRAPH_SCORE_ROWS, StaticStep
    from ringleader.device.step.step_layout import StepLayout
    from ringleader.ipc import layout as L
    from ringleader.ipc.rings import RingConfig
    from tests.sched_driver import Driver, scheduler

    dtype = getattr(torch, dtype_name)
    n_slots, max_ctx, budget = 8, 256, 32
    buckets = default_buckets(budget)
    model = LlamaModel.from_spec(model_name, dtype, device, 0)
    cfg = RingConfig(
        n_slots=n_slots,
        max_ctx=max_ctx,
        token_budget=budget,
        buckets=buckets,
        sq_size=64,
        cq_size=4096,
        arena_size=1 << 12,
        pending_cap=64,
        score_rows=min(GRAPH_SCORE_ROWS, budget),  # the product's graphs score prompt rows too
    )
    kv_e, kv_g = (StaticStep.new_kv_cache(model, cfg.n_pages, cfg.page_size) for _ in range(2))
    attention = "triton" if device == "cuda" else "torch"  # the product's kernel wherever it runs
    step_e, step_g = (
        StaticStep(model, kv, n_slots, max_ctx, budget, attention=attention, score_rows=cfg.score_rows)
        for kv in (kv_e, kv_g)
    )
    lay_e, lay_g = (
        StepLayout.allocate(n_slots, budget, device, cfg.pages_per_slot, score_rows=cfg.score_rows)
        for _ in range(2)
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if graphs_cls is None:
        drv.check(drv.cu.cuInit(0), "cuInit")
    t0 = time.perf_counter()
    graphs = (graphs_cls or StepGraphs)(
        step_g, lay_g, buckets, torch.cuda.Stream() if device == "cuda" else None, keep_outputs=True
    )
    figures = {
        "dtype": dtype_name,
        "model": model_name,
        "buckets": list(buckets),
        "capture_s": round(time.perf_counter() - t0, 2),
        "nodes": {},
        "embeddable": True,
    }
    for b in buckets:
        nodes, programmatic = graphs.read(b)
        try:
            figures["nodes"][b] = check_conditional_body(nodes, b, programmatic).summary()
        except GraphNotEmbeddable as exc:
            figures["embeddable"] = False
            figures["nodes"][b] = str(exc)
    lay_g.next_token.fill_(-7)
    for b in buckets:  # each bucket alone on the all-pad layout: runs, and writes no token
        graphs[b].replay()
    sync()
    figures["replay_alone_ok"] = bool((lay_g.next_token == -7).all())

    d = Driver(cfg)
    _submit_all(d, np.random.default_rng(5))
    worst, mismatched, decided, seen, n_steps = 0.0, 0, 0, set(), 0
    for _ in range(400):
        d.rings.submissions.publish()
        status = scheduler().step(d.mem.context_address)
        if status == L.StepStatus.IDLE:
            d.drain_cq()  # the DONE events of the last step's outputs
            break
        h = d.a["step"][0]
        bucket, ns = int(h["bucket"]), int(h["n_samples"])
        seen.add(bucket)
        n_steps += 1
        lay_e.copy_from_arrays(d.a)
        lay_g.copy_from_arrays(d.a)
        lay_e.next_token.copy_(torch.from_numpy(d.a["next_token"]))
        lay_g.next_token.copy_(lay_e.next_token)
        logits_e = step_e.run(bucket, lay_e)
        graphs[bucket].replay()
        sync()
        logits_g = graphs.outputs[bucket]
        if ns:
            worst = max(worst, _rel(logits_g[:ns], logits_e[:ns]))
            # a token may differ only where the two logit vectors nearly tie at the top
            top2 = logits_e[:ns].topk(2, dim=-1).values
            margin = top2[:, 0] - top2[:, 1]
            noise = (logits_g[:ns] - logits_e[:ns]).abs().amax(dim=-1)
            firm = margin > 2 * noise
            greedy = torch.from_numpy(d.a["sample_params"]["temperature"][:ns].copy()).to(device) == 0
            slots = torch.from_numpy(d.a["sample_slot"][:ns].astype(np.int64)).to(device)
            differ = lay_g.next_token[slots] != lay_e.next_token[slots]
            decided += int((firm & greedy).sum())
            mismatched += int((differ & firm & greedy).sum())
        d.a["next_token"][:] = lay_g.next_token.cpu().numpy()  # the graph's tokens drive the run
        d.drain_cq()
    tol = LOGIT_TOLERANCE[dtype_name]
    figures.update(
        steps=n_steps,
        buckets_run=sorted(seen),
        logit_rel_err=worst,
        logit_tolerance=tol,
        kv_rel_err=max(_rel(kv_g.k, kv_e.k), _rel(kv_g.v, kv_e.v)),
        greedy_rows_decided=decided,
        greedy_rows_mismatched=mismatched,
        all_finished=all(r.done for r in d.records.values()),
    )
    figures["ok"] = bool(
        figures["embeddable"]
        and figures["replay_alone_ok"]
        and worst <= tol
        and figures["kv_rel_err"] <= tol
        and mismatched == 0
        and decided > 0
        and figures["all_finished"]
        and len(seen) >= 3
    )
    return figures


def check_embed(model_name: str, *, backend_cls=None) -> dict:
    """The CUDA backend for `model_name` at the server's defaults (as `ringleader serve` and the
    bench's servers build it), resident launch asked for, built and released without a launch."""
    import torch

    from ringleader.device.engine_config import EngineConfig

    if backend_cls is None:
        from ringleader.device.backends.cuda import CudaBackend as backend_cls
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # what earlier checks in this process left cached
    config = EngineConfig(model=model_name, launch="resident")
    figures: dict = {"model": model_name, "n_slots": config.n_slots, "token_budget": config.token_budget}
    t0 = time.perf_counter()
    try:
        backend = backend_cls(config)
    except Exception as exc:  # LaunchUnavailable names the CUDA error; GraphNotEmbeddable the node
        figures.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        return figures
    try:
        figures["build_s"] = round(time.perf_counter() - t0, 2)
        d = backend.description
        figures.update(
            {
                k: d.get(k)
                for k in ("dtype", "buckets", "launch", "module", "max_ctx", "kv_pages", "kv_cache_mib")
            }
        )
        figures["step_graph_nodes"] = d.get("step_graph_nodes")
    finally:
        backend.stop()  # never started: frees what the construction allocated
    figures["ok"] = figures.get("launch") == "resident"
    return figures


# ---- backend --------------------------------------------------------------------------------
def greedy_agreement(reference, prompts, got, want, tolerance: float) -> dict:
    """Greedy tokens from the backend (`got`) against the eager reference's (`want`), per prompt.

    Two implementations on different kernels agree exactly unless the reference's best two
    logits nearly tie.  So at the first position where a prompt's tokens differ, the reference's
    logits there (same prefix on both sides) decide: a tie when the backend's token scores
    within `tolerance` x the largest |logit| of the reference's best, a mismatch otherwise.
    After a tie the two continue from different contexts, so nothing later is compared."""
    exact, ties, mismatched = [], [], []
    for i, (prompt, g, w) in enumerate(zip(prompts, got, want)):
        j = next((k for k in range(min(len(g), len(w))) if g[k] != w[k]), None)
        if j is None:
            (exact if len(g) == len(w) else mismatched).append(i)
            continue
        logits = reference.prompt_logits(list(prompt) + list(w[:j])).double()
        gap = float(logits[w[j]] - logits[g[j]])
        scale = float(logits.abs().max())
        entry = {"prompt": i, "index": j, "want": int(w[j]), "got": int(g[j]), "gap": gap, "scale": scale}
        (ties if gap <= tolerance * scale else mismatched).append(entry)
    return {"exact_prompts": exact, "tie_divergences": ties, "mismatched": mismatched}


def check_backend(scheduler_mode: str, launch: str, *, backend_cls=None, device: str = "cuda") -> dict:
    """backend_cls: CudaBackend unless a test passes another (the check's own logic on a CPU)."""
    import torch

    from ringleader.device.backends.cuda import CudaBackend
    from ringleader.device.model import LlamaModel, generate_greedy
    from ringleader.ipc.client import Client
    from tests.conftest import RawPeer, running_server
    from tests.test_server import collect

    prompts = [[1, 2, 3], list(range(5, 60)), [7] * 9]
    options = dict(
        scheduler=scheduler_mode,
        launch=launch,
        dtype=torch.float32,
        n_slots=16,
        max_ctx=512,
        token_budget=64,
        run_budget_s=kernel_run_budget_s(),
    )
    figures = {"scheduler": scheduler_mode, "launch_requested": launch}
    t0 = time.perf_counter()
    with running_server("tiny", backend_cls=backend_cls or CudaBackend, **options) as bg:
        backend = bg.server.backend
        figures["startup_s"] = round(time.perf_counter() - t0, 2)
        figures["description"] = backend.description
        with Client(bg.address, timeout=120) as c:
            got = [c.complete(prompt_ids=p, max_tokens=24, ignore_eos=True).token_ids for p in prompts]
            peer = RawPeer(bg.address)
            t1 = time.perf_counter()
            for i in range(32):
                peer.send(
                    {
                        "op": "generate",
                        "id": i,
                        "prompt_ids": [1 + i % 200] * (1 + i % 7),
                        "max_tokens": 16 + i % 16,
                        "ignore_eos": True,
                    }
                )
            tokens, dones, order_ok = collect(peer, 32, timeout=180)
            figures["streams_s"] = round(time.perf_counter() - t1, 3)
            peer.close()
            stats = c.stats()
        t2 = time.perf_counter()
        bg.stop()  # raises EngineDead if the kernel or the graph did not end
        figures["stop_s"] = round(time.perf_counter() - t2, 3)
        counters = backend.rings.counters()
    ref_model = LlamaModel.from_preset("tiny", torch.float32, device)
    want = [generate_greedy(ref_model, p, 24) for p in prompts]
    dev = stats["device"]
    agreement = greedy_agreement(ref_model, prompts, got, want, LOGIT_TOLERANCE["float32"])
    figures.update(
        launch_running=backend.description["launch"],
        parity=not agreement["mismatched"],
        exact_prompts=agreement["exact_prompts"],
        tie_divergences=agreement["tie_divergences"],
        mismatched_prompts=agreement["mismatched"],
        streams_one_done_each=bool(
            order_ok and len(dones) == 32 and all(len(v) == 1 for v in dones.values())
        ),
        streams_tokens_ok=all(len(tokens[i]) == 16 + i % 16 for i in range(32)),
        exit_reason=counters["exit_reason_name"],
        state=counters["state_name"],
        device={
            k: dev.get(k)
            for k in (
                "steps",
                "generated",
                "finished",
                "cq_stalls",
                "idle_polls",
                "bubble_us_p50",
                "bubble_us_p99",
                "bubble_gaps",
                "idle_gaps",
                "handoff_us_p50",
                "launch_us_p50",
                "overlap_overruns",
                "step_us_p50",
                "step_us_p99",
                "device_sched_us_p50",
                "device_sched_us_p99",
                "device_overlap_us_p50",
                "sched_critical_us_p50",
                "sched_step_us_p50",
                "model_step_us_p50",
            )
        },
        thread_cpu_s=stats.get("thread_cpu_s"),
    )
    expected_launch = "host-loop" if scheduler_mode == "host" else (None if launch == "auto" else launch)
    ok = figures["parity"] and figures["streams_one_done_each"] and figures["streams_tokens_ok"]
    ok &= expected_launch is None or figures["launch_running"] == expected_launch
    if scheduler_mode == "device":
        ok &= figures["exit_reason"] == "shutdown"
    # on CUDA the timeline must have filled in both modes: the bubble is what we sell, one definition
    timed = ("bubble_us_p50", "step_us_p50") if device == "cuda" or scheduler_mode == "device" else ()
    timed += ("device_sched_us_p50",) if scheduler_mode == "device" else ()
    ok &= all(dev.get(k) is not None for k in timed)
    figures["ok"] = bool(ok)
    return figures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ringleader.bench.lab.bringup_checks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="check", required=True)
    sub.add_parser("module")
    g = sub.add_parser("graphs")
    g.add_argument("--dtype", choices=sorted(LOGIT_TOLERANCE), default="float32")
    g.add_argument("--model", default="tiny")
    g.add_argument(
        "--embed",
        metavar="MODEL",
        help="also build the CUDA backend for MODEL (resident launch graph, not launched)",
    )
    b = sub.add_parser("backend")
    b.add_argument("--scheduler", choices=["device", "host"], default="device")
    b.add_argument("--launch", choices=["auto", "pingpong", "resident", "pump"], default="auto")
    args = p.parse_args(argv)
    try:
        if args.check == "module":
            figures = check_module()
        elif args.check == "graphs":
            figures = check_graphs(args.dtype, args.model)
            if args.embed:
                figures["embed"] = check_embed(args.embed)
                figures["ok"] = bool(figures["ok"] and figures["embed"]["ok"])
        else:
            figures = check_backend(args.scheduler, args.launch)
    except BaseException as exc:
        traceback.print_exc()
        figures = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    write_result(figures)
    print(("PASSED" if figures.get("ok") else "FAILED") + f": {args.check}", flush=True)
    return 0 if figures.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
