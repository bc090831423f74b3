"""Per-kernel profile of one decode step, for `python -m ringleader.bench.roofline --profile`.

On CUDA, torch.profiler (CUPTI) records `steps` replays of the captured step graph; the
device events (kernels, memsets, memcpys) are split into steps and grouped by name: count per
step, microseconds per step, share of the step's device time, and achieved GB/s where the
bytes are known. The GPU idle time between consecutive kernels inside a step (the gaps) and
the captured graph's nodes by type (read back through cuda-python) sit beside the table. If
the replays show no kernel events, the same step run eagerly is profiled instead
(profiled = "eager"). On the CPU, the eager step's top-level torch ops (ProfilerActivity.CPU)
take the kernels' place (profiled = "eager-cpu"). step_kernels names the step kind profiled
(fused, layered; "fused,layered" where the kinds are one step, as on the CPU; None if not told),
in the profile and its printed header.

Bytes: a matmul op's tensor operands (shape x element size, weights included), read from an
eager profile with record_shapes and given to the kernel that op launched (the longest, when a
library splits it, e.g. cuBLAS split-K + reduction); a graph kernel name gets them only when
the eager run launches that name as often as the graph does. Everything else: GB/s null.

The grouping, splitting and gap arithmetic are pure functions over plain event tuples
(name, start_us, end_us[, kind]) so that they are tested without a profiler.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

STEP_LABEL = "roofline_step"  # the record_function range around each eager step
TOP_KERNELS = 25  # rows of the printed table
# ops whose operand bytes are what their kernel reads (weights and activations)
MATMUL_OPS = frozenset(
    {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul"}
)
_DTYPE_BYTES = {
    "float": 4,
    "double": 8,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
}
_API_CALL = re.compile(r"cu(da)?[A-Z]")  # cudaLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch, ...
_DEVICE_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
_NODE_KINDS = {
    "CU_GRAPH_NODE_TYPE_KERNEL": "kernel",
    "CU_GRAPH_NODE_TYPE_MEMSET": "memset",
    "CU_GRAPH_NODE_TYPE_MEMCPY": "memcpy",
}

Event = tuple  # (name, start_us, end_us) or (name, start_us, end_us, kind)


def _kind(event: Event) -> str:
    return event[3] if len(event) > 3 else "kernel"


# ---- pure functions over event tuples -------------------------------------------------------


def split_steps(events: Iterable[Event], n_steps: int) -> list[list[Event]]:
    """The events of `n_steps` identical steps run back to back, in start order, as n_steps equal
    runs (a graph replay launches the same nodes every time). ValueError when they do not divide."""
    ordered = sorted(events, key=lambda e: (e[1], e[2]))
    if n_steps <= 0 or len(ordered) % n_steps:
        raise ValueError(f"{len(ordered)} events do not split into {n_steps} equal steps")
    per = len(ordered) // n_steps
    return [ordered[i * per : (i + 1) * per] for i in range(n_steps)]


def step_gaps(step: Sequence[Event]) -> list[float]:
    """Idle microseconds before each event but the first: its start minus the latest end so far
    (0 where it overlaps a running one)."""
    gaps: list[float] = []
    reach: float | None = None
    for event in sorted(step, key=lambda e: (e[1], e[2])):
        start, end = event[1], event[2]
        if reach is not None:
            gaps.append(max(0.0, start - reach))
        reach = end if reach is None else max(reach, end)
    return gaps


def gap_summary(steps: Sequence[Sequence[Event]]) -> dict:
    """Per step (mean over steps): device-busy time, span first start to last end, the summed
    gaps; over all gaps of all steps: the median and the largest."""
    all_gaps = [g for step in steps for g in step_gaps(step)]
    n = max(len(steps), 1)
    busy = sum(e[2] - e[1] for step in steps for e in step) / n
    span = sum(max(e[2] for e in s) - min(e[1] for e in s) for s in steps if s) / n
    return {
        "busy_us_per_step": round(busy, 2),
        "span_us_per_step": round(span, 2),
        "gap_us_per_step": round(sum(all_gaps) / n, 2),
        "gap_p50_us": round(statistics.median(all_gaps), 3) if all_gaps else 0.0,
        "gap_max_us": round(max(all_gaps), 3) if all_gaps else 0.0,
        "gaps_per_step": _per_step(len(all_gaps), n),
    }


def _per_step(total: float, n_steps: int) -> int | float:
    """total / n_steps, an int when it divides (a count seen the same in every step)."""
    if isinstance(total, int) and total % n_steps == 0:
        return total // n_steps
    return round(total / n_steps, 3)


def kind_counts(steps: Sequence[Sequence[Event]]) -> dict[str, int | float]:
    """Events per step by kind (kernel, memcpy, memset, op)."""
    counts = Counter(_kind(e) for step in steps for e in step)
    return {k: _per_step(v, max(len(steps), 1)) for k, v in sorted(counts.items())}


def kernel_table(
    steps: Sequence[Sequence[Event]], bytes_per_step: Mapping[str, float | None] | None = None
) -> list[dict]:
    """One row per event name, most time first: count and microseconds per step, share of all
    the steps' event time (the shares sum to 1), bytes per step where known and GB/s from them."""
    bytes_per_step = bytes_per_step or {}
    n = max(len(steps), 1)
    count: Counter[str] = Counter()
    time: dict[str, float] = {}
    kind: dict[str, str] = {}
    for step in steps:
        for e in step:
            count[e[0]] += 1
            time[e[0]] = time.get(e[0], 0.0) + (e[2] - e[1])
            kind.setdefault(e[0], _kind(e))
    total = sum(time.values())
    rows = []
    for name in sorted(time, key=lambda k: (-time[k], k)):
        us = time[name] / n
        nbytes = bytes_per_step.get(name)
        rows.append(
            {
                "name": name,
                "kind": kind[name],
                "count_per_step": _per_step(count[name], n),
                "us_per_step": round(us, 3),
                "share": round(time[name] / total, 6) if total > 0 else 0.0,
                "bytes_per_step": nbytes,
                "GBps": round(nbytes / us / 1e3, 1) if nbytes is not None and us > 0 else None,
            }
        )
    return rows


