"""The graphs the compute streams launch around the captured step graphs, in three modes.

pingpong: two graphs, one per seq parity p on a stream of its own, each
WHILE { rl_plan_wait(p) -> SWITCH(planned bucket) { rl_step_gate(p) -> step graph per bucket } ->
rl_signal_pingpong(p) }, each launched once.  Graph p's WHILE re-arm and its SWITCH run while
graph 1-p's step computes (the scheduler publishes the next step's bucket ahead, cfg.plan_ahead),
and its gate, a one-thread kernel, is already parked in the branch when the step is released: the
only things between two steps are the scheduler's critical phase, a device-memory flag and one
plain graph edge.  Measured on an H100: a WHILE iteration 4.1 us, WHILE + a 4-way SWITCH 9.4 us,
a plain chained node 0.85 us, a device flag hand-off 0.61 us one way; resident pays the first two
between every two steps.  The gate stamps the step's start.
resident: WHILE { rl_step_wait -> SWITCH(bucket) { rl_step_begin -> step graph per bucket } ->
rl_step_signal }, launched once; the wait kernel ends the loop on exit.  rl_step_begin stamps
the step's start inside the branch, so the bubble includes the SWITCH and the branch launch.
pump: the same three nodes unrolled PUMP_STEPS_PER_LAUNCH times; a host thread keeps two
launches queued.
HostStampedGraphs, the host-scheduled baseline's: [rl_host_step_begin -> step graph ->
rl_host_step_end] per bucket, one launch a step, so its bubble is stamped on the device as well.

With the signal in the step (`--step-signal in-step`, what auto takes where it builds), each
branch's step graph is a copy ending in the mode's signal kernel, after the step's last kernel by
a programmatic edge on sm_90+: the signal may be resident before the step ends and waits for it
with griddepcontrol.wait, so the turn comes back without a node launch after the step, and the
body has no node after the SWITCH (the signal does nothing when the turn is not COMPUTE, so a
branch that does not run needs none).

All are instantiated and uploaded here, before the scheduler kernel starts: a first launch that
still has upload or lazy-loading work to do could otherwise wait on a device that the
persistent kernel never lets go idle.  The step graphs of all modes still run one at a time (the
turn orders them), so they may share the capture's memory pool.
"""

from __future__ import annotations

import ctypes

from ringleader.device.backends import cuda_driver as drv
from ringleader.device.backends.step_graphs import StepGraphs

PUMP_STEPS_PER_LAUNCH = 8
LAUNCH_MODES = ("pingpong", "resident", "pump")
SIGNAL_PLACES = ("in-step", "node")  # where the step hands the turn back (LaunchGraph's signal)
WHILE = "CU_GRAPH_COND_TYPE_WHILE"
SWITCH = "CU_GRAPH_COND_TYPE_SWITCH"


def _kind(name: str):
    return getattr(drv.cu.CUgraphConditionalNodeType, name)


