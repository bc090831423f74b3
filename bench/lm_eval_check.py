"""lm-eval's loglikelihood scoring through the gateway, against the same task under `lm_eval --model
hf` on the same fp32 weights (SmolLM2's GGUF, dequantized by transformers as `serve --weights fp32`
dequantizes it).  The task is tests/data/lm_eval/rl_mc.yaml: 52 local four-choice questions, no
network.  lm-eval is not a dependency of ringleader: run these with an interpreter that has
`lm-eval[api]` 0.4.x (and, for the reference, transformers, gguf and accelerate).

    python -m ringleader.bench.lm_eval_check reference            # rewrites tests/data/lm_eval/hf_reference.json
    python -m ringleader.bench.lm_eval_check local --url http://127.0.0.1:8000   # a gateway already up

`local` runs `lm_eval --model local-completions` (prompts sent as token-id lists, batched, with
echo, logprobs 1 and max_tokens 1: lm-eval's own request) and prints its accuracies beside the
reference's, and every item where they part; tests/test_lm_eval.py runs the same against a server
it starts.  Both runs are offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE, a fresh HF_HOME).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASK = "rl_mc"
TASK_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "lm_eval"  # in a checkout
REFERENCE = "hf_reference.json"
# Per choice, the summed continuation logprob may differ from the reference's by this much: fp32
# with another summation order (the server's step against transformers' forward) moves a token's
# logprob by ~1e-5; the closest two choices of an item are 0.035 apart.
LL_TOLERANCE = 2e-3


def offline_env(hf_home: str | Path) -> dict[str, str]:
    """The environment for an lm_eval run that reaches no network and leaves no cache behind."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(hf_home),
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("OPENAI_API_KEY", None)  # local-completions sends it as a bearer token
    return env


def save_gguf_tokenizer(gguf: str | Path, out_dir: str | Path) -> Path:
    """The GGUF file's tokenizer as a Hugging Face tokenizer folder (what lm-eval's huggingface
    backend loads by path): transformers converts the GGUF's vocabulary and merges."""
    import transformers

    gguf = Path(gguf)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out_dir))
    return Path(out_dir)


def hf_command(python: str, gguf: str | Path, out: str | Path, task_dir: Path = TASK_DIR) -> list[str]:
    gguf = Path(gguf)
    model_args = f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32"
    return [
        python,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        model_args,
        "--device",
        "cpu",
    ] + _common(out, task_dir, batch_size=1)


def local_command(
    python: str,
    url: str,
    model: str,
    out: str | Path,
    *,
    tokenizer: str | Path | None = None,
    batch_size: int = 4,
    num_concurrent: int = 1,
    task_dir: Path = TASK_DIR,
) -> list[str]:
    """`lm_eval --model local-completions` against the gateway at url (http://host:port).  With a
    tokenizer folder it tokenizes locally (tokenizer_backend=huggingface); without, it is left to
    lm-eval's auto-detection, which takes the gateway's /tokenizer_info and /tokenize when both
    answer ("remote") and otherwise loads a Hugging Face tokenizer named `model` (offline: fails)."""
    args = [f"base_url={url.rstrip('/')}/v1/completions", f"model={model}", "max_retries=1"]
    if tokenizer is not None:
        args += ["tokenizer_backend=huggingface", f"tokenizer={tokenizer}"]
    if num_concurrent > 1:
        args.append(f"num_concurrent={num_concurrent}")
    head = [python, "-m", "lm_eval", "--model", "local-completions", "--model_args", ",".join(args)]
    return head + _common(out, task_dir, batch_size=batch_size)


def _common(out: str | Path, task_dir: Path, *, batch_size: int) -> list[str]:
    return [
        "--tasks",
        TASK,
        "--include_path",
        str(task_dir),
        "--batch_size",
        str(batch_size),
        "--output_path",
        str(out),
        "--log_samples",
    ]


