"""bringup.log and artifacts.tar.gz: the logs and the folders of this run's stages, as the runner
rewrites them in OUT after every stage (kept within what a device call brings back)."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from pathlib import Path

from ringleader.bench.lab.bringup_stages import StageResult

LOG_IN_FULL = 2_000_000  # characters of one stage's log in bringup.log (head and tail kept)
TAR_FILE_LIMIT = 20_000_000  # bytes: a bigger file stays out of artifacts.tar.gz
TAR_LIMIT = 15 * 2**20  # bytes: the device tool brings back files of up to 16 MiB


def write_stage_logs(path: Path, results: list[StageResult], stage_dir: Callable[[str], Path]) -> None:
    """bringup.log: each stage's status and command, then its log (the middle of a log over
    LOG_IN_FULL characters left out)."""
    with open(path, "w") as f:
        for r in results:
            f.write(
                f"\n##### {r.name}: {r.status} in {r.seconds:.1f} s"
                + (f" ({r.reason})" if r.reason else "")
                + f"\n##### $ {r.command}\n"
            )
            log = stage_dir(r.name) / "stage.log"
            if log.exists() and r.status != "skipped":
                text = log.read_text(errors="replace")
                if len(text) > LOG_IN_FULL:
                    cut = len(text) - LOG_IN_FULL
                    head = LOG_IN_FULL // 20
                    text = (
                        text[:head]
                        + f"\n##### [{cut} characters left out here; the whole log is in artifacts.tar.gz]\n"
                        + text[head + cut :]
                    )
                f.write(text)


def pack_stage_folders(
    path: Path, results: list[StageResult], stage_dir: Callable[[str], Path]
) -> list[dict]:
    """artifacts.tar.gz: every stage folder of this run, files over TAR_FILE_LIMIT left out; then,
    while the archive is over TAR_LIMIT, the biggest file still in it left out too. Returns what
    it left out."""
    files: list[tuple[Path, str]] = []
    seen = set()
    for r in results:
        d = stage_dir(r.name)
        if r.status == "skipped" or d.name in seen or not d.is_dir():
            continue
        seen.add(d.name)
        for f in sorted(d.rglob("*")):
            if f.is_file() and not f.is_symlink():
                files.append((f, f"{d.name}/{f.relative_to(d)}"))
    left_out = []
    keep = []
    for f, arc in files:
        size = f.stat().st_size
        if size > TAR_FILE_LIMIT:
            left_out.append({"path": arc, "bytes": size, "why": f"over {TAR_FILE_LIMIT} bytes"})
        else:
            keep.append((f, arc, size))
    while True:
        with tarfile.open(path, "w:gz", compresslevel=6) as tar:
            for f, arc, _ in keep:
                try:
                    tar.add(f, arcname=arc)
                except OSError as exc:  # vanished or unreadable: say so, go on
                    left_out.append({"path": arc, "bytes": None, "why": repr(exc)[:200]})
        if path.stat().st_size <= TAR_LIMIT or not keep:
            break
        biggest = max(keep, key=lambda k: k[2])
        keep.remove(biggest)
        left_out.append(
            {"path": biggest[1], "bytes": biggest[2], "why": f"the archive was over {TAR_LIMIT} bytes"}
        )
    return left_out
