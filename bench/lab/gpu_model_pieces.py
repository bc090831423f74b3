"""A model file too big for one device call, carried in pieces over consecutive calls.

A device call carries at most 64 MiB of working tree, and the SmolLM2 GGUF is 98 MB, so the
second GPU pass carries it in two pieces, one per call, while the machine stays warm between them:

    python -m ringleader.bench.lab.gpu_model_pieces split FILE --pieces 2 --out .carry          # here
    python -m ringleader.bench.lab.gpu_model_pieces stash .carry/piece-1 --to DIR               # there, call 1
    python -m ringleader.bench.lab.gpu_model_pieces join DIR .carry/piece-2 --out MODELS_DIR    # there, call 2

Each piece folder holds one part and a manifest (the file's name, size and SHA-256, the part's
index, offset and SHA-256); join checks every part and the whole file, and names what is missing
or wrong.  Exit status: 0 done, 1 a part or the whole does not check, 2 bad usage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

MANIFEST = "manifest.json"
CHUNK = 1 << 20


def sha256_of(path: Path, offset: int = 0, size: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = path.stat().st_size - offset if size is None else size
        while left > 0:
            block = f.read(min(CHUNK, left))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def split(source: Path, pieces: int, out: Path) -> list[Path]:
    total = source.stat().st_size
    whole = sha256_of(source)
    step = -(-total // pieces)
    folders = []
    with open(source, "rb") as f:
        for i in range(pieces):
            folder = out / f"piece-{i + 1}"
            folder.mkdir(parents=True, exist_ok=True)
            offset = i * step
            part = folder / f"{source.name}.part{i + 1}"
            f.seek(offset)
            part.write_bytes(f.read(min(step, total - offset)))
            manifest = {
                "name": source.name,
                "size": total,
                "sha256": whole,
                "pieces": pieces,
                "index": i + 1,
                "offset": offset,
                "part": part.name,
                "part_size": part.stat().st_size,
                "part_sha256": sha256_of(part),
            }
            (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
            folders.append(folder)
    return folders


def checked_part(folder: Path, manifest: dict) -> dict:
    """The manifest with the part's path, once the part is there and its SHA-256 matches."""
    part = folder / manifest["part"]
    if not part.is_file():
        raise ValueError(f"{folder}: its part {manifest['part']} is missing")
    if sha256_of(part) != manifest["part_sha256"]:
        raise ValueError(f"{part}: SHA-256 differs from its manifest (a broken copy)")
    return {**manifest, "path": part}


def stash(piece: Path, to: Path) -> Path:
    m = checked_part(piece, json.loads((piece / MANIFEST).read_text()))
    to.mkdir(parents=True, exist_ok=True)
    shutil.copy2(m["path"], to / m["part"])
    shutil.copy2(piece / MANIFEST, to / f"{m['part']}.{MANIFEST}")
    return to / m["part"]


def find_pieces(places: list[Path]) -> list[dict]:
    """Every piece in these folders (piece folders, or stash folders holding several)."""
    found = []
    for place in places:
        for manifest in sorted(place.glob(f"*{MANIFEST}")):
            found.append(checked_part(place, json.loads(manifest.read_text())))
    return found


def join(places: list[Path], out: Path) -> Path:
    pieces = find_pieces(places)
    if not pieces:
        raise ValueError(f"no pieces in {', '.join(map(str, places))}")
    name, total, whole, n = (pieces[0][k] for k in ("name", "size", "sha256", "pieces"))
    if any((p["name"], p["sha256"]) != (name, whole) for p in pieces):
        raise ValueError("the pieces belong to different files")
    by_index = {p["index"]: p for p in pieces}
    missing = [i for i in range(1, n + 1) if i not in by_index]
    if missing:
        raise ValueError(f"{name}: piece(s) {missing} of {n} missing (carried in an earlier call?)")
    out.mkdir(parents=True, exist_ok=True)
    target = out / name
    with open(target, "wb") as f:
        for i in range(1, n + 1):
            with open(by_index[i]["path"], "rb") as part:
                shutil.copyfileobj(part, f, CHUNK)
    if target.stat().st_size != total or sha256_of(target) != whole:
        target.unlink()
        raise ValueError(f"{name}: the joined file does not match its SHA-256")
    return target


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ringleader.bench.lab.gpu_model_pieces",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("split", help="cut FILE into pieces, one folder each")
    s.add_argument("file", type=Path)
    s.add_argument("--pieces", type=int, default=2)
    s.add_argument("--out", type=Path, required=True)
    st = sub.add_parser("stash", help="check a piece and copy it out of the working tree")
    st.add_argument("piece", type=Path)
    st.add_argument("--to", type=Path, required=True)
    j = sub.add_parser("join", help="check every piece and write the whole file")
    j.add_argument("places", type=Path, nargs="+", help="stash folders and piece folders")
    j.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        if args.verb == "split":
            for folder in split(args.file, args.pieces, args.out):
                print(f"wrote {folder}")
        elif args.verb == "stash":
            print(f"stashed {stash(args.piece, args.to)}")
        else:
            print(f"joined {join(args.places, args.out)}")
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        print(f"gpu_model_pieces {args.verb}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
