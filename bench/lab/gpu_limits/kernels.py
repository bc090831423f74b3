"""The probe kernels (kernels.cu): control-block layout shared with them, NVRTC compile, resource table."""

from __future__ import annotations

import time
from pathlib import Path

from ringleader.device.sched.build import NvrtcError, nvrtc_compile, parse_ptxas_log

KERNEL_SRC = Path(__file__).resolve().parent / "kernels.cu"
COMPILE_TAG = "GPU_LIMITS_COMPILE"

# ----------------------------------------------------------------------------
# Control block shared with the kernels (u32 words in pinned, device-mapped
# host memory). These values are passed to NVRTC as -D options.
CTL_SHUTDOWN = 0
CTL_DOORBELL = 1
CTL_ANSWER = 2
CTL_STARTED = 3
CTL_EXIT = 4
CTL_HANDLED = 5
CTL_POLLS_LO = 6
CTL_POLLS_HI = 7
CTL_HEARTBEAT = 8
CTL_DONE0 = 9
CTL_DONE1 = 10
CTL_WORDS = 64  # 256 bytes per block: no two blocks share a 128-byte line
DOORBELL_STOP = 0xFFFFFFFF
EXIT_SHUTDOWN, EXIT_DEADLINE, EXIT_STOPWORD, EXIT_DONE = 1, 2, 3, 4
EXIT_LAUNCH_ERROR, EXIT_NOT_RUN = 5, 6  # a device-side graph launch failed / never ran in time
EXIT_NAMES = {
    0: "still_running",
    EXIT_SHUTDOWN: "shutdown_word",
    EXIT_DEADLINE: "own_deadline",
    EXIT_STOPWORD: "stop_word",
    EXIT_DONE: "done",
    EXIT_LAUNCH_ERROR: "launch_error",
    EXIT_NOT_RUN: "launched_graph_never_ran",
}

KERNEL_GROUPS = {
    "core": ("rl_empty", "rl_doorbell", "rl_pingpong", "rl_stamp", "rl_timer_res"),
    "graph": ("rl_while_body", "rl_switch_ctl", "rl_branch", "rl_pp_gate", "rl_pp_work", "rl_pp_release"),
    "devlaunch": ("rl_dl_launch", "rl_dl_target", "rl_dl_tail_loop", "rl_dl_persistent"),
}
ALL_KERNELS = tuple(k for g in KERNEL_GROUPS.values() for k in g)
KERNEL_GROUP_OF = {k: g for g, ks in KERNEL_GROUPS.items() for k in ks}


def kernel_defines() -> list[str]:
    d = {
        "RL_CTL_SHUTDOWN": CTL_SHUTDOWN,
        "RL_CTL_DOORBELL": CTL_DOORBELL,
        "RL_CTL_ANSWER": CTL_ANSWER,
        "RL_CTL_STARTED": CTL_STARTED,
        "RL_CTL_EXIT": CTL_EXIT,
        "RL_CTL_HANDLED": CTL_HANDLED,
        "RL_CTL_POLLS_LO": CTL_POLLS_LO,
        "RL_CTL_POLLS_HI": CTL_POLLS_HI,
        "RL_CTL_HEARTBEAT": CTL_HEARTBEAT,
        "RL_CTL_DONE0": CTL_DONE0,
        "RL_CTL_DONE1": CTL_DONE1,
        "RL_EXIT_SHUTDOWN": EXIT_SHUTDOWN,
        "RL_EXIT_DEADLINE": EXIT_DEADLINE,
        "RL_EXIT_STOPWORD": EXIT_STOPWORD,
        "RL_EXIT_DONE": EXIT_DONE,
        "RL_EXIT_LAUNCH_ERROR": EXIT_LAUNCH_ERROR,
        "RL_EXIT_NOT_RUN": EXIT_NOT_RUN,
    }
    out = [f"-D{k}={v}" for k, v in d.items()]
    out.append(f"-DRL_DOORBELL_STOP={DOORBELL_STOP:#x}u")
    return out


def parse_ptxas(log: str) -> dict:
    """Per-function resource use from NVRTC's --ptxas-options=-v log (the runtime's parser), as
    this probe's JSON keys; stack and spill bytes the log leaves out count as 0."""
    return {
        name: {
            "regs": r.registers,
            "smem_bytes": r.shared_bytes,
            "stack_bytes": r.stack_bytes or 0,
            "spill_store_bytes": r.spill_bytes or 0,
            "spill_load_bytes": r.spill_load_bytes or 0,
            "cmem0_bytes": r.cmem0_bytes,
        }
        for name, r in parse_ptxas_log(log).items()
    }


# ----------------------------------------------------------------------------
# NVRTC