def op_bytes(shapes: Sequence, dtypes: Sequence[str]) -> int | None:
    """Bytes of an op's tensor inputs; None when a tensor's element size is unknown."""
    total = 0
    for i, shape in enumerate(shapes):
        if not shape or not all(isinstance(d, int) for d in shape):
            continue  # a scalar, a list argument or an absent optional
        size = _DTYPE_BYTES.get(dtypes[i]) if i < len(dtypes) else None
        if size is None:
            return None
        total += math.prod(shape) * size
    return total


def kernel_bytes(launches: Iterable[tuple[int | None, Sequence[tuple[str, float]]]], n_steps: int) -> dict:
    """{kernel name: (launches per step, bytes per step or None)} from each op's (bytes or None,
    [(kernel name, duration)]): the op's bytes go to its longest kernel, its other kernels and
    every kernel of an op without bytes make their name's bytes unknown."""
    count: Counter[str] = Counter()
    nbytes: dict[str, int | None] = {}
    for op_nbytes, kernels in launches:
        longest = max(range(len(kernels)), key=lambda i: kernels[i][1]) if kernels else -1
        for i, (name, _) in enumerate(kernels):
            count[name] += 1
            known = nbytes.get(name, 0)
            if op_nbytes is None or i != longest or known is None:
                nbytes[name] = None
            else:
                nbytes[name] = known + op_nbytes
    n = max(n_steps, 1)
    return {k: (count[k] / n, None if nbytes[k] is None else nbytes[k] / n) for k in count}


def matched_bytes(rows_counts: Mapping[str, float], eager: Mapping[str, tuple[float, float | None]]) -> dict:
    """Bytes per step for the names the eager run launches exactly as often as the profiled run."""
    out: dict[str, float | None] = {}
    for name, per_step in rows_counts.items():
        seen = eager.get(name)
        out[name] = seen[1] if seen is not None and abs(seen[0] - per_step) < 1e-9 else None
    return out


