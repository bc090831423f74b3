"""`ringleader doctor`: versions, the GPU and a build of the scheduler kernel; exit code 1 when a
CUDA run would fail here, naming why (device/doctor.py)."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor",
        help="versions, GPU, scheduler kernel build; exits 1 when a CUDA run would fail here, naming why",
    )
    p.add_argument("--arch", default=None, help="compile for this arch (default: the GPU's, else sm_90)")
    p.add_argument("--json", help="also write the report here")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ringleader.device.doctor import Doctor, format_report

    report = Doctor(args.arch).run()
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0 if report["cuda_ready"] else 1
