"""The copy-heavy workload of `ringleader bench --workload copy`, the speculative-decoding
acceptance figures of the bench's report, and bench/lab/spec_bench.py's cell logic; then both end
to end against `serve --model tiny` (real servers on 127.0.0.1)."""

from __future__ import annotations

import json

import pytest

from ringleader.bench import cli
from ringleader.bench import servers as S
from ringleader.bench.lab import spec_bench as SB
from ringleader.bench.loadgen import Load, RunResult
from ringleader.bench.metrics import RequestRecord
from ringleader.bench.options import DefaultCount, check_options, copy_output_cap
from ringleader.bench.report import make_run_entry
from ringleader.bench.report_markdown import markdown_summary
from ringleader.bench.report_tables import format_table, table_rows
from ringleader.bench.workloads import (
    COPY_TASKS,
    add_typos,
    copy_choices,
    copy_encoder,
    load_passages,
    make_copy_requests,
)
from ringleader.device.text.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()


def _plain(message: str) -> list[int]:
    return BYTES.encode(message)


def _count(text: str) -> int:
    return len(BYTES.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------- the passages and the workload


def test_the_passages_ship_with_the_bench_and_have_sane_lengths():
    passages = load_passages()
    assert len(passages) >= 12 and len(set(passages)) == len(passages)
    for text in passages:
        assert 80 <= len(text.split()) <= 200, text[:40]
        assert text == text.strip() and "\n" not in text


def test_copy_requests_are_deterministic_per_seed():
    a = make_copy_requests(30, _plain, _count, seed=7)
    assert a == make_copy_requests(30, _plain, _count, seed=7)
    assert a != make_copy_requests(30, _plain, _count, seed=8)
    assert make_copy_requests(10, _plain, _count, seed=7) == a[:10]  # a shorter run is a prefix
    assert copy_choices(30, 7) == copy_choices(30, 7)


def test_every_passage_is_seen_once_a_cycle_and_every_task_is_used():
    passages = load_passages()
    choices = copy_choices(3 * len(passages), seed=1)
    for cycle in range(3):
        part = choices[cycle * len(passages) : (cycle + 1) * len(passages)]
        assert sorted(c.passage for c in part) == list(range(len(passages)))
    assert {c.task for c in choices} == set(COPY_TASKS)


def test_prompts_contain_their_passage_and_max_tokens_is_its_length():
    passages = load_passages()
    choices = copy_choices(24, seed=2)
    specs = make_copy_requests(24, _plain, _count, seed=2)
    for choice, spec in zip(choices, specs):
        prompt = BYTES.decode(spec.prompt_ids)
        assert choice.text in prompt and choice.message in prompt
        original = passages[choice.passage]
        if choice.task == "spelling":  # a few words with two letters swapped, nothing else
            assert choice.text != original
            changed = [(a, b) for a, b in zip(choice.text.split(" "), original.split(" ")) if a != b]
            assert 1 <= len(changed) <= len(original.split()) // 6
            assert all(sorted(a) == sorted(b) and a[0] == b[0] for a, b in changed)
        else:
            assert choice.text == original
        assert spec.max_tokens == _count(original)
        assert len(spec.prompt_ids) > spec.max_tokens  # the prompt holds the whole passage


def test_output_cap_and_context_limit():
    specs = make_copy_requests(6, _plain, _count, seed=0, output_cap=40)
    assert all(s.max_tokens == 40 for s in specs)
    longest = max(len(s.prompt_ids) for s in make_copy_requests(6, _plain, _count, seed=0))
    cut = make_copy_requests(6, _plain, _count, seed=0, max_context=longest + 10)
    assert all(len(s.prompt_ids) + s.max_tokens <= longest + 10 for s in cut)
    assert any(s.max_tokens == longest + 10 - len(s.prompt_ids) for s in cut)
    with pytest.raises(ValueError, match="no room for output"):
        make_copy_requests(6, _plain, _count, seed=0, max_context=100)


def test_add_typos_swaps_letters_inside_words():
    import numpy as np

    text = "The quick brown foxes jumped over lazy sleeping dogs again and again."
    out = add_typos(text, np.random.default_rng(0), every=3)
    assert out != text and len(out) == len(text) and sorted(out) == sorted(text)
    assert add_typos("a an of", np.random.default_rng(0)) == "a an of"  # nothing long enough


def test_copy_encoder_uses_plain_text_without_a_chat_template():
    encode, count, how = copy_encoder("tiny")
    assert how == "plain"
    assert encode("hi") == BYTES.encode("hi") and count("hello") == 5


# ---------------------------------------------------------------- options


def test_workload_option_and_the_copy_cap():
    parse = cli.build_parser().parse_args
    args = parse(["--workload", "copy"])
    assert args.workload == "copy" and isinstance(args.output_len, DefaultCount)
    assert copy_output_cap(args) is None and check_options(args) == []
    assert copy_output_cap(parse(["--workload", "copy", "--output-len", "32"])) == 32
    assert parse([]).workload == "random"
    assert check_options(parse(["--workload", "copy", "--shared-prefix-len", "8"]))


# ---------------------------------------------------------------- acceptance from counter deltas


def _stats(drafts, proposed, accepted, where="device"):
    counters = {"spec_drafts": drafts, "spec_draft_tokens": proposed, "spec_accepted_tokens": accepted}
    return {"device": counters} if where == "device" else counters


def test_acceptance_from_counter_deltas():
    d = S.spec_decode_deltas(_stats(10, 40, 20), _stats(30, 120, 80))
    assert (d["spec_drafts"], d["spec_draft_tokens"], d["spec_accepted_tokens"]) == (20, 80, 60)
    assert d["spec_acceptance_rate"] == pytest.approx(0.75)
    assert d["spec_accepted_per_draft"] == pytest.approx(3.0)
    top = S.spec_decode_deltas(_stats(0, 0, 0, "top"), _stats(4, 8, 2, "top"))
    assert top["spec_acceptance_rate"] == pytest.approx(0.25) and top["spec_accepted_per_draft"] == 0.5


def test_absent_or_idle_counters_give_null():
    absent = S.spec_decode_deltas({"device": {"steps": 1}}, {"device": {"steps": 5}})
    assert all(v is None for v in absent.values()) and "spec_acceptance_rate" in absent
    assert all(v is None for v in S.spec_decode_deltas({}, {}).values())
    off = S.spec_decode_deltas(_stats(3, 9, 4), _stats(3, 9, 4))  # a server with --speculative off
    assert off["spec_draft_tokens"] == 0 and off["spec_acceptance_rate"] is None
    assert off["spec_accepted_per_draft"] is None


def _result(before, after, n=2, tokens=4):
    recs = []
    for i in range(n):
        r = RequestRecord(i, 3, tokens, send_t=float(i))
        r.chunk_t = [i + 0.1 * (k + 1) for k in range(tokens)]
        r.chunk_n = [1] * tokens
        r.done_t, r.finish_reason, r.completion_tokens = i + 1.0, "length", tokens
        recs.append(r)
    return RunResult(recs, before, after, 0.01, 2.0)


def _entry(before, after):
    return make_run_entry(
        scheduler="host",
        device="cpu",
        model="m",
        load=Load(concurrency=2),
        result=_result(before, after),
        burstiness=None,
    )


def test_the_report_shows_acceptance_only_where_counted():
    with_spec = _entry(_stats(0, 0, 0), _stats(5, 20, 15))
    without = _entry({"device": {}}, {"device": {}})
    assert with_spec["spec_acceptance_rate"] == pytest.approx(0.75)
    assert with_spec["spec_accepted_per_draft"] == pytest.approx(3.0)
    assert without["spec_acceptance_rate"] is None and without["spec_drafts"] is None
    head, rows = table_rows([with_spec, without])
    assert head[-2:] == ["spec accept", "accepted/draft"]
    assert rows[0][-2:] == ["75%", "3.00"] and rows[1][-2:] == ["-", "-"]
    assert "spec accept" not in table_rows([without])[0]
    assert "75%" in format_table([with_spec])
    doc = {
        "settings": {"workload": "copy", "copy_prompt": "chat", "copy_output_cap": None, "requests": 2},
        "environment": {},
        "model": "m",
        "device": "cpu",
        "created": "now",
        "command": [],
        "runs": [with_spec],
        "notes": [],
    }
    md = markdown_summary(doc, [])
    assert "copy workload (chat prompts" in md and "| 75% | 3.00 |" in md and "spec accept:" in md


# ---------------------------------------------------------------- spec_bench's cell logic


def _run(form, rnd, tok_s, tpot, counters=(None, None, None), busy=0, workload="copy", streams=1):
    drafts, proposed, accepted = counters
    return {
        "busy": busy,
        "round": rnd,
        "workload": workload,
        "streams": streams,
        "form": form,
        "requests": 2,
        "completed": 2,
        "failed": 0,
        "short": 0,
        "output_tokens": int(tok_s * 2),
        "duration_s": 2.0,
        "output_tokens_per_s": tok_s,
        "device_steps": 10,
        "generated": 20 if form == "off" else 40,
        "spec_drafts": drafts,
        "spec_draft_tokens": proposed,
        "spec_accepted_tokens": accepted,
        "tpot_samples_ms": list(tpot),
    }


def test_spec_bench_cells_and_ratios():
    runs = [
        _run("off", 0, 10.0, [20.0, 22.0], (0, 0, 0)),
        _run("ngram", 0, 15.0, [10.0, 12.0], (4, 16, 8)),
        _run("off", 1, 20.0, [20.0, 20.0], (0, 0, 0)),
        _run("ngram", 1, 40.0, [10.0, 10.0], (6, 24, 18)),
    ]
    cells = SB.collect_cells(runs)
    assert [c["form"] for c in cells] == ["off", "ngram"]
    off, ngram = cells
    assert off["output_tokens_per_s"] == pytest.approx(15.0)  # 60 tokens over 4 s
    assert off["spec_acceptance_rate"] is None and off["tokens_per_step"] == pytest.approx(2.0)
    assert ngram["spec_draft_tokens"] == 40 and ngram["spec_acceptance_rate"] == pytest.approx(26 / 40)
    assert ngram["spec_accepted_per_draft"] == pytest.approx(2.6)
    assert ngram["tpot_ms_p50"] == pytest.approx(10.0)
    (ratio,) = SB.ratios_to_base(cells)
    assert ratio["form"] == "ngram" and ratio["tokens_per_s_ratio"] == pytest.approx(27.5 / 15.0)
    assert ratio["paired_tokens_per_s_ratio"] == pytest.approx((1.5 + 2.0) / 2)
    assert ratio["tpot_ms_p50_ratio"] == pytest.approx(10.0 / 20.0)
    absent = SB.collect_cells([_run("ngram", 0, 5.0, [1.0])])  # a server without the counters
    assert absent[0]["spec_acceptance_rate"] is None and SB.ratios_to_base(absent) == []
    doc = {
        "machine": {"cpu_model": "X", "cpu_flags": ["avx2"], "git": {}},
        "plan": {"rounds": 2, "requests": {"1": 2}, "max_tokens": 8, "random_input_len": 4, "neighbours": 1},
        "created": "now",
        "model": "/m.gguf",
        "forms": [{"name": f.name, "server_args": list(f.server_args)} for f in SB.forms_for([2])],
        "common_server_args": ["--model", "/m.gguf"],
        "elapsed_s": 1.0,
        "parity": [{"form": "ngram", "request": 0, "identical": True, "first_difference": None}],
        "busy": [{"busy_processes": 1, "busy_cpu_s": 1.0, "busy_wall_s": 1.0}],
        "cells": cells,
        "ratios": SB.ratios_to_base(cells),
    }
    md = SB.markdown(doc)
    assert "| quiet | copy | 1 | ngram | 27.5 |" in md and "65%" in md and "1/1 outputs identical" in md
    assert "ngram-k2" in md and "--num-speculative-tokens 2" in md


def test_spec_bench_plan_order_and_machine(tmp_path):
    assert [SB.round_order(["a", "b", "c"], r, 0)[0] for r in range(4)] == ["a", "b", "c", "a"]
    args = SB.build_parser().parse_args(["--out", str(tmp_path), "--quick"])
    plan = SB.plan_for(args)
    assert plan.rounds == 1 and plan.max_tokens == 16 and plan.streams == (1, 8)
    full = SB.plan_for(SB.build_parser().parse_args(["--out", str(tmp_path)]))
    assert full.requests == {1: 2, 8: 8} and full.rounds == 3
    info = tmp_path / "cpuinfo"
    info.write_text("model name\t: X\nflags\t\t: fpu sse avx avx2 avx512f avx512_vnni avx_vnni fma\n")
    assert SB.cpu_flags(str(info)) == ["avx2", "avx512_vnni", "avx512f", "avx_vnni", "fma"]
    assert SB.cpu_flags(str(tmp_path / "none")) == []


# ---------------------------------------------------------------- end to end (tiny, real servers)

needs_spec = pytest.mark.skipif(not SB.speculative_flags(), reason="serve has no --speculative yet")


@needs_spec
def test_spec_bench_end_to_end_on_tiny(tmp_path):
    """spec_bench's servers, parity check and interleaved cells against two `serve --model tiny`
    (off and ngram), one quick round at 2 streams; greedy outputs must match, and the counters the
    bench reads come from the real servers (ngram drafts, off does not)."""
    out = tmp_path / "spec"
    argv = ["--out", str(out), "--quick", "--model", "tiny", "--streams", "2", "--neighbours", "0"]
    argv += ["--slots", "4", "--max-ctx", "1024"]
    assert SB.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert [(c["workload"], c["streams"]) for c in doc["cells"]] == [("copy", 2)] * 2 + [("random", 2)] * 2
    assert {c["form"] for c in doc["cells"]} == {"off", "ngram"}
    assert all(c["completed"] == c["requests"] == 2 and c["failed"] == 0 for c in doc["cells"])
    assert doc["parity"] and all(x["identical"] for x in doc["parity"])
    off = [c for c in doc["cells"] if c["form"] == "off"]
    assert all(c["spec_draft_tokens"] == 0 and c["spec_acceptance_rate"] is None for c in off)
    ngram = [c for c in doc["cells"] if c["form"] == "ngram"]
    assert any(c["spec_draft_tokens"] for c in ngram)
    for c in ngram:
        assert c["spec_acceptance_rate"] is None or 0.0 <= c["spec_acceptance_rate"] <= 1.0
    assert len(doc["ratios"]) == 2 and "| quiet | copy | 2 | ngram |" in (out / "README.md").read_text()


def test_the_bench_swaps_in_the_copy_workload():
    """run_driver.copy_plan: the same loads and counts as the random plan, copy requests in place
    of its ids (the warm-up's from seed + 1, at most 16 tokens), --output-len as the cap."""
    from ringleader.bench.load_plan import plan_loads
    from ringleader.bench.run_driver import copy_plan

    argv = ["--model", "tiny", "--workload", "copy", "--concurrency", "1,4", "--requests", "3,5"]
    args = cli.build_parser().parse_args([*argv, "--warmup", "2", "--output-len", "40"])
    plan, how = copy_plan(args, plan_loads(args, 2048, (3, 256)), 2048)
    assert how == "plain" and [len(specs) for _, specs in plan.points] == [3, 5]
    assert [load.concurrency for load, _ in plan.points] == [1, 4]
    assert plan.points[1][1] == make_copy_requests(5, _plain, _count, seed=0, max_context=2048, output_cap=40)
    assert plan.points[0][1] == plan.points[1][1][:3]
    assert plan.warm == make_copy_requests(2, _plain, _count, seed=1, max_context=2048, output_cap=16)
    uncapped, _ = copy_plan(cli.build_parser().parse_args(argv), plan_loads(args, 2048, (3, 256)), 2048)
    assert [s.max_tokens for s in uncapped.points[0][1]] == [
        _count(load_passages()[c.passage]) for c in copy_choices(3, 0)
    ]
