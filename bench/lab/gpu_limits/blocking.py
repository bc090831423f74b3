"""Probe 5, blocking: with a persistent kernel on its own non-blocking stream, what completes and
what blocks (allocations, copies, kernels on other streams); does process exit hang with the
kernel running (a child process, exit_child)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ringleader.bench.lab.gpu_limits import common
from ringleader.bench.lab.gpu_limits.common import MIB, PTR, U32, U64, Timeout, errdict, sub, wait_until
from ringleader.bench.lab.gpu_limits.device import Probe, run_in_thread, try_init_device
from ringleader.bench.lab.gpu_limits.kernels import CTL_EXIT, CTL_HEARTBEAT, CTL_STARTED, compile_group
from ringleader.device.backends import cuda_driver as drv

REPO = Path(__file__).resolve().parents[3]  # `python -m ringleader.bench.lab.gpu_limits` runs from here


def _blocking_ops(P: Probe, torch) -> list:
    """(name, fn, needs_torch) tried one at a time while the kernel runs."""
    dev = P.dev
    keep: list = []
    tdev = torch.device("cuda", P.args.device) if torch else None
    state: dict = {}
    ops = []

    if torch is not None:
        # warm everything these ops use, before the persistent kernel starts
        side = torch.cuda.Stream(device=tdev)
        t = torch.empty(4096, dtype=torch.uint8, device=tdev)
        with torch.cuda.stream(side):
            t.fill_(1)
            int(t.sum().item())
        t.fill_(2)
        int(t.sum().item())
        n_copy = 64 * MIB
        pat = torch.arange(251, device=tdev, dtype=torch.uint8)
        src = pat.repeat(n_copy // 251 + 1)[:n_copy].contiguous()
        pinned_dst = torch.empty(n_copy, dtype=torch.uint8, pin_memory=True)
        pinned_dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(tdev)
        expect = np.tile(np.arange(251, dtype=np.uint8), n_copy // 251 + 1)[:n_copy]
        state.update(side=side, src=src, expect=expect, pinned_dst=pinned_dst)
        gb = 1024 * MIB

        def torch_empty_new_size():
            before = torch.cuda.memory_reserved(tdev)
            x = torch.empty(gb + 12345, dtype=torch.uint8, device=tdev)
            keep.append(x)
            return {"bytes": gb + 12345, "reserved_grew_bytes": torch.cuda.memory_reserved(tdev) - before}

        def torch_empty_then_kernel_other_stream():
            x = torch.empty(gb + 54321, dtype=torch.uint8, device=tdev)
            keep.append(x)
            with torch.cuda.stream(side):
                x[:4096].fill_(7)
                v = int(x[:4096].sum().item())
            return {"ok": v == 7 * 4096, "sum": v}

        def torch_kernel_default_stream():
            y = torch.empty(4096, dtype=torch.uint8, device=tdev)
            y.fill_(3)
            v = int(y.sum().item())
            return {"ok": v == 3 * 4096, "sum": v}

        def torch_first_use_kernel():
            z = torch.arange(1000, device=tdev, dtype=torch.int16).flip(0).cumsum(0, dtype=torch.int32)
            v = int(z[-1].item())
            return {"ok": v == 499500, "value": v, "what": "a torch kernel never launched before (lazy load)"}

        def torch_pinned_alloc():
            p = torch.empty(64 * MIB, dtype=torch.uint8, pin_memory=True)
            keep.append(p)
            return {"is_pinned": bool(p.is_pinned())}

        def pageable_cpu_copy():
            h = src.cpu()
            return {"ok": bool(np.array_equal(h.numpy(), expect)), "bytes": n_copy}

        def pinned_copy_non_blocking():
            pinned_dst.zero_()
            with torch.cuda.stream(side):
                pinned_dst.copy_(src, non_blocking=True)
                side.synchronize()
            return {"ok": bool(np.array_equal(pinned_dst.numpy(), expect))}

        def torch_graph_capture():
            a = torch.ones(1024, device=tdev)
            with torch.cuda.stream(side):
                gr = torch.cuda.CUDAGraph()
                gr.capture_begin(capture_error_mode="thread_local")
                b = a * 3
                gr.capture_end()
                gr.replay()
                side.synchronize()
                v = float(b.sum().item())
            keep.append(gr)
            return {"ok": v == 3 * 1024, "sum": v}

        def torch_free_empty_cache():
            keep.clear()
            torch.cuda.empty_cache()
            return {"reserved_after": torch.cuda.memory_reserved(tdev)}

        ops += [
            ("torch_empty_new_size", torch_empty_new_size),
            ("torch_empty_then_kernel_other_stream", torch_empty_then_kernel_other_stream),
            ("torch_kernel_default_stream", torch_kernel_default_stream),
            ("torch_first_use_kernel", torch_first_use_kernel),
            ("torch_pinned_alloc", torch_pinned_alloc),
            ("pageable_cpu_copy", pageable_cpu_copy),
            ("pinned_copy_non_blocking", pinned_copy_non_blocking),
            ("torch_graph_capture", torch_graph_capture),
            ("torch_free_empty_cache", torch_free_empty_cache),
        ]

    def cu_mem_host_alloc():
        p = drv.PinnedBuffer(16 * MIB)
        keep.append(p)
        return {"ok": True}

    def cu_mem_alloc_free():
        drv.mem_free(drv.mem_alloc(64 * MIB))
        return {"ok": True}

    def cu_module_load():
        mod = drv.load_image(P.groups["core"]["cubin"])
        drv.get_function(mod, "rl_empty")
        keep.append(mod)
        return {"ok": True}

    def cu_launch_other_stream():
        f = P.fn("rl_empty")
        s = P.work_stream
        drv.launch(f, drv.KernelArgs(), s)
        return {"ok": dev.wait_stream(s, 2.0)}

    ops += [
        ("cuMemHostAlloc", cu_mem_host_alloc),
        ("cuMemAlloc_cuMemFree", cu_mem_alloc_free),
        ("cuModuleLoadData", cu_module_load),
        ("kernel_on_other_nonblocking_stream", cu_launch_other_stream),
    ]

    def cu_mem_free_host():
        n = 0
        for p in [k for k in keep if isinstance(k, drv.PinnedBuffer)]:
            p.free()
            n += 1
        return {"freed": n}

    ops.append(("cuMemFreeHost", cu_mem_free_host))
    return ops


def _exit_test(P: Probe, mode: str) -> dict:
    B = P.B
    budget = B.child_budget_s
    cmd = [
        sys.executable,
        "-m",
        "ringleader.bench.lab.gpu_limits",
        "--_exit-child",
        mode,
        "--device",
        str(P.args.device),
        "--arch",
        P.arch,
        "--_child-budget-s",
        str(budget),
    ]
    res: dict = {"mode": mode, "kernel_own_deadline_s": budget}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=REPO
    )
    lines: list = []
    errs: list = []
    launched = threading.Event()
    t_launch: list = []

    def rd_out():
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("EXIT_CHILD_LAUNCHED"):
                t_launch.append(time.monotonic())
                launched.set()

    def rd_err():
        for line in proc.stderr:
            errs.append(line.rstrip())

    th1 = threading.Thread(target=rd_out, daemon=True)
    th2 = threading.Thread(target=rd_err, daemon=True)
    th1.start()
    th2.start()

    def kill():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except Exception:
            pass
        try:
            proc.wait(10)
        except Exception:
            pass

    deadline = time.monotonic() + B.t(90)
    while not launched.is_set() and proc.poll() is None and time.monotonic() < deadline:
        launched.wait(0.05)
    if not launched.is_set():
        if proc.poll() is None:
            kill()
            res.update(status="timeout", where="child did not report its kernel running")
        else:
            res.update(status="error", error=f"child exited rc={proc.returncode} before launching")
        res["child_stdout"] = lines[-10:]
        res["child_stderr"] = errs[-15:]
        return res
    res["child_start_s"] = round(t_launch[0] - t0, 3)
    limit = budget + B.t(15)
    try:
        rc = proc.wait(timeout=limit)
        exit_s = time.monotonic() - t_launch[0]
        res["returncode"] = rc
        res["exit_s"] = round(exit_s, 3)
        if exit_s < 0.5 * budget:
            res["finding"] = "exits_promptly (context teardown ended the running kernel)"
        elif exit_s >= 0.8 * budget:
            res["finding"] = (
                "exit_waited_for_kernel (returned only when the kernel hit its own deadline: "
                "without one, exit hangs)"
            )
        else:
            res["finding"] = "slow_exit"
        res["status"] = "ok"
    except subprocess.TimeoutExpired:
        kill()
        res.update(status="timeout", finding="exit_hung (killed)", timeout_s=limit)
    th1.join(2)
    th2.join(2)
    res["child_stdout"] = lines[-10:]
    res["child_stderr"] = errs[-15:]
    return res


def probe_blocking(P: Probe) -> dict:
    dev, B = P.dev, P.B
    f = P.fn("rl_doorbell")
    torch = P.torch
    s = P.sched_stream
    out: dict = {
        "what": "a 1-thread persistent kernel polls on its own stream (cuStreamCreateWithPriority, "
        "CU_STREAM_NON_BLOCKING, highest priority); each operation runs in a thread with a "
        f"{B.op_timeout:.0f} s timeout; 'blocked' = still running at the timeout",
        "stream_priority": int(dev.prio_greatest),
        "torch": torch is not None,
        "ops": {},
        "exit": {},
        "table": [],
    }
    if torch is None:
        out["torch_error"] = P.torch_err
    try:
        ops = _blocking_ops(P, torch)
    except Exception as e:
        out["setup_error"] = errdict(e)
        ops = []
    kern: list = []  # [ctl] while running

    def start():
        ctl = dev.new_ctl("blocking probe")
        drv.launch(f, drv.KernelArgs(PTR(ctl.dptr), U32(1000), U32(1), U32(1), U64(B.kernel_budget_ns)), s)
        if not wait_until(lambda: ctl.w[CTL_STARTED] == 1, B.t(20)):
            ctl.stop()
            raise Timeout("persistent kernel did not start")
        kern.append(ctl)
        return ctl

    for name, op in ops:
        if P.tainted:
            out["ops"][name] = {"status": "skipped", "reason": P.tainted}
            continue
        try:
            ctl = kern[0] if kern else start()
        except Exception as e:
            out["ops"][name] = errdict(e)
            break
        hb0 = int(ctl.w[CTL_HEARTBEAT])
        rec, th, box = run_in_thread(op, B.t(B.op_timeout), P.thread_init, name=f"op-{name}")
        time.sleep(0.005)
        rec["kernel_still_running"] = bool(int(ctl.w[CTL_EXIT]) == 0 and int(ctl.w[CTL_HEARTBEAT]) != hb0)
        if rec["status"] == "completed" and rec["elapsed_ms"] > 1000 * B.t(B.op_timeout):
            # it held the GIL while blocked, so the timeout could not fire; it returned
            # only when the kernel reached its own deadline
            rec["status"] = "blocked"
            rec["after_kernel_shutdown"] = "completed (held the GIL until the kernel's own deadline)"
        if rec["status"] == "blocked" and "after_kernel_shutdown" not in rec:
            P.stop_and_wait(ctl, s, f"blocking probe ({name})")
            kern.clear()
            th.join(B.t(15))
            rec["after_kernel_shutdown"] = (
                box.get("status", "still_blocked") if not th.is_alive() else "still_blocked"
            )
            if th.is_alive():
                P.taint(f"operation {name} stayed blocked after the kernel exited")
            elif "elapsed_ms" in box:
                rec["elapsed_ms_total"] = round(box["elapsed_ms"], 3)
        if kern and int(ctl.w[CTL_EXIT]) != 0:
            # the kernel ended by itself (its own deadline?): the next op starts a fresh one
            rec["kernel_exit"] = ctl.exit_reason
            dev.wait_stream(s, B.t(5))
            kern.clear()
        res_ok = (rec.get("result") or {}).get("ok") if isinstance(rec.get("result"), dict) else None
        if res_ok is False:
            rec["check"] = "FAILED"
        out["ops"][name] = rec
        note = rec["status"]
        if rec["status"] == "blocked":
            note += f" (after shutdown: {rec.get('after_kernel_shutdown')})"
        if res_ok is False:
            note += ", WRONG RESULT"
        out["table"].append([f"with kernel running: {name}", rec.get("elapsed_ms"), None, "ms", note])
    if kern:
        P.stop_and_wait(kern[0], s, "blocking probe")
        out["kernel_exit"] = kern[0].exit_reason
    for mode in B.exit_modes:
        if mode == "torch" and torch is None:
            out["exit"][mode] = {"status": "skipped", "reason": "torch unavailable"}
            continue
        r = sub(_exit_test, P, mode)
        out["exit"][mode] = r
        out["table"].append(
            [
                f"process exit, kernel running ({mode})",
                r.get("exit_s"),
                None,
                "s",
                r.get("finding") or r.get("status", ""),
            ]
        )
    statuses = [r.get("status") for r in out["ops"].values()] + [
        r.get("status") for r in out["exit"].values()
    ]
    out["status"] = (
        "ok" if all(st in ("completed", "blocked", "ok", "skipped") for st in statuses) else "partial"
    )
    return out


def exit_child(args) -> int:
    """Child of the exit test: start a persistent kernel and exit with it running."""
    common.keep_kernels_running()
    dev, why = try_init_device(args.device)
    if dev is None:
        print(f"EXIT_CHILD_ERROR {why}", flush=True)
        return 3
    if args._exit_child == "torch":
        import torch

        torch.cuda.set_device(args.device)
        t = torch.ones(1024, device=f"cuda:{args.device}")
        float(t.sum().item())
        dev.make_current()
    info = compile_group("core", args.arch or dev.arch)
    if not info["ok"]:
        print(f"EXIT_CHILD_ERROR compile: {info['error']}", flush=True)
        return 3
    mod = drv.load_image(info["cubin"])
    f = drv.get_function(mod, "rl_doorbell")
    s = dev.stream(high_priority=True)
    ctl = dev.new_ctl("exit child")
    budget = int(float(args._child_budget_s) * 1e9)
    drv.launch(f, drv.KernelArgs(PTR(ctl.dptr), U32(1000), U32(1), U32(1), U64(budget)), s)
    if not wait_until(lambda: ctl.w[CTL_STARTED] == 1, 30):
        print("EXIT_CHILD_ERROR kernel did not start", flush=True)
        return 3
    print("EXIT_CHILD_LAUNCHED", flush=True)
    return 0  # the interpreter exits normally with the kernel still polling
