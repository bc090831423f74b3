"""CUDA-side memory of the scheduler: pinned host arrays for the rings the host shares, one
device buffer for everything else, the RlContext pointer table, and (host-scheduled mode) the
one-copy upload of the step layout the CPU scheduler builds."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ringleader.device.backends import cuda_driver as drv
from ringleader.device.backends.host_memory import HostMemory, context_table
from ringleader.device.step.step_layout import HOST_WRITTEN, SOURCE_ARRAYS, STEP_OUTPUTS
from ringleader.ipc import layout
from ringleader.ipc.rings import ALIGN, HostRings, RingConfig, map_arrays, plan_memory, write_config

PINNED = layout.HOST_RINGS
# The step layout: the run of ringleader.ipc.layout.ARRAYS that holds every array the step reads
# (StepLayout's), contiguous in both memory plans, so the host-scheduled baseline uploads it in
# one copy; next_token comes back (and the logprobs records, the prompt's too, while a request
# that asked for them runs), and the token counts go up only while a penalized request runs.
_NAMES = [name for name, _, _ in layout.ARRAYS]
_OUTSIDE_RUN = STEP_OUTPUTS | HOST_WRITTEN | {"token_counts"}
_STEP_INPUTS = SOURCE_ARRAYS - _OUTSIDE_RUN
LAYOUT_RUN = tuple(_NAMES[min(map(_NAMES.index, _STEP_INPUTS)) : max(map(_NAMES.index, _STEP_INPUTS)) + 1])
if _OUTSIDE_RUN & set(LAYOUT_RUN):
    raise AssertionError(
        "ipc/layout.py: keep next_token, step_logprobs, token_counts and grammar after the step's inputs"
    )


class DeviceMemory:
    def __init__(self, cfg: RingConfig):
        pinned_plan = plan_memory(cfg, set(PINNED))
        self.pinned = drv.PinnedBuffer(pinned_plan.total)
        self.host = map_arrays(self.pinned.array, pinned_plan, cfg)
        dev_plan = plan_memory(cfg, set(_NAMES) - set(PINNED))
        self.buffer = torch.zeros(dev_plan.total + ALIGN, dtype=torch.uint8, device="cuda")
        base = (-self.buffer.data_ptr()) % ALIGN
        self.device_offsets = {n: base + off for n, off in dev_plan.offsets.items()}
        self.device_nbytes = dev_plan.nbytes
        self.write_config(cfg)
        ctl = self.host["ctl"][0]
        ctl["magic"], ctl["version"] = layout.MAGIC, layout.LAYOUT_VERSION
        addresses = {n: self.pinned.device_ptr + pinned_plan.offsets[n] for n in PINNED}
        addresses.update({n: self.address(n) for n in self.device_offsets})
        self.context = context_table(addresses)
        self.rings = HostRings(self.host, cfg)
        torch.cuda.synchronize()  # allowed: nothing persistent runs yet

    def address(self, name: str) -> int:
        return self.buffer.data_ptr() + self.device_offsets[name]

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        off, n = self.device_offsets[name], self.device_nbytes[name]
        return self.buffer[off : off + n].view(dtype)

    def write_config(self, cfg: RingConfig) -> None:
        """The scheduler's device copy of its config; rewritten (cfg.plan_ahead, once the launch
        mode is known) only before its kernel starts, which reads it once."""
        cfg_host = np.zeros(1, dtype=layout.CONFIG.numpy_dtype())
        write_config(cfg_host, cfg)
        self.write_array("cfg", cfg_host)
        self.config = cfg

    def write_array(self, name: str, values: np.ndarray) -> None:
        """Array `name`'s device copy set to `values` (all of its bytes), in stream order with
        the buffer's zeroing; only before anything persistent runs (it synchronises)."""
        raw = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
        if raw.nbytes != self.device_nbytes[name]:
            raise ValueError(f"{name}: {raw.nbytes} bytes given, the array has {self.device_nbytes[name]}")
        self.tensor(name, torch.uint8).copy_(torch.from_numpy(raw))
        torch.cuda.synchronize()

    def grammar_writer(self, ctx) -> Callable[[int, np.ndarray], None]:
        """GrammarArena's writer for the device's grammar array: a copy on a stream of its own
        (never the legacy stream, which would wait for the steps), complete when it returns; from
        any host thread (it binds `ctx`, the backend's context, first)."""
        stream = drv.create_stream(highest_priority=False)
        base = self.address("grammar")

        def write(offset: int, words: np.ndarray) -> None:
            drv.bind_context(ctx)
            words = np.ascontiguousarray(words, dtype=np.int32)
            drv.copy_to_device(base + 4 * offset, words.ctypes.data, words.nbytes, stream)
            drv.synchronize(stream)

        return write

    def context_bytes(self) -> bytes:
        return bytes(self.context)

    def release_device(self) -> None:
        """Drops the device buffer; the pinned rings stay (hostctl may still read counters)."""
        self.buffer = None