def count_differences(
    counts: Mapping[str, int], n_steps: int, other: Mapping[str, int], other_steps: int
) -> list[dict]:
    """The names launched a different number of times per step in two profiles (the graph's
    memcpy/memset nodes that run as kernels, say): [{name, per_step, other_per_step}]."""
    out = []
    for name in sorted(set(counts) | set(other)):
        mine = _per_step(counts.get(name, 0), max(n_steps, 1))
        theirs = _per_step(other.get(name, 0), max(other_steps, 1))
        if mine != theirs:
            out.append({"name": name, "per_step": mine, "other_per_step": theirs})
    return out


def node_kind_counts(type_names: Iterable[str]) -> dict:
    """Graph nodes by kind (kernel, memset, memcpy, other) from the driver's node type names."""
    by_type = Counter(type_names)
    out = {"kernel": 0, "memset": 0, "memcpy": 0, "other": 0}
    for name, n in by_type.items():
        out[_NODE_KINDS.get(name, "other")] += n
    return {**out, "total": sum(by_type.values()), "by_type": dict(sorted(by_type.items()))}


def _flatten(nodes) -> list[str]:
    """Type names of a GraphNode tree, child graphs expanded (the child node itself counted too)."""
    out = []
    for node in nodes:
        out.append(node.type)
        out.extend(_flatten(getattr(node, "children", None) or []))
    return out


def graph_node_counts(graph) -> dict | None:
    """The captured graph's nodes by kind, read back through cuda-python; None when the graph
    cannot be read (no raw_cuda_graph in this torch, a graph not kept, no cuda-python)."""
    raw_of = getattr(graph, "raw_cuda_graph", None)
    if raw_of is None:
        return None
    try:
        raw = raw_of()
        from ringleader.device.backends import cuda_driver as drv

        if drv.cu is None or not raw:
            return None
        names = _flatten(drv.read_graph(raw)[0])
    except Exception:  # an informative extra: a graph that cannot be read is reported as None
        return None
    return node_kind_counts(names)


# ---- torch.profiler sessions ----------------------------------------------------------------


def _session(run_once: Callable[[], object], n_steps: int, activities, sync, shapes: bool, label: bool):
    from torch.profiler import profile, record_function

    with profile(activities=activities, record_shapes=shapes) as prof:
        for _ in range(n_steps):
            if label:
                with record_function(STEP_LABEL):
                    run_once()
                    sync()  # the step's device events end inside its range
            else:
                run_once()
        sync()
    return prof


def device_events(prof) -> list[Event]:
    """(name, start_us, end_us, kind) of the CUDA kernels, memsets and memcpys the profile holds."""
    out = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        activity = getattr(e, "activity_type", None)
        if activity:
            kind = _DEVICE_KINDS.get(str(activity))
        elif e.name == STEP_LABEL:  # a torch without activity_type: our range projected on the GPU
            kind = None
        else:
            kind = (
                "memcpy"
                if e.name.startswith("Memcpy")
                else "memset"
                if e.name.startswith("Memset")
                else "kernel"
            )
        if kind is not None:
            out.append((e.name, e.time_range.start, e.time_range.end, kind))
    return out


def _is_op(e) -> bool:
    """A torch op or range, not a CUDA runtime/driver call (whose correlation ids may collide with
    an op's, so that the profiler hangs the op's kernels on them too)."""
    activity = getattr(e, "activity_type", None)
    if activity:
        return str(activity) in ("cpu_op", "user_annotation")
    return _API_CALL.match(e.name) is None


def _input_dtypes(prof) -> Callable[[object], list]:
    """An op's input dtype names: FunctionEvent.input_dtypes, or (a torch without it) the dtypes
    of the kineto event with the op's correlation id."""
    by_id: dict[int, list] = {}
    try:
        for k in prof.profiler.kineto_results.events():
            if k.device_type() == torch.autograd.DeviceType.CPU and k.name() in MATMUL_OPS:
                by_id[k.correlation_id()] = list(k.dtypes())
    except Exception:  # no kineto results: the ops' own field or nothing
        pass
    return lambda e: getattr(e, "input_dtypes", None) or by_id.get(e.id, [])


