"""The kernels of bench/gpu_limits/kernels.cu as FakeDriver (tests/fake_cuda_driver.py) runs them:
the same protocols (doorbell echo, ping-pong flag, WHILE/SWITCH counting) on host memory, each on
a fake stream's thread, so the probe's host side checks and measures realistic data."""

from __future__ import annotations

import ctypes
import time
from typing import ClassVar


def read_u32(a):
    return ctypes.c_uint32.from_address(a).value


def write_u32(a, v):
    ctypes.c_uint32.from_address(a).value = int(v) & 0xFFFFFFFF


def read_u64(a):
    return ctypes.c_uint64.from_address(a).value


def write_u64(a, v):
    ctypes.c_uint64.from_address(a).value = int(v) & 0xFFFFFFFFFFFFFFFF


def now_ns():
    return time.perf_counter_ns()


class KernelTrap(Exception):
    """A simulated kernel ran past its hard cap, as the real ones trap: the context is then dead."""


class FakeKernels:
    """FakeDriver's kernels: k_<name> is kernel <name>, called with the arguments its launch
    decoded by SIGS (Q: 64-bit, I: 32-bit). self._gl is ringleader.bench.gpu_limits.kernels (the
    control-block layout), self._handles the graphs' conditional handles."""

    SIGS: ClassVar[dict[str, str]] = {
        "rl_empty": "",
        "rl_doorbell": "QIIIQ",
        "rl_pingpong": "QIIQQQQ",
        "rl_stamp": "QI",
        "rl_timer_res": "QI",
        "rl_while_body": "QQQI",
        "rl_switch_ctl": "QQQQI",
        "rl_branch": "QI",
    }

    def _run_kernel(self, name, args):
        getattr(self, "k_" + name)(*args)

    def k_rl_empty(self):
        pass

    def k_rl_doorbell(self, ctl, sleep_ns, use_sleep, flags, budget):
        gl = self._gl

        def W(i):
            return ctl + 4 * i

        t0 = now_ns()
        last = read_u32(W(gl.CTL_DOORBELL))
        write_u32(W(gl.CTL_STARTED), 1)
        handled = polls = reason = 0
        while True:
            v = read_u32(W(gl.CTL_DOORBELL))
            polls += 1
            if v != last:
                if v == 0xFFFFFFFF:
                    reason = gl.EXIT_STOPWORD
                    break
                write_u32(W(gl.CTL_ANSWER), v)
                last = v
                handled += 1
                continue
            # the kernel checks every 64 polls; a sleeping Python poll is ~100x slower than a
            # GPU's, so the stand-in checks every poll or its heartbeat lags the probe's 5 ms look
            if polls % 64 == 0 or use_sleep:
                if read_u32(W(gl.CTL_SHUTDOWN)):
                    reason = gl.EXIT_SHUTDOWN
                    break
                now = now_ns()
                if now - t0 > budget:
                    reason = gl.EXIT_DEADLINE
                    break
                if flags & 1:
                    write_u32(W(gl.CTL_HEARTBEAT), now)
            if use_sleep:
                time.sleep(sleep_ns * 1e-9)
        write_u32(W(gl.CTL_HANDLED), handled)
        write_u32(W(gl.CTL_POLLS_LO), polls)
        write_u32(W(gl.CTL_POLLS_HI), polls >> 32)
        write_u32(W(gl.CTL_EXIT), reason)

    def k_rl_pingpong(self, flag, role, n, t_send, t_recv, ctl, budget):
        gl = self._gl
        t0 = now_ns()
        done, reason = 0, gl.EXIT_DONE
        for i in range(n):
            want = 2 * i + 2 if role == 0 else 2 * i + 1
            if role == 0:
                write_u64(t_send + 8 * i, now_ns())
                write_u32(flag, 2 * i + 1)
            spins, bail = 0, False
            while ((read_u32(flag) - want) & 0xFFFFFFFF) >= 0x80000000:
                spins += 1
                if spins % 64 == 0:
                    if read_u32(ctl + 4 * gl.CTL_SHUTDOWN):
                        reason, bail = gl.EXIT_SHUTDOWN, True
                        break
                    if now_ns() - t0 > budget:
                        reason, bail = gl.EXIT_DEADLINE, True
                        break
                    time.sleep(0)
            if bail:
                break
            now = now_ns()
            write_u64(t_recv + 8 * i, now)
            if role == 1:
                write_u64(t_send + 8 * i, now)
                write_u32(flag, 2 * i + 2)
            done = i + 1
        write_u32(ctl + 4 * (gl.CTL_DONE0 + role), done)
        if role == 0:
            write_u32(ctl + 4 * gl.CTL_EXIT, reason)

    def k_rl_stamp(self, out, idx):
        write_u64(out + 8 * idx, now_ns())

    def k_rl_timer_res(self, out, n):
        write_u64(out, 1)
        write_u64(out + 8, n)
        write_u64(out + 16, n)

    def _count(self, state, stamps, cap):
        c = read_u32(state) + 1
        write_u32(state, c)
        if c > read_u32(state + 8):
            raise KernelTrap()
        if c <= cap:
            write_u64(stamps + 8 * (c - 1), now_ns())
        return c

    def k_rl_while_body(self, h, state, stamps, cap):
        c = self._count(state, stamps, cap)
        self._set_cond(h, 1 if c < read_u32(state + 4) else 0)

    def k_rl_switch_ctl(self, hw, hs, state, stamps, cap):
        c = self._count(state, stamps, cap)
        self._set_cond(hs, (c - 1) & 3)
        self._set_cond(hw, 1 if c < read_u32(state + 4) else 0)

    def k_rl_branch(self, counters, k):
        write_u32(counters + 4 * k, read_u32(counters + 4 * k) + 1)

    def _set_cond(self, h, v):
        self._handles[int(h)]["value"] = v
