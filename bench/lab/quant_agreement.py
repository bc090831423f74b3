"""Greedy agreement of each weight form with transformers, on the real model and real prompts.

transformers loads the GGUF file widened to fp32 (its own GGUF support); ringleader runs the same
file with `--weights fp32` (dense fp32), `bf16` (matrices in bf16) and `quantized` (the file's
int4-digit matrices through torch's int4 kernel, bf16 activations). For every prompt:

- free-running: each form's own greedy continuation of N tokens against transformers' (identical,
  or the index of the first divergence);
- teacher-forced along transformers' greedy tokens: per step, whether the form's argmax is
  transformers' token, |logit difference| max over the vocabulary relative to transformers'
  logits' standard deviation, and at each disagreement transformers' own top-2 margin (a
  disagreement on a near tie is rounding, not a wrong model).

    python -m ringleader.bench.lab.quant_agreement --model FILE.gguf --tokens 64 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ringleader.device.model import LlamaModel
from ringleader.device.model.presets import tokenizer_for
from ringleader.device.step.step_batch import StepBatch

RAW_PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "Water boils at",
    "Once upon a time, in a small village by the sea,",
]
CHATS = [
    [{"role": "user", "content": "Write a haiku about autumn."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "List three colours."}],
    [{"role": "user", "content": "What is the capital of France?"}],
]
FORMS = ("dense", "bfloat16", "quantized")  # LlamaModel's: --weights fp32, bf16, quantized
FLAG_OF = {"dense": "fp32", "bfloat16": "bf16", "quantized": "quantized"}


def hf_logits_along(hf, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and the logits each came from (one forward with its KV cache)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        past, logits = out.past_key_values, [out.logits[0, -1].float()]
        tokens = [int(logits[-1].argmax())]
        for _ in range(n - 1):
            out = hf(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0, -1].float())
            tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def ours_along(model: LlamaModel, prompt: list[int], forced: list[int]) -> list[torch.Tensor]:
    """Our logits at each step when fed `forced` (teacher forcing): step i predicts forced[i]."""
    kv = model.new_kv_cache(1, len(prompt) + len(forced) + 1)
    logits = [model.step(StepBatch.from_segments([(0, prompt, 0)]), kv)[0]]
    for i, tok in enumerate(forced[:-1]):
        logits.append(model.step(StepBatch.from_segments([(0, [tok], len(prompt) + i)]), kv)[0])
    return logits


def ours_greedy(model: LlamaModel, prompt: list[int], n: int) -> list[int]:
    kv = model.new_kv_cache(1, len(prompt) + n + 1)
    tokens = [int(model.step(StepBatch.from_segments([(0, prompt, 0)]), kv)[0].argmax())]
    for i in range(n - 1):
        tokens.append(
            int(model.step(StepBatch.from_segments([(0, [tokens[-1]], len(prompt) + i)]), kv)[0].argmax())
        )
    return tokens


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def compare(form_model: LlamaModel, prompt: list[int], hf_tokens, hf_logits, n: int) -> dict:
    ours = ours_along(form_model, prompt, hf_tokens)
    steps = []
    for want, have in zip(hf_logits, ours):
        diff = float((want - have).abs().max())
        top2 = want.topk(2).values
        steps.append(
            {
                "agree": int(have.argmax()) == int(want.argmax()),
                "diff_over_std": diff / float(want.std()),
                "margin": float(top2[0] - top2[1]),
                "diff": diff,
            }
        )
    own = ours_greedy(form_model, prompt, n)
    disagreements = [s for s in steps if not s["agree"]]
    return {
        "free_running_identical": own == hf_tokens,
        "free_running_first_divergence": first_divergence(own, hf_tokens),
        "teacher_forced_agree": sum(s["agree"] for s in steps),
        "teacher_forced_steps": len(steps),
        "max_diff_over_std": max(s["diff_over_std"] for s in steps),
        "disagreements_on_near_ties": sum(s["margin"] <= 2 * s["diff"] for s in disagreements),
        "disagreement_margins": [round(s["margin"], 4) for s in disagreements],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a .gguf file")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--forms", default=",".join(FLAG_OF[f] for f in FORMS), help="of fp32, bf16, quantized")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    import transformers

    path = Path(args.model)
    tokenizer = tokenizer_for(str(path))
    prompts = [tokenizer.encode(t) for t in RAW_PROMPTS] + [tokenizer.encode_chat(m) for m in CHATS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    hf.eval()
    reference = [hf_logits_along(hf, prompt, args.tokens) for prompt in prompts]
    report: dict = {"model": path.name, "tokens": args.tokens, "prompts": len(prompts), "forms": {}}
    wanted = {f for f in FORMS if FLAG_OF[f] in args.forms.split(",")}
    for form in (f for f in FORMS if f in wanted):
        t0 = time.perf_counter()
        model = LlamaModel.from_gguf(path, weights=form)
        rows = [compare(model, pr, toks, lg, args.tokens) for pr, (toks, lg) in zip(prompts, reference)]
        report["forms"][FLAG_OF[form]] = {
            "weight_mib": model.weights_description()["weight_mib"],
            "per_prompt": rows,
            "free_running_identical": sum(r["free_running_identical"] for r in rows),
            "teacher_forced_agree": sum(r["teacher_forced_agree"] for r in rows),
            "teacher_forced_steps": sum(r["teacher_forced_steps"] for r in rows),
            "max_diff_over_std": max(r["max_diff_over_std"] for r in rows),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        f = report["forms"][FLAG_OF[form]]
        print(
            f"{FLAG_OF[form]:9s} {f['weight_mib']:7.1f} MiB  free-running identical {f['free_running_identical']}/"
            f"{len(rows)} (first divergences {[r['free_running_first_divergence'] for r in rows]}), "
            f"teacher-forced top-1 {f['teacher_forced_agree']}/{f['teacher_forced_steps']}, "
            f"max |dlogit|/std {f['max_diff_over_std']:.3f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