def op_launches(prof) -> list[tuple[int | None, list[tuple[str, float]]]]:
    """Per CPU op that launched device work: (its operand bytes if a matmul, [(kernel, duration)])."""
    dtypes_of = _input_dtypes(prof)
    out = []
    for e in prof.events():
        kernels = getattr(e, "kernels", None) or []
        if e.device_type != torch.autograd.DeviceType.CPU or not kernels or not _is_op(e):
            continue
        nbytes = op_bytes(e.input_shapes or [], dtypes_of(e)) if e.name in MATMUL_OPS else None
        out.append((nbytes, [(k.name, float(k.duration)) for k in kernels]))
    return out


def cpu_step_events(prof) -> list[list[Event]]:
    """Each STEP_LABEL range's direct child ops, as (name, start_us, end_us, "op"), in step order."""
    ranges = sorted((e for e in prof.events() if e.name == STEP_LABEL), key=lambda e: e.time_range.start)
    return [
        sorted(
            ((c.name, c.time_range.start, c.time_range.end, "op") for c in r.cpu_children), key=lambda t: t[1]
        )
        for r in ranges
    ]


def _summary(
    profiled: str,
    steps: list[list[Event]],
    bytes_per_step: Mapping,
    note: str | None,
    step_kernels: str | None,
) -> dict:
    table = kernel_table(steps, bytes_per_step)
    kinds = kind_counts(steps)
    unit = "op" if profiled == "eager-cpu" else "kernel"
    return {
        "step_kernels": step_kernels,
        "profiled": profiled,
        "note": note,
        "steps": len(steps),
        "unit": unit,
        "launches_per_step": kinds.get(unit, 0),
        "events_per_step": kinds,
        **gap_summary(steps),
        "bytes_known": sum(1 for r in table if r["bytes_per_step"] is not None),
        "kernels": table,
    }


def profile_cpu_step(
    run_eager: Callable[[], object], n_steps: int = 20, step_kernels: str | None = None
) -> dict:
    """The eager CPU step's top-level ops, grouped by op name; matmul operand bytes from shapes.
    step_kernels: the step kind(s) it is, kept in the profile."""
    from torch.profiler import ProfilerActivity

    run_eager()  # warm-up
    prof = _session(run_eager, n_steps, [ProfilerActivity.CPU], lambda: None, shapes=True, label=True)
    steps = cpu_step_events(prof)
    dtypes_of = _input_dtypes(prof)
    per_name: dict[str, int | None] = {}
    for r in (e for e in prof.events() if e.name == STEP_LABEL):
        for c in r.cpu_children:
            b = op_bytes(c.input_shapes or [], dtypes_of(c)) if c.name in MATMUL_OPS else None
            known = per_name.get(c.name, 0)
            per_name[c.name] = None if b is None or known is None else known + b
    n = max(len(steps), 1)
    bytes_per_step = {k: (None if v is None else v / n) for k, v in per_name.items()}
    note = "CPU ops called by the step (nested ops folded in)"
    out = _summary("eager-cpu", steps, bytes_per_step, note, step_kernels)
    out["graph_nodes"] = None
    out["eager_launches_per_step"] = out["launches_per_step"]
    out["unlike_eager"] = None  # the profile is the eager step
    return out


