"""Greedy parity of every serving path on one model, against transformers.

    python -m ringleader.bench.lab.parity --model tiny --model hf-random [--model PATH.gguf] [--device cuda] --json PATH

For each model, the same prompts (seeded token ids of 3 to ~70 tokens, submitted together so they
share steps, the long ones prefilled in chunks) and `--tokens` greedy tokens with `ignore_eos`:

  transformers   LlamaForCausalLM (or AutoModelForCausalLM for a GGUF file) in fp32 on the device,
                 a plain greedy loop over the whole sequence (no cache, no EOS handling that
                 could mask a token)
  cpu            ringleader's CPU backend, fp32, a real server on 127.0.0.1
  cuda-fp32      the CUDA backend, device scheduler, resident launch, fp32 (with a GPU)
  cuda-bf16      the same in bf16 (with a GPU)

`hf-random` is a Llama checkpoint made here with transformers (random weights, save_pretrained):
what a user's own checkpoint looks like to the loader.  A preset reaches transformers through
ringleader.bench.hf_baseline's weight copy; a .gguf file through transformers' own GGUF loader.

Two paths on different kernels agree exactly unless the reference's best two logits nearly tie
(ringleader.bench.lab.bringup_checks.greedy_agreement decides, on ringleader's fp32 model): each comparison
lists the prompts that are identical, the divergences at a near-tie, and the mismatches.  It
passes when nothing mismatches; fp32 paths are also expected to be identical, and `identical`
says whether they were.  Writes $RL_BRINGUP_RESULT when set (a bring-up stage).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from ringleader.bench.lab.bringup_checks import (
    LOGIT_TOLERANCE,
    greedy_agreement,
    kernel_run_budget_s,
    write_result,
)

HF_RANDOM = "hf-random"
PROMPT_LENGTHS = (3, 9, 33, 70)
SERVER_SHAPE = dict(n_slots=8, max_ctx=512, token_budget=64)  # 70-token prompts take two steps
# (a, b, the dtype whose tolerance decides a near-tie)
COMPARISONS = (
    ("cpu", "transformers", "float32"),
    ("cuda-fp32", "cpu", "float32"),
    ("cuda-fp32", "transformers", "float32"),
    ("cuda-bf16", "cuda-fp32", "bfloat16"),
)


def make_hf_checkpoint(path: Path, seed: int = 0) -> Path:
    """A small Llama checkpoint with transformers' own random initialisation, saved as a user's
    would be (config.json + model.safetensors).  GQA, untied embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.1,  # decisive logits: 0.02 leaves many near-ties at this size
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def prompts_for(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    top = min(vocab_size, 1000)
    return [[int(t) for t in rng.integers(3, top, size=n)] for n in PROMPT_LENGTHS]


def transformers_greedy(spec: str, device: str, prompts, n_tokens: int) -> list[list[int]]:
    import torch

    from ringleader.bench.hf_baseline import build_hf_model

    model, _ = build_hf_model(spec, device, dtype="float32")
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(n_tokens):  # the whole sequence each time: no cache API to differ on
                ids.append(int(model(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    del model
    return out


def served_greedy(spec: str, backend_cls, prompts, n_tokens: int, **options) -> list[list[int]]:
    """Greedy tokens from a real server with this backend, every prompt in flight at once."""
    from ringleader.ipc.client import Client
    from tests.conftest import running_server

    with running_server(spec, backend_cls=backend_cls, **SERVER_SHAPE, **options) as bg:
        with Client(bg.address, timeout=300) as client:
            streams = [client.generate(prompt_ids=p, max_tokens=n_tokens, ignore_eos=True) for p in prompts]
            for s in streams:
                done = s.wait()
                if done.error_code:
                    raise RuntimeError(f"request ended {done.error_code}: {done.error_message}")
            return [list(s.token_ids) for s in streams]


def variants(device: str):
    """(name, run(spec, prompts, n) -> tokens) for each path this machine has."""
    import torch

    from ringleader.device.backends.cpu import CpuBackend

    out = [
        ("transformers", lambda spec, p, n: transformers_greedy(spec, device, p, n)),
        # dense weights throughout: a GGUF file's own quantization (--weights auto) is not fp32
        ("cpu", lambda spec, p, n: served_greedy(spec, CpuBackend, p, n, dtype="float32", weights="fp32")),
    ]
    if device == "cuda":
        from ringleader.device.backends.cuda import CudaBackend

        for name, dtype, weights in (
            ("cuda-fp32", torch.float32, "fp32"),
            ("cuda-bf16", torch.bfloat16, "bf16"),
        ):
            out.append(
                (
                    name,
                    lambda spec, p, n, dtype=dtype, weights=weights: served_greedy(
                        spec,
                        CudaBackend,
                        p,
                        n,
                        dtype=dtype,
                        weights=weights,
                        scheduler="device",
                        launch="resident",
                        run_budget_s=kernel_run_budget_s(),
                    ),
                )
            )
    return out


def check_model(spec: str, label: str, device: str, n_tokens: int) -> dict:
    import torch

    from ringleader.device.model import LlamaModel

    reference = LlamaModel.from_spec(spec, torch.float32, device)  # decides near-ties
    prompts = prompts_for(reference.config.vocab_size)
    record: dict = {"model": label, "spec": spec, "tokens": n_tokens, "prompt_lengths": list(PROMPT_LENGTHS)}
    got: dict[str, list[list[int]]] = {}
    record["variants"] = {}
    for name, run in variants(device):
        t0 = time.perf_counter()
        try:
            got[name] = run(spec, prompts, n_tokens)
            record["variants"][name] = {"seconds": round(time.perf_counter() - t0, 2), "tokens": got[name]}
        except Exception as exc:  # recorded; the comparisons that need it say so
            traceback.print_exc()
            record["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    record["comparisons"] = []
    for a, b, dtype in COMPARISONS:
        row: dict = {"a": a, "b": b, "tolerance": LOGIT_TOLERANCE[dtype]}
        if a not in got or b not in got:
            missing = [v for v in (a, b) if v not in got]
            why = "not run on this machine" if all(v not in record["variants"] for v in missing) else "failed"
            row["skipped"] = f"{', '.join(missing)} {why}"
        else:
            row.update(greedy_agreement(reference, prompts, got[a], got[b], LOGIT_TOLERANCE[dtype]))
            row["identical"] = len(row["exact_prompts"]) == len(prompts)
        record["comparisons"].append(row)
    failed = [v for v, r in record["variants"].items() if "error" in r]
    record["ok"] = not failed and all(not r.get("mismatched") for r in record["comparisons"])
    del reference
    return record


def describe(record: dict) -> str:
    lines = [f"{record['model']} ({record['spec']}), {record['tokens']} greedy tokens per prompt:"]
    for name, r in record["variants"].items():
        lines.append(f"  {name:13s} " + (r["error"] if "error" in r else f"ran in {r['seconds']} s"))
    for row in record["comparisons"]:
        pair = f"{row['a']} vs {row['b']}"
        if "skipped" in row:
            lines.append(f"  {pair:28s} skipped: {row['skipped']}")
            continue
        verdict = (
            "identical"
            if row["identical"]
            else f"{len(row['exact_prompts'])} identical, {len(row['tie_divergences'])} near-tie, "
            f"{len(row['mismatched'])} MISMATCHED"
        )
        lines.append(f"  {pair:28s} {verdict}")
        for m in row["mismatched"]:
            lines.append(f"      mismatch: {m}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ringleader.bench.lab.parity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", action="append", help=f"preset, checkpoint dir, .gguf file or {HF_RANDOM} (repeat)"
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--json", help="write the records here (parity.json)")
    args = p.parse_args(argv)
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    records = []
    with tempfile.TemporaryDirectory(prefix="rl-parity-") as tmp:
        for spec in args.model or ["tiny", HF_RANDOM]:
            label = f"{HF_RANDOM} (transformers save_pretrained)" if spec == HF_RANDOM else Path(spec).name
            try:
                path = str(make_hf_checkpoint(Path(tmp) / "hf-random")) if spec == HF_RANDOM else spec
                record = check_model(path, label, device, args.tokens)
            except Exception as exc:
                traceback.print_exc()
                record = {"model": label, "spec": spec, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            print(describe(record) if "variants" in record else f"{label}: {record['error']}", flush=True)
            records.append(record)
    doc = {
        "schema": "ringleader.parity/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "models": records,
        "ok": all(r["ok"] for r in records),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    write_result({"ok": doc["ok"], "models": {r["model"]: r["ok"] for r in records}})
    print(("PASSED" if doc["ok"] else "FAILED") + ": parity", flush=True)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
