"""The task's data: items.jsonl beside this file, read with `datasets`' json builder, so the
task runs with no network and from any working directory (rl_mc.yaml's custom_dataset)."""

from __future__ import annotations

from pathlib import Path

ITEMS = Path(__file__).resolve().parent / "items.jsonl"


def load(**_metadata):
    """lm-eval passes the task's metadata (its version, the model's arguments): unused."""
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(ITEMS)})