class LaunchGraph:
    """The mode's graphs (pingpong: two, graph p at index p; else one), instantiated and uploaded.

    signal: where the step hands the turn back.  "node": a signal node after the SWITCH, as each
    mode's diagram above shows.  "in-step": the signal is the last node of each branch's copy of
    its step graph, after the step's last nodes, by programmatic edges where those are kernel
    nodes and `programmatic` (sm_90+): it may be resident before the step's last kernel ends
    and waits for it (griddepcontrol.wait), so no node's launch lies between the step's end and
    the turn, and the body has one node fewer."""

    def __init__(
        self,
        mode: str,
        graphs: StepGraphs,
        functions: dict,
        ctx_arg: bytes,
        cu_ctx,
        stream,
        *,
        signal: str = "node",
        programmatic: bool = False,
    ):
        if mode not in LAUNCH_MODES:
            raise ValueError(f"launch mode must be one of {LAUNCH_MODES}, got {mode!r}")
        if signal not in SIGNAL_PLACES:
            raise ValueError(f"step signal must be one of {SIGNAL_PLACES}, got {signal!r}")
        self.mode, self.signal = mode, signal
        self._graphs, self._fn, self._ctx_arg, self._cu_ctx = graphs, functions, ctx_arg, cu_ctx
        self._programmatic = programmatic
        self._keep_args: list[drv.KernelArgs] = []  # kernel node parameters must outlive the graphs
        self.programmatic_signals = 0  # in-step: signal nodes reached by programmatic edges
        self.raws: list = []
        self.execs: list = []
        try:
            for parity in range(2 if mode == "pingpong" else 1):
                self.raws.append(drv.create_graph())
                self._build(mode, self.raws[-1], parity)
                self.execs.append(drv.instantiate_graph(self.raws[-1]))
        except BaseException:  # a refused graph (auto falls back): none half-built kept
            self.destroy()
            raise
        for exec_ in self.execs:
            drv.upload_graph(exec_, stream)

    def _build(self, mode: str, graph, parity: int) -> None:
        if mode == "pump":
            last = []
            for _ in range(PUMP_STEPS_PER_LAUNCH):
                last = [self._step_body(graph, last, None, use_while=0)]
            return
        loop = drv.conditional_handle(graph, self._cu_ctx, 1)
        _, (body,) = drv.add_conditional_node(graph, [], loop, _kind(WHILE), 1, self._cu_ctx)
        if mode == "resident":
            self._step_body(body, [], loop, use_while=1)
        else:
            self._pingpong_body(body, loop, parity)

    def _step_body(self, graph, deps, while_handle, use_while: int):
        """[wait -> SWITCH(bucket) -> signal] appended to `graph` after `deps` (in-step: the signal
        inside each branch); returns the last node."""
        switch = drv.conditional_handle(graph, self._cu_ctx, len(self._graphs.buckets))
        wait_args = drv.KernelArgs(
            self._ctx_arg,
            drv.handle_arg(switch),
            drv.handle_arg(while_handle or 0),
            ctypes.c_uint32(use_while),
        )
        ctx_args = drv.KernelArgs(self._ctx_arg)  # rl_step_begin and rl_step_signal take only ctx
        self._keep_args += [wait_args, ctx_args]
        wait = drv.add_kernel_node(graph, deps, self._fn["rl_step_wait"], wait_args)
        signal = (self._fn["rl_step_signal"], ctx_args)
        if self.signal == "in-step":
            return self._switch(graph, wait, switch, self._fn["rl_step_begin"], ctx_args, signal)
        node = self._switch(graph, wait, switch, self._fn["rl_step_begin"], ctx_args)
        return drv.add_kernel_node(graph, [node], *signal)

    def _pingpong_body(self, body, while_handle, parity: int) -> None:
        """Graph `parity`'s WHILE body: [plan wait -> SWITCH(planned bucket) { gate -> step } -> signal]
        (in-step: the signal inside each branch, after the step)."""
        switch = drv.conditional_handle(body, self._cu_ctx, len(self._graphs.buckets))
        plan_args = drv.KernelArgs(
            self._ctx_arg, drv.handle_arg(switch), drv.handle_arg(while_handle), ctypes.c_uint32(parity)
        )
        parity_args = drv.KernelArgs(self._ctx_arg, ctypes.c_uint32(parity))  # the gate's, the signal's
        self._keep_args += [plan_args, parity_args]
        plan = drv.add_kernel_node(body, [], self._fn["rl_plan_wait"], plan_args)
        signal = (self._fn["rl_signal_pingpong"], parity_args)
        if self.signal == "in-step":
            self._switch(body, plan, switch, self._fn["rl_step_gate"], parity_args, signal)
            return
        node = self._switch(body, plan, switch, self._fn["rl_step_gate"], parity_args)
        drv.add_kernel_node(body, [node], *signal)

    def _switch(self, graph, after, switch, first_fn, first_args, signal=None):
        """SWITCH(switch) after node `after`: branch i runs first_fn, then bucket i's step graph
        (cfg.buckets order, as the wait kernels index them), with signal = (function, args) as
        its last node if given; returns the SWITCH node."""
        buckets = self._graphs.buckets
        node, bodies = drv.add_conditional_node(
            graph, [after], switch, _kind(SWITCH), len(buckets), self._cu_ctx
        )
        for body, bucket in zip(bodies, buckets):
            first = drv.add_kernel_node(body, [], first_fn, first_args)
            if signal is None:
                drv.add_child_graph_node(body, [first], drv.cu.CUgraph(int(self._graphs.raw(bucket))))
                continue
            step = self._step_with_signal(bucket, *signal)
            try:
                drv.add_child_graph_node(body, [first], step)  # the driver copies it
            finally:
                drv.destroy_graph(step)
        return node

    def _step_with_signal(self, bucket: int, function, args):
        """A copy of bucket's step graph ending in the signal node, after every node nothing
        else waits for (programmatic edges when all of those are kernel nodes)."""
        step = drv.clone_graph(self._graphs.raw(bucket))
        try:
            sinks = drv.graph_sinks(step)
            programmatic = self._programmatic and bool(sinks) and all(kernel for _, kernel in sinks)
            drv.add_kernel_node_after(step, [h for h, _ in sinks], function, args, programmatic=programmatic)
        except BaseException:
            drv.destroy_graph(step)
            raise
        self.programmatic_signals += programmatic
        return step

    def launch(self, stream, parity: int = 0) -> None:
        """Launches graph `parity` (pingpong: 0 or 1; else the one graph)."""
        drv.launch_graph(self.execs[parity], stream)

    def destroy(self) -> None:
        """Only once no launch of them can still run."""
        for exec_ in self.execs:
            drv.destroy_graph_exec(exec_)
        for raw in self.raws:
            drv.destroy_graph(raw)
        self.execs, self.raws = [], []


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
