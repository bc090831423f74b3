"""`ringleader build-kernel`: compile the scheduler kernel with NVRTC (no GPU needed) and report
its resources per function."""

from __future__ import annotations

import argparse
import json
import os

from ringleader.hostctl.commands.cannot_start import cannot_start


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("build-kernel", help="compile the scheduler kernel with NVRTC (no GPU needed)")
    p.add_argument("--arch", default="sm_90", help="the GPU architecture to compile for (sm_90: H100/H200)")
    p.add_argument("--threads", type=int, default=256, help="threads per block of the kernel")
    p.add_argument("--output", help="write the CUBIN here")
    p.add_argument("--verbose", action="store_true", help="print the full ptxas log")
    p.add_argument(
        "--nvrtc",
        metavar="LIBNVRTC",
        help="compile with this libnvrtc.so (default: $RINGLEADER_NVRTC, else the one cuda-bindings finds)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the build's versions and resources here")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ringleader.device.sched.build import NVRTC_ENV, compile_kernel, nvrtc_library

    if args.nvrtc:
        os.environ[NVRTC_ENV] = args.nvrtc  # read at the process's first NVRTC call, below

    try:
        build = compile_kernel(args.arch, threads=args.threads)
    except Exception as exc:  # no NVRTC, a wrong --nvrtc, a compile error: one line
        return cannot_start(exc, "build-kernel")
    library = nvrtc_library()
    print(
        f"{len(build.cubin)} bytes of CUBIN for {build.arch} from NVRTC "
        f"{build.nvrtc_version[0]}.{build.nvrtc_version[1]} ({library}), PTX ISA {build.ptx_isa}; "
        f"the scheduler kernel runs {args.threads} threads/block"
    )
    for name, r in build.resources.items():
        print(
            f"  {name}: {r.registers} registers/thread, {r.shared_bytes} bytes shared memory, "
            f"{r.spill_bytes} bytes spilled, {r.stack_bytes} bytes stack"
        )
    if args.verbose:
        print(build.log)
    if args.output:
        with open(args.output, "wb") as f:
            f.write(build.cubin)
    if args.json:
        report = {
            "arch": build.arch,
            "threads": args.threads,
            "nvrtc": "%d.%d" % build.nvrtc_version,
            "nvrtc_library": library,
            "ptx_isa": build.ptx_isa,
            "cubin_bytes": len(build.cubin),
            "functions": {name: vars(r) for name, r in build.resources.items()},
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
