"""Output: the tee of stdout/stderr into the log, the JSON file, the summary table."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import numpy as np

from ringleader.bench.lab.gpu_limits.common import PROBE_NAMES


class Tee:
    """stdout/stderr copy into the log file (buffered until it is opened)."""

    def __init__(self, stream, shared: dict):
        self.stream = stream
        self.shared = shared

    def write(self, s: str) -> int:
        with self.shared["lock"]:
            self.stream.write(s)
            fh = self.shared.get("fh")
            if fh is not None:
                fh.write(s)
            else:
                self.shared["buf"].append(s)
            if "\n" in s:
                self.stream.flush()
                if fh is not None:
                    fh.flush()
        return len(s)

    def flush(self) -> None:
        self.stream.flush()
        fh = self.shared.get("fh")
        if fh is not None:
            fh.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()


_TEE: dict = {"lock": threading.RLock(), "buf": [], "fh": None}


def install_tee() -> None:
    if not isinstance(sys.stdout, Tee):
        sys.stdout = Tee(sys.stdout, _TEE)
        sys.stderr = Tee(sys.stderr, _TEE)


def open_log(path: Path) -> None:
    with _TEE["lock"]:
        fh = open(path, "w", encoding="utf-8")  # noqa: SIM115 - the tee keeps it open for the run
        fh.write("".join(_TEE["buf"]))
        _TEE["buf"].clear()
        _TEE["fh"] = fh


def json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (bytes, bytearray)):
        return f"<{len(o)} bytes>"
    if hasattr(o, "name") and hasattr(o, "value"):
        return o.name
    return str(o)


def save_json(path: Path | None, results: dict) -> None:
    if path is None:
        return
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=json_default))
    os.replace(tmp, path)


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != x:
            return "nan"
        if abs(x) >= 1000:
            return f"{x:.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.3f}" if abs(x) < 1 else f"{x:.2f}"
    return str(x)


def print_table(results: dict) -> None:
    rows = []
    for key, pr in sorted(results["probes"].items(), key=lambda kv: int(kv[0].split("_", 1)[0])):
        num = key.split("_", 1)[0]
        tbl = pr.get("table") or []
        for r in tbl:
            rows.append([num, r[0], fmt(r[1]), fmt(r[2]), r[3], r[4]])
        if not tbl or pr.get("status") not in ("ok", "partial"):
            why = pr.get("error") or pr.get("reason") or pr.get("where") or ""
            rows.append(
                [
                    num,
                    f"[{PROBE_NAMES.get(int(num), key)}]",
                    "-",
                    "-",
                    "",
                    f"{pr.get('status')} {why}".strip()[:100],
                ]
            )
    hdr = ["#", "measurement", "median", "p99", "unit", "check / notes"]
    w = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(5)]
    print()
    print("  ".join(h.ljust(w[i]) if i < 5 else h for i, h in enumerate(hdr)))
    print("  ".join("-" * w[i] for i in range(5)) + "  " + "-" * 13)
    for r in rows:
        print(
            "  ".join(
                (str(r[i]).rjust(w[i]) if i in (2, 3) else str(r[i]).ljust(w[i])) if i < 5 else str(r[i])
                for i in range(6)
            )
        )
