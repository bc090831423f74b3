"""The graph the compute stream launches around the captured step graphs.

resident: WHILE { rl_step_wait -> SWITCH(bucket) { rl_step_begin -> step graph per bucket } ->
rl_step_signal }, launched once; the wait kernel ends the loop on exit.  rl_step_begin stamps
the step's start inside the branch, so the bubble includes the SWITCH and the branch launch.
pump: the same three nodes unrolled PUMP_STEPS_PER_LAUNCH times; a host thread keeps two
launches queued.
HostStampedGraphs, the host-scheduled baseline's: [rl_host_step_begin -> step graph ->
rl_host_step_end] per bucket, one launch a step, so its bubble is stamped on the device as well.

Both are instantiated and uploaded here, before the scheduler kernel starts: a first launch that
still has upload or lazy-loading work to do could otherwise wait on a device that the
persistent kernel never lets go idle.
"""

from __future__ import annotations

import ctypes

from ringleader.device.backends import cuda_driver as drv
from ringleader.device.backends.step_graphs import StepGraphs

PUMP_STEPS_PER_LAUNCH = 8
LAUNCH_MODES = ("resident", "pump")


class LaunchGraph:
    def __init__(self, mode: str, graphs: StepGraphs, functions: dict, ctx_arg: bytes, cu_ctx, stream):
        if mode not in LAUNCH_MODES:
            raise ValueError(f"launch mode must be one of {LAUNCH_MODES}, got {mode!r}")
        self.mode = mode
        self._graphs, self._fn, self._ctx_arg, self._cu_ctx = graphs, functions, ctx_arg, cu_ctx
        self._keep_args: list[drv.KernelArgs] = []  # kernel node parameters must outlive the graph
        self._graph = drv.create_graph()
        try:
            self._build(mode, cu_ctx)
            self.exec = drv.instantiate_graph(self._graph)
        except BaseException:  # a refused resident graph (auto falls back to pump): none half-built kept
            drv.destroy_graph(self._graph)
            raise
        drv.upload_graph(self.exec, stream)

    def _build(self, mode: str, cu_ctx) -> None:
        if mode == "resident":
            loop = drv.conditional_handle(self._graph, cu_ctx, 1)
            _, (body,) = drv.add_conditional_node(
                self._graph, [], loop, drv.cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE, 1, cu_ctx
            )
            self._step_body(body, [], loop, use_while=1)
        else:
            last = []
            for _ in range(PUMP_STEPS_PER_LAUNCH):
                last = [self._step_body(self._graph, last, None, use_while=0)]

    def _step_body(self, graph, deps, while_handle, use_while: int):
        """[wait -> SWITCH(bucket) -> signal] appended to `graph` after `deps`; returns the last node."""
        buckets = self._graphs.buckets
        switch = drv.conditional_handle(graph, self._cu_ctx, len(buckets))
        wait_args = drv.KernelArgs(
            self._ctx_arg,
            drv.handle_arg(switch),
            drv.handle_arg(while_handle or 0),
            ctypes.c_uint32(use_while),
        )
        ctx_args = drv.KernelArgs(self._ctx_arg)  # rl_step_begin and rl_step_signal take only ctx
        self._keep_args += [wait_args, ctx_args]
        wait = drv.add_kernel_node(graph, deps, self._fn["rl_step_wait"], wait_args)
        node, bodies = drv.add_conditional_node(
            graph,
            [wait],
            switch,
            drv.cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_SWITCH,
            len(buckets),
            self._cu_ctx,
        )
        for body, bucket in zip(bodies, buckets):  # branch i runs bucket i (cfg.buckets order)
            begin = drv.add_kernel_node(body, [], self._fn["rl_step_begin"], ctx_args)
            drv.add_child_graph_node(body, [begin], drv.cu.CUgraph(int(self._graphs.raw(bucket))))
        return drv.add_kernel_node(graph, [node], self._fn["rl_step_signal"], ctx_args)

    def launch(self, stream) -> None:
        drv.launch_graph(self.exec, stream)

    def destroy(self) -> None:
        """Only once no launch of it can still run."""
        drv.destroy_graph_exec(self.exec)
        drv.destroy_graph(self._graph)


class HostStampedGraphs:
    """Host-scheduled mode's step graphs, each between two one-thread stamp kernels that write
    the step's device-clock start and end into the device trace (the same kernels and the same
    launch count per step as a plain replay: the measurement adds two tiny nodes, as in device
    mode)."""

    def __init__(self, graphs: StepGraphs, functions: dict, ctx_arg: bytes, stream):
        self._ctx_args = drv.KernelArgs(ctx_arg)  # kernel node parameters must outlive the graphs
        self._graphs: dict[int, object] = {}
        self._execs: dict[int, object] = {}
        for bucket in graphs.buckets:
            g = drv.create_graph()
            begin = drv.add_kernel_node(g, [], functions["rl_host_step_begin"], self._ctx_args)
            step = drv.add_child_graph_node(g, [begin], drv.cu.CUgraph(int(graphs.raw(bucket))))
            drv.add_kernel_node(g, [step], functions["rl_host_step_end"], self._ctx_args)
            self._graphs[bucket], self._execs[bucket] = g, drv.instantiate_graph(g)
            drv.upload_graph(self._execs[bucket], stream)

    def replay(self, bucket: int, stream) -> None:
        drv.launch_graph(self._execs[bucket], stream)

    def destroy(self) -> None:
        """Only once no launch of them can still run."""
        for bucket, exec_ in self._execs.items():
            drv.destroy_graph_exec(exec_)
            drv.destroy_graph(self._graphs[bucket])
        self._execs.clear()