class PackedLayoutCopy:
    """Host-scheduled mode: the CPU scheduler writes the layout into pinned host arrays planned
    like their device copies, so the whole layout goes up in one async copy, and next_token
    comes back into pinned memory; the host then sleeps on a blocking-sync event."""

    def __init__(self, host: HostMemory, device: DeviceMemory):
        a = host.arrays
        first, last = LAYOUT_RUN[0], LAYOUT_RUN[-1]
        host_base, dev_base = a[first].ctypes.data, device.address(first)
        for name in LAYOUT_RUN:  # one copy is exact only if the two layouts match byte for byte
            if a[name].ctypes.data - host_base != device.address(name) - dev_base:
                raise AssertionError(f"host and device layouts differ at {name}")
        self._src, self._dst = host_base, dev_base
        self.nbytes = a[last].ctypes.data + a[last].nbytes - host_base
        self._tokens_host, self._tokens_dev = a["next_token"].ctypes.data, device.address("next_token")
        self._tokens_nbytes = a["next_token"].nbytes
        self._counts_host, self._counts_dev = a["token_counts"].ctypes.data, device.address("token_counts")
        self._counts_nbytes = a["token_counts"].nbytes
        self._logprobs_host, self._logprobs_dev = (
            a["step_logprobs"].ctypes.data,
            device.address("step_logprobs"),
        )
        self._logprobs_nbytes = a["step_logprobs"].nbytes
        self._scores_host, self._scores_dev = (
            a["step_prompt_logprobs"].ctypes.data,
            device.address("step_prompt_logprobs"),
        )
        self._scores_nbytes = a["step_prompt_logprobs"].nbytes
        self._slots = a["slots"]
        self._done = drv.BlockingEvent()

    def upload(self, stream) -> None:
        drv.copy_to_device(self._dst, self._src, self.nbytes, stream)
        if self._counts_nbytes and self._running_with(layout.SqFlag.PENALIZED):
            # the step's penalties read them: n_slots x vocab words, only while some request
            # with a penalty holds a slot (the device-scheduled modes keep them on the device)
            drv.copy_to_device(self._counts_dev, self._counts_host, self._counts_nbytes, stream)

    def _running_with(self, flag: layout.SqFlag) -> bool:
        slots = self._slots
        running = slots["state"] != layout.SlotState.FREE
        return bool(np.any(running & ((slots["flags"] & flag) != 0)))

    def download(self, stream) -> None:
        drv.copy_to_host(self._tokens_host, self._tokens_dev, self._tokens_nbytes, stream)
        if self._running_with(layout.SqFlag.LOGPROBS):  # 168 bytes a slot, only when asked
            drv.copy_to_host(self._logprobs_host, self._logprobs_dev, self._logprobs_nbytes, stream)
        if self._running_with(layout.SqFlag.PROMPT_LOGPROBS):  # 168 bytes a score entry
            drv.copy_to_host(self._scores_host, self._scores_dev, self._scores_nbytes, stream)
        self._done.record(stream)

    def wait(self) -> None:
        self._done.synchronize()
