"""Probe 6, roofline: device-to-device copy bandwidth and bf16 matmul TFLOP/s through torch."""

from __future__ import annotations

import numpy as np

from ringleader.bench.lab.gpu_limits.common import GIB, MIB, sub, summarize
from ringleader.bench.lab.gpu_limits.device import Probe


def probe_roofline(P: Probe) -> dict:
    torch = P.need_torch()
    P.require_clean()
    B = P.B
    tdev = torch.device("cuda", P.args.device)
    out: dict = {
        "what": "device-to-device copy (bytes read + written) and bf16 matmul through torch, "
        "timed with CUDA events after warm-up, random data",
        "table": [],
    }

    def copy_bw():
        free, _total = torch.cuda.mem_get_info(tdev)
        nbytes = B.copy_bytes
        while nbytes > 64 * MIB and 2.2 * nbytes > free:
            nbytes //= 2
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=tdev)
        dst = torch.empty_like(src)
        for _ in range(2):
            dst.copy_(src)
        times = []
        for _ in range(B.copy_reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        ok = bool(torch.equal(dst, src))
        del src, dst
        torch.cuda.empty_cache()
        ms = np.array(times)
        tbs = 2 * nbytes / (ms * 1e-3) / 1e12
        return {
            "bytes_per_buffer": nbytes,
            "ms": summarize(ms * 1e6),
            "tb_per_s_median": float(np.median(tbs)),
            "tb_per_s_best": float(tbs.max()),
            "check": {"ok": ok, "what": "dst == src after the copy"},
        }

    def matmul():
        n = B.mm_n
        gen = torch.Generator(device=tdev)
        gen.manual_seed(7)
        a = torch.randn(n, n, device=tdev, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(n, n, device=tdev, dtype=torch.bfloat16, generator=gen)
        c = torch.empty(n, n, device=tdev, dtype=torch.bfloat16)
        for _ in range(3):
            torch.matmul(a, b, out=c)
        times = []
        for _ in range(B.mm_reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.matmul(a, b, out=c)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        ref = a[:64].double().cpu() @ b[:, :64].double().cpu()
        got = c[:64, :64].double().cpu()
        rel = float((got - ref).norm() / ref.norm())
        del a, b, c
        torch.cuda.empty_cache()
        ms = np.array(times)
        tf = 2 * n**3 / (ms * 1e-3) / 1e12
        return {
            "n": n,
            "ms": summarize(ms * 1e6),
            "tflops_median": float(np.median(tf)),
            "tflops_best": float(tf.max()),
            "rel_err_vs_fp64_block": rel,
            "check": {"ok": rel < 2e-2, "what": "64x64 block vs float64 CPU"},
        }

    out["copy"] = cp = sub(copy_bw)
    out["matmul_bf16"] = mm = sub(matmul)
    out["table"].append(
        [
            "d2d copy bandwidth (read+write)",
            cp.get("tb_per_s_median"),
            None,
            "TB/s",
            f"{cp.get('bytes_per_buffer', 0) / GIB:.0f} GiB buffers; "
            + ("ok" if (cp.get("check") or {}).get("ok") else cp.get("status", "")),
        ]
    )
    out["table"].append(
        [
            f"bf16 matmul {B.mm_n}^3",
            mm.get("tflops_median"),
            None,
            "TFLOP/s",
            ("ok" if (mm.get("check") or {}).get("ok") else mm.get("status", ""))
            + (f" rel={mm['rel_err_vs_fp64_block']:.1e}" if "rel_err_vs_fp64_block" in mm else ""),
        ]
    )
    okc = (cp.get("check") or {}).get("ok") and (mm.get("check") or {}).get("ok")
    out["status"] = "ok" if okc else "partial"
    return out
