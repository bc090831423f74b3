"""What a conditional node's body may hold, checked before a captured step graph is embedded.

CUDA's rule (CUDA_CONDITIONAL_NODE_PARAMS): kernel, empty, child-graph, memset, memcpy and
conditional nodes only, recursively through child graphs.  A step graph that breaks it makes
cuGraphAddChildGraphNode or cuGraphInstantiate fail with a bare error code; this check names the
node types and the bucket instead, and counts what each bucket holds for the log.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Node type names as the driver's CUgraphNodeType spells them, without the prefix.
BODY_NODE_TYPES = frozenset({"KERNEL", "EMPTY", "GRAPH", "MEMSET", "MEMCPY", "CONDITIONAL"})
NODE_TYPE_PREFIX = "CU_GRAPH_NODE_TYPE_"


@dataclass
class GraphNode:
    """One node of a graph as read back from the driver; `children` are a child graph's nodes."""

    type: str
    children: list[GraphNode] = field(default_factory=list)


@dataclass
class GraphReport:
    """Node counts of one graph, child graphs included, and its dependency edges by kind."""

    nodes: Counter = field(default_factory=Counter)
    programmatic_edges: int = 0  # -1: the driver could not say

    def summary(self) -> str:
        parts = [f"{n} {t.lower()}" for t, n in sorted(self.nodes.items())]
        if self.programmatic_edges > 0:
            parts.append(f"{self.programmatic_edges} programmatic edges")
        elif self.programmatic_edges < 0:
            parts.append("edge kinds unknown")
        return ", ".join(parts) or "empty"


class GraphNotEmbeddable(RuntimeError):
    """A captured step graph holds nodes a conditional body cannot run."""


def short_type(name: str) -> str:
    return name[len(NODE_TYPE_PREFIX) :] if name.startswith(NODE_TYPE_PREFIX) else name


def count_nodes(nodes: list[GraphNode], report: GraphReport | None = None) -> GraphReport:
    report = report or GraphReport()
    for node in nodes:
        report.nodes[short_type(node.type)] += 1
        count_nodes(node.children, report)
    return report


def check_conditional_body(nodes: list[GraphNode], bucket: int, programmatic_edges: int = 0) -> GraphReport:
    """Raises GraphNotEmbeddable naming each forbidden node type and the bucket; returns counts."""
    report = count_nodes(nodes)
    report.programmatic_edges = programmatic_edges
    bad = {t: n for t, n in report.nodes.items() if t not in BODY_NODE_TYPES}
    if bad:
        listed = ", ".join(f"{t} x{n}" for t, n in sorted(bad.items()))
        raise GraphNotEmbeddable(
            f"the step graph of bucket {bucket} cannot run inside a conditional node: it holds "
            f"{listed} (a conditional body may hold only {', '.join(sorted(BODY_NODE_TYPES))}); "
            f"whole graph: {report.summary()}"
        )
    return report