def nvrtc_version() -> str:
    try:
        from ringleader.device.sched.build import nvrtc_version as version

        return "%d.%d" % version()
    except Exception as e:
        return f"unknown ({type(e).__name__}: {e})"


def compile_group(group: str, arch: str, src: str | None = None) -> dict:
    """Compile one kernel group to a CUBIN. Never raises; see 'ok'/'error'."""
    if src is None:
        src = KERNEL_SRC.read_text()
    info = {
        "group": group,
        "arch": arch,
        "ok": False,
        "error": None,
        "log": "",
        "cubin": None,
        "cubin_bytes": 0,
        "compile_s": None,
        "options": None,
        "kernels": {},
    }
    opts = [
        f"--gpu-architecture={arch}",
        "--std=c++17",
        "--ptxas-options=-v",
        f"-DRL_GROUP_{group.upper()}=1",
        *kernel_defines(),
    ]
    info["options"] = opts
    t0 = time.perf_counter()
    name = f"gpu_limits_{group}.cu"
    try:
        try:
            out = nvrtc_compile(src, name, opts)
        except NvrtcError as e:
            if e.result != "NVRTC_ERROR_INVALID_OPTION":
                raise
            # an NVRTC without --ptxas-options: compile anyway, resources unknown
            opts = [o for o in opts if not o.startswith("--ptxas-options")]
            info["options"] = opts
            out = nvrtc_compile(src, name, opts)
        info["log"] = out.log
        info["cubin"] = out.cubin
        info["cubin_bytes"] = len(out.cubin)
        res_use = parse_ptxas(info["log"])
        for k in KERNEL_GROUPS[group]:
            present = k in res_use or (b".text." + k.encode()) in info["cubin"]
            d = {"ok": bool(present), "group": group}
            d.update(res_use.get(k, {}))
            info["kernels"][k] = d
        info["ok"] = all(v["ok"] for v in info["kernels"].values())
        if not info["ok"]:
            info["error"] = "kernel(s) missing from the CUBIN: " + ", ".join(
                k for k, v in info["kernels"].items() if not v["ok"]
            )
    except Exception as e:
        if isinstance(e, NvrtcError):
            info["log"] = e.log
        info["error"] = f"{type(e).__name__}: {e}"
        for k in KERNEL_GROUPS[group]:
            info["kernels"].setdefault(k, {"ok": False, "group": group})
    info["compile_s"] = round(time.perf_counter() - t0, 3)
    return info


def compile_all(arch: str) -> dict:
    src = KERNEL_SRC.read_text()
    return {g: compile_group(g, arch, src) for g in KERNEL_GROUPS}


def compile_summary(groups: dict, arch: str) -> dict:
    kernels = {}
    for g in groups.values():
        kernels.update(g["kernels"])
    n_ok = sum(1 for v in kernels.values() if v.get("ok"))
    return {
        "arch": arch,
        "nvrtc": nvrtc_version(),
        "n_expected": len(ALL_KERNELS),
        "n_compiled": n_ok,
        "ok": n_ok == len(ALL_KERNELS),
        "groups": {
            k: {
                "ok": v["ok"],
                "error": v["error"],
                "cubin_bytes": v["cubin_bytes"],
                "compile_s": v["compile_s"],
                "options": v["options"],
                "log": v["log"][-4000:],
            }
            for k, v in groups.items()
        },
        "kernels": kernels,
    }


def print_kernel_table(summary: dict, loaded: dict | None = None) -> None:
    print(
        f"\nkernels (NVRTC {summary['nvrtc']}, {summary['arch']}; ptxas -v"
        + ("; driver attributes after load" if loaded else "")
        + ")"
    )
    hdr = f"  {'kernel':<18}{'group':<11}{'ok':<4}{'regs':>5}{'smem':>6}{'stack':>6}{'spill_st':>9}{'spill_ld':>9}"
    if loaded:
        hdr += f"  {'drv_regs':>8}{'local':>6}{'smem':>6}"
    print(hdr)
    for name in ALL_KERNELS:
        k = summary["kernels"].get(name, {})

        def f(x):
            return "-" if x is None else str(x)

        line = (
            f"  {name:<18}{k.get('group', '?'):<11}{'yes' if k.get('ok') else 'NO':<4}{f(k.get('regs')):>5}"
            f"{f(k.get('smem_bytes')):>6}{f(k.get('stack_bytes')):>6}{f(k.get('spill_store_bytes')):>9}"
            f"{f(k.get('spill_load_bytes')):>9}"
        )
        if loaded:
            a = loaded.get(name) or {}
            line += f"  {f(a.get('num_regs')):>8}{f(a.get('local_bytes')):>6}{f(a.get('shared_bytes')):>6}"
        print(line)
    for g, v in summary["groups"].items():
        if v["error"]:
            print(f"  group {g}: {v['error'].splitlines()[0]}")
