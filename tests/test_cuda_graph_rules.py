"""The check that a captured step graph may be embedded in a conditional node, over node trees
shaped as the driver reports them (the GPU bring-up reads the real ones)."""

import pytest

from ringleader.device.backends.cuda_graph_rules import (
    BODY_NODE_TYPES,
    GraphNode,
    GraphNotEmbeddable,
    check_conditional_body,
)

K, MC, MS = "CU_GRAPH_NODE_TYPE_KERNEL", "CU_GRAPH_NODE_TYPE_MEMCPY", "CU_GRAPH_NODE_TYPE_MEMSET"


def child(*nodes):
    return GraphNode("CU_GRAPH_NODE_TYPE_GRAPH", list(nodes))


def test_a_plain_step_graph_passes_and_is_counted():
    nodes = [GraphNode(K)] * 5 + [GraphNode(MC), GraphNode(MS), child(GraphNode(K), GraphNode(MC))]
    report = check_conditional_body(nodes, bucket=8, programmatic_edges=0)
    assert report.nodes == {"KERNEL": 6, "MEMCPY": 2, "MEMSET": 1, "GRAPH": 1}
    assert report.summary() == "1 graph, 6 kernel, 2 memcpy, 1 memset"


@pytest.mark.parametrize(
    "bad",
    [
        "CU_GRAPH_NODE_TYPE_EVENT_RECORD",
        "CU_GRAPH_NODE_TYPE_WAIT_EVENT",
        "CU_GRAPH_NODE_TYPE_HOST",
        "CU_GRAPH_NODE_TYPE_MEM_ALLOC",
        "CU_GRAPH_NODE_TYPE_MEM_FREE",
        "CU_GRAPH_NODE_TYPE_BATCH_MEM_OP",
    ],
)
def test_forbidden_nodes_are_named_with_the_bucket_even_deep_in_child_graphs(bad):
    nodes = [GraphNode(K), child(GraphNode(K), child(GraphNode(bad), GraphNode(bad)))]
    with pytest.raises(GraphNotEmbeddable) as err:
        check_conditional_body(nodes, bucket=64)
    text = str(err.value)
    short = bad.removeprefix("CU_GRAPH_NODE_TYPE_")
    assert "bucket 64" in text and f"{short} x2" in text
    assert all(t in text for t in BODY_NODE_TYPES)  # says what would be allowed


def test_programmatic_edges_are_reported_not_refused():
    report = check_conditional_body([GraphNode(K), GraphNode(K)], bucket=1, programmatic_edges=3)
    assert "3 programmatic edges" in report.summary()
    unknown = check_conditional_body([GraphNode(K)], bucket=1, programmatic_edges=-1)
    assert "edge kinds unknown" in unknown.summary()