def profile_cuda_step(
    replay: Callable[[], object],
    run_eager: Callable[[], object],
    graph,
    n_steps: int = 20,
    step_kernels: str | None = None,
    known_bytes: Mapping[str, float] | None = None,
) -> dict:
    """`n_steps` graph replays under CUPTI, then as many eager steps with shapes (the bytes, and
    the fallback when the replays show no kernels); step_kernels: the step kind, kept in the profile;
    known_bytes: bytes per step by kernel name where the step knows them itself (the fused step's
    weights: FusedDecode.weight_bytes_by_kernel), for names the eager run's shapes cannot give."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    sync = torch.cuda.synchronize
    replay()
    sync()
    graph_events = device_events(_session(replay, n_steps, activities, sync, shapes=False, label=False))
    run_eager()
    sync()
    eager_prof = _session(run_eager, n_steps, activities, sync, shapes=True, label=True)
    eager_events = device_events(eager_prof)
    eager_bytes = kernel_bytes(op_launches(eager_prof), n_steps)
    note = None
    if any(_kind(e) == "kernel" for e in graph_events):
        profiled, events = "graph", graph_events
    else:
        profiled, events = "eager", eager_events
        note = (
            f"the graph replays showed no kernel events ({len(graph_events)} device events): the eager step"
        )
        if not any(_kind(e) == "kernel" for e in eager_events):
            note += ", which showed none either (no CUPTI activity here?)"
    try:
        steps = split_steps(events, n_steps)
    except ValueError as exc:  # uneven steps: one lump, per-step figures are means
        steps, note = [sorted(events, key=lambda e: e[1])], f"{note + '; ' if note else ''}{exc}"
    table_counts = Counter(e[0] for s in steps for e in s)
    per_step_counts = {k: v / len(steps) for k, v in table_counts.items()}
    matched = matched_bytes(per_step_counts, eager_bytes)
    for name, nbytes in (known_bytes or {}).items():
        if name in matched and matched[name] is None:
            matched[name] = nbytes
    out = _summary(profiled, steps, matched, note, step_kernels)
    out["graph_nodes"] = graph_node_counts(graph)
    eager_kinds = Counter(_kind(e) for e in eager_events)
    out["eager_launches_per_step"] = _per_step(eager_kinds.get("kernel", 0), n_steps)
    eager_counts = Counter(e[0] for e in eager_events)
    out["unlike_eager"] = count_differences(table_counts, len(steps), eager_counts, n_steps)
    return out


# ---- text -----------------------------------------------------------------------------------


def _short(name: str, width: int = 88) -> str:
    name = name.removeprefix("void ")
    return name if len(name) <= width else name[: width - 1] + "~"


def format_profile(rows: int, p: dict, top: int = TOP_KERNELS) -> str:
    unit = p["unit"]
    nodes = p.get("graph_nodes")
    node_text = (
        f"graph nodes {nodes['total']} (kernel {nodes['kernel']}, memset {nodes['memset']}, "
        f"memcpy {nodes['memcpy']}, other {nodes['other']})"
        if nodes
        else "graph nodes: not read"
    )
    kinds = ", ".join(f"{v} {k}" for k, v in p["events_per_step"].items())
    kind = f" ({p['step_kernels']})" if p.get("step_kernels") else ""
    lines = [
        f"rows {rows}{kind}: profiled {p['profiled']} over {p['steps']} steps; per step {kinds}; "
        f"eager {unit}s {p['eager_launches_per_step']}; {node_text}",
        f"  busy {p['busy_us_per_step']:.1f} us/step, span {p['span_us_per_step']:.1f} us, gaps "
        f"{p['gap_us_per_step']:.1f} us/step (p50 {p['gap_p50_us']:.2f} us, max {p['gap_max_us']:.1f} us)",
    ]
    if p.get("note"):
        lines.append(f"  note: {p['note']}")
    lines.append(f"  {'us/step':>9} {'share':>6} {'n/step':>7} {'GB/s':>7}  {unit}")
    for r in p["kernels"][:top]:
        gbps = f"{r['GBps']:7.1f}" if r["GBps"] is not None else f"{'-':>7}"
        lines.append(
            f"  {r['us_per_step']:9.1f} {r['share']:6.1%} {r['count_per_step']!s:>7} {gbps}  {_short(r['name'])}"
        )
    rest = p["kernels"][top:]
    if rest:
        us = sum(r["us_per_step"] for r in rest)
        share = sum(r["share"] for r in rest)
        lines.append(f"  {us:9.1f} {share:6.1%} {'':>7} {'':>7}  ({len(rest)} more names)")
    total_n = sum(r["count_per_step"] for r in p["kernels"])
    lines.append(f"  {p['busy_us_per_step']:9.1f} {1:6.0%} {total_n!s:>7} {'':>7}  total")
    differing = p.get("unlike_eager") or []
    if differing:
        lines.append(f"  per step, {p['profiled']} vs eager, where they differ:")
        lines += [
            f"    {d['per_step']!s:>5} vs {d['other_per_step']!s:>5}  {_short(d['name'])}" for d in differing
        ]
    return "\n".join(lines)
