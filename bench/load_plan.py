"""What load `ringleader bench` puts on each target: its load points (each --concurrency, then each
--request-rate), the measured requests of each, the warm-up requests, the send options and the
busy-process levels."""

from __future__ import annotations

from dataclasses import dataclass

from ringleader.bench.loadgen import Load, SendOptions
from ringleader.bench.workloads import WorkloadConfig, arrival_times, make_requests


@dataclass
class LoadPlan:
    """Every run of one target: each (load, its measured requests) at each busy level, after the
    warm-up requests, with the same send options."""

    points: list[tuple[Load, list]]
    warm: list
    options: SendOptions
    busy_levels: list[int]


def load_points(args) -> list[tuple[str, float]]:
    """("concurrency", c) for each --concurrency value, then ("rate", r) for each rate."""
    concurrency = args.concurrency if args.concurrency or args.request_rate else [1, 16]
    return [("concurrency", c) for c in concurrency or []] + [("rate", r) for r in args.request_rate or []]


def request_counts(args) -> list[int]:
    """Measured requests of each load point (--requests: one for all, or one each)."""
    n_points = len(load_points(args))
    return list(args.requests) if isinstance(args.requests, list) else [args.requests] * n_points


def loads(args) -> list[tuple[Load, int]]:
    """Each load point as a Load (open-loop arrival times drawn from --seed), with its count."""
    out = []
    for (kind, value), n in zip(load_points(args), request_counts(args)):
        if kind == "concurrency":
            out.append((Load(concurrency=value), n))
        else:
            times = arrival_times(n, value, args.burstiness, args.seed)
            out.append((Load(request_rate=value, arrival_s=times.tolist()), n))
    return out


def plan_loads(args, max_ctx: int, id_range: tuple[int, int]) -> LoadPlan:
    """The requests of every load point and the warm-up, kept to `max_ctx` and to prompt ids in
    `id_range`."""
    # one workload per request count, from the same seed (with fixed lengths a shorter one is a
    # prefix of a longer one)
    workloads: dict[int, list] = {}
    points = []
    for load, n in loads(args):
        if n not in workloads:
            wl = WorkloadConfig(
                n,
                args.input_len,
                args.output_len,
                args.length_dist,
                args.range_ratio,
                args.seed,
                max_context=max_ctx,
                prompt_id_range=id_range,
            )
            workloads[n] = make_requests(wl)
        points.append((load, workloads[n]))
    warm = (
        make_requests(
            WorkloadConfig(
                args.warmup,
                min(args.input_len, 64),
                min(args.output_len, 16),
                "fixed",
                seed=args.seed + 1,
                max_context=max_ctx,
                prompt_id_range=id_range,
            )
        )
        if args.warmup
        else []
    )
    options = SendOptions(temperature=args.temperature, ignore_eos=args.ignore_eos, seed=args.seed)
    busy_levels = sorted({0, *args.cpu_interference})
    return LoadPlan(points, warm, options, busy_levels)
