"""The bubble's design choices as rows beside the goals: what gpu_limits probes 8-10 measured
(bench/lab/gpu_limits: devlaunch, graphpair, stepwhile) read from their JSON, each design's step
boundary against the bubble goal's p50.

A row: the design, what was measured (p50/p99 µs, or what the driver refused) and a verdict:
"under the goal" / "over the goal" (its p50 against BUBBLE_P50_US), "refused" (the driver would
not do it; the error is the finding), "failed" (the probe's own check failed) or "not measured".
"""

from __future__ import annotations

from dataclasses import dataclass

LIMITS_SCHEMA = "ringleader.gpu_limits/1"


@dataclass
class Design:
    design: str
    measured: str
    verdict: str


def _us(stats: dict | None) -> str | None:
    if not stats or not stats.get("n"):
        return None
    return f"p50 {stats['median_us']:.2f} / p99 {stats['p99_us']:.2f} µs (n={stats['n']})"


def _not_ok(design: str, part: dict) -> Design:
    """A part that did not give its figure: skipped (not measured) or broken (failed)."""
    why = part.get("error") or part.get("where") or part.get("reason") or part.get("errors") or ""
    verdict = "not measured" if part.get("status") == "skipped" else "failed"
    return Design(design, f"{part.get('status')} {why}".strip(), verdict)


def _timed_row(design: str, part: dict | None, key: str, goal_us: float) -> Design:
    if not part:
        return Design(design, "—", "not measured")
    stats = part.get(key)
    text = _us(stats)
    if part.get("status") != "ok" or text is None:
        return _not_ok(design, part)
    return Design(design, text, "under the goal" if stats["median_us"] <= goal_us else "over the goal")


def _persistent_row(design: str, part: dict | None, goal_us: float) -> Design:
    if not part:
        return Design(design, "—", "not measured")
    if part.get("status") != "ok":
        return _not_ok(design, part)
    ran, wanted, err = part.get("ran_while_launcher_waited"), part.get("requested"), part.get("first_error")
    text = f"{ran}/{wanted} launches ran while the launcher spun (exit {part.get('exit')})"
    if err:
        text += f"; launch {err['index']} returned error {err['code']}"
    timed = _us(part.get("launch_to_first_kernel"))
    if timed:
        text += f"; launch → first kernel {timed}"
    if not ran:
        return Design(design, text, "refused")
    p50 = part["launch_to_first_kernel"]["median_us"] if timed else None
    return Design(design, text, "under the goal" if p50 is not None and p50 <= goal_us else "over the goal")


def design_rows(limits_docs: list[dict], goal_us: float) -> list[Design]:
    """One row per design; where several documents measured it, the last one's."""
    probes: dict = {}
    for doc in limits_docs:
        probes.update(doc.get("probes") or {})
    dl, gp, sw = probes.get("8_devlaunch") or {}, probes.get("9_graphpair") or {}, probes.get("10_stepwhile")
    rows = [
        _timed_row(
            f"graph launched from the device ({mode.replace('_', '-')}) → its first kernel",
            dl.get(f"launch_{mode}"),
            "launch_to_first_kernel",
            goal_us,
        )
        for mode in ("fire_and_forget", "tail", "sibling")
    ]
    rows.append(
        _timed_row(
            "a graph tail-launching itself: one loop iteration",
            dl.get("tail_self_loop"),
            "per_iteration_from_stamps",
            goal_us,
        )
    )
    rows.append(
        _persistent_row(
            "persistent kernel (a graph's node) launching step graphs", dl.get("persistent_in_graph"), goal_us
        )
    )
    rows.append(
        _persistent_row(
            "persistent kernel (plain launch) launching step graphs", dl.get("persistent_plain"), goal_us
        )
    )
    for work in ("0", "20"):
        rows.append(
            _timed_row(
                f"one WHILE graph, {work}-µs steps: idle between steps",
                gp.get(f"one_work_{work}us"),
                "idle_between_steps",
                goal_us,
            )
        )
        rows.append(
            _timed_row(
                f"two WHILE graphs taking turns, {work}-µs steps: idle between steps",
                gp.get(f"pair_work_{work}us"),
                "idle_between_steps",
                goal_us,
            )
        )
    step = "WHILE around the real 1-row step: per iteration minus the step"
    if not sw:
        rows.append(Design(step, "—", "not measured"))
    elif sw.get("status") != "ok":
        rows.append(_not_ok(step, sw))
    else:
        extra = sw["while_minus_single_replay_us"]
        text = f"{extra:+.2f} µs ({sw['while_per_iteration_us']:.1f} µs per iteration, {sw['model']}, "
        text += f"{sw['step_graph_nodes']} nodes)"
        rows.append(Design(step, text, "under the goal" if extra <= goal_us else "over the goal"))
    return rows


def designs_markdown(rows: list[Design], goal_us: float) -> str:
    lines = [
        f"| step-boundary design (bubble goal: p50 ≤ {goal_us:g} µs) | measured | verdict |",
        "|---|---|---|",
    ]
    lines += [f"| {d.design} | {d.measured} | **{d.verdict}** |" for d in rows]
    return "\n".join(lines) + "\n"