def read_run(out: str | Path) -> dict:
    """An lm_eval run's output folder as {"n", "acc", "acc_norm", "items": [{"doc_id",
    "loglikelihoods", "acc", "acc_norm"}]}: its newest results_*.json and samples file."""
    out = Path(out)
    results = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    samples = sorted(out.rglob(f"samples_{TASK}_*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not results or not samples:
        raise FileNotFoundError(f"no results_*.json and samples_{TASK}_*.jsonl under {out}")
    metrics = json.loads(results[-1].read_text())["results"][TASK]
    items = []
    for line in samples[-1].read_text().splitlines():
        row = json.loads(line)
        lls = [float(resp[0]) for resp in row["filtered_resps"]]
        items.append(
            dict(
                doc_id=row["doc_id"],
                loglikelihoods=[round(v, 6) for v in lls],
                acc=row["acc"],
                acc_norm=row["acc_norm"],
            )
        )
    items.sort(key=lambda item: item["doc_id"])
    return dict(n=len(items), acc=metrics["acc,none"], acc_norm=metrics["acc_norm,none"], items=items)


def compare(run: dict, reference: dict, tolerance: float = LL_TOLERANCE) -> list[str]:
    """Where run and reference part, one line each (none: the same accuracies, the same choice
    right or wrong per item, every choice's loglikelihood within tolerance)."""
    diffs = []
    for key in ("n", "acc", "acc_norm"):
        if run[key] != reference[key]:
            diffs.append(f"{key}: {run[key]} against the reference's {reference[key]}")
    want = {item["doc_id"]: item for item in reference["items"]}
    for item in run["items"]:
        ref = want.get(item["doc_id"])
        if ref is None:
            diffs.append(f"item {item['doc_id']}: not in the reference")
            continue
        for key in ("acc", "acc_norm"):
            if item[key] != ref[key]:
                diffs.append(f"item {item['doc_id']}: {key} {item[key]} against {ref[key]}")
        for i, (got, exp) in enumerate(zip(item["loglikelihoods"], ref["loglikelihoods"])):
            if abs(got - exp) > tolerance:
                diffs.append(f"item {item['doc_id']} choice {i}: loglikelihood {got} against {exp}")
    return diffs


def max_ll_difference(run: dict, reference: dict) -> float:
    want = {item["doc_id"]: item["loglikelihoods"] for item in reference["items"]}
    return max(
        (
            abs(a - b)
            for item in run["items"]
            for a, b in zip(item["loglikelihoods"], want.get(item["doc_id"], []))
        ),
        default=0.0,
    )


def dump_reference(run: dict) -> str:
    """JSON with one line per item (a reviewable diff when the reference is made again)."""
    head = {k: v for k, v in run.items() if k != "items"}
    lines = json.dumps(head, indent=1)[:-2] + ',\n "items": [\n'
    lines += ",\n".join("  " + json.dumps(item) for item in run["items"])
    return lines + "\n ]\n}\n"


def load_reference(task_dir: Path = TASK_DIR) -> dict:
    return json.loads((task_dir / REFERENCE).read_text())


def _versions(python: str) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json\n"
        "print(json.dumps({n: m.version(n) for n in ('lm_eval', 'transformers', 'torch', 'gguf')}))"
    )
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def _gguf_path(given: str | None) -> Path:
    if given:
        return Path(given)
    from ringleader.bench import smollm2

    return Path(smollm2.cached_path() or smollm2.fetch())


def reference_main(args) -> int:
    gguf = _gguf_path(args.gguf)
    with tempfile.TemporaryDirectory(prefix="rl-lm-eval-") as tmp:
        cmd = hf_command(args.python, gguf, Path(tmp) / "out", args.task_dir)
        started = time.monotonic()
        subprocess.run(cmd, env=offline_env(Path(tmp) / "hf_home"), check=True)
        run = read_run(Path(tmp) / "out")
        seconds = time.monotonic() - started
    shown = " ".join(cmd[1:])
    for path, name in ((str(gguf.parent), "GGUF_DIR"), (str(args.task_dir), "TASK_DIR"), (tmp, "TMP")):
        shown = shown.replace(path, name)
    run = dict(
        produced_by=(
            f"python -m ringleader.bench.lm_eval_check reference, which ran `python {shown}` offline; "
            "lm-eval's HFLM loads the GGUF through transformers, which dequantizes Q4_1 to float32 as "
            "`serve --weights fp32` does"
        ),
        model=gguf.name,
        versions=_versions(args.python),
        seconds=round(seconds, 1),
        **run,
    )
    target = args.task_dir / REFERENCE
    target.write_text(dump_reference(run))
    print(f"{target}: acc {run['acc']:.4f}, acc_norm {run['acc_norm']:.4f} over {run['n']} items")
    return 0


def local_main(args) -> int:
    reference = load_reference(args.task_dir)
    with tempfile.TemporaryDirectory(prefix="rl-lm-eval-") as tmp:
        tokenizer = None
        if args.tokenizer_backend == "huggingface":
            tokenizer = save_gguf_tokenizer(_gguf_path(args.gguf), Path(tmp) / "tokenizer")
        model = args.model or _served_model(args.url)
        cmd = local_command(
            args.python,
            args.url,
            model,
            Path(tmp) / "out",
            tokenizer=tokenizer,
            batch_size=args.batch_size,
            num_concurrent=args.num_concurrent,
            task_dir=args.task_dir,
        )
        subprocess.run(cmd, env=offline_env(Path(tmp) / "hf_home"), check=True)
        run = read_run(Path(tmp) / "out")
    print(f"local-completions: acc {run['acc']:.4f}, acc_norm {run['acc_norm']:.4f} over {run['n']} items")
    print(f"hf (reference):    acc {reference['acc']:.4f}, acc_norm {reference['acc_norm']:.4f}")
    worst = max_ll_difference(run, reference)
    print(f"largest loglikelihood difference from the reference: {worst:.2e} (tolerance {LL_TOLERANCE})")
    diffs = compare(run, reference)
    for line in diffs:
        print("  " + line)
    print("the same" if not diffs else f"{len(diffs)} differences")
    return 1 if diffs else 0


def _served_model(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringleader.bench.lm_eval_check", description=__doc__)
    parser.add_argument("--python", default=sys.executable, help="the interpreter that has lm-eval")
    parser.add_argument("--gguf", help="the model file (default: SmolLM2's, bench/smollm2.py)")
    parser.add_argument("--task-dir", type=Path, default=TASK_DIR, help="rl_mc.yaml's folder")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("reference", help=f"run lm_eval --model hf and write {REFERENCE}")
    local = sub.add_parser("local", help="run lm_eval --model local-completions against a gateway")
    local.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway")
    local.add_argument("--model", help="the model name to send (default: the gateway's first)")
    local.add_argument("--tokenizer-backend", choices=("huggingface", "auto"), default="huggingface")
    local.add_argument("--batch-size", type=int, default=4, help="prompts per request")
    local.add_argument("--num-concurrent", type=int, default=1, help="requests in flight")
    args = parser.parse_args(argv)
    return reference_main(args) if args.command == "reference" else local_main(args)


if __name__ == "__main__":
    sys.exit(main())
