"""The kernels of bench/lab/gpu_limits/kernels.cu as FakeDriver (tests/fake_cuda_driver.py) runs them:
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
    decoded by SIGS (Q: 64-bit, I: 32-bit). self._gl is ringleader.bench.lab.gpu_limits.kernels (the
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
        "rl_pp_gate": "QIQQIQQ",
        "rl_pp_work": "QQIQ",
        "rl_pp_release": "QQIQQI",
        "rl_dl_launch": "QIQQQI",
        "rl_dl_target": "QQI",
        "rl_dl_tail_loop": "QQQI",
        "rl_dl_persistent": "QQQQIQQQQQQ",
    }
    PP_SOLO = 2
    MODE_TAIL = 1

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

    # -- two WHILE graphs taking turns (rl_pp_*)
    def k_rl_pp_gate(self, flag, role, state, stamps, cap, ctl, wait_ns):
        i = read_u32(state)
        if read_u32(state + 8):
            return
        want, t0 = 2 * i + role, now_ns()
        while ((read_u32(flag) - want) & 0xFFFFFFFF) >= 0x80000000:
            if read_u32(ctl + 4 * self._gl.CTL_SHUTDOWN):
                write_u32(state + 8, self._gl.EXIT_SHUTDOWN)
                return
            if now_ns() - t0 > wait_ns:
                write_u32(state + 8, self._gl.EXIT_DEADLINE)
                return
            time.sleep(0)
        if i < cap:
            write_u64(stamps + 24 * i, now_ns())

    def k_rl_pp_work(self, state, stamps, cap, work_ns):
        i, t0 = read_u32(state), now_ns()
        if i < cap:
            write_u64(stamps + 24 * i + 8, t0)
        while not read_u32(state + 8) and now_ns() - t0 < work_ns:
            pass

    def k_rl_pp_release(self, h, flag, role, state, stamps, cap):
        i = read_u32(state)
        if i < cap:
            write_u64(stamps + 24 * i + 16, now_ns())
        c = i + 1
        write_u32(state, c)
        if role != self.PP_SOLO:
            write_u32(flag, 2 * i + role + 1)
        self._set_cond(h, 1 if c < read_u32(state + 4) and c < cap and not read_u32(state + 8) else 0)

    # -- device-side graph launch (rl_dl_*): FakeDriver.device_launch runs the launched graph
    def k_rl_dl_launch(self, target, mode, state, stamps, errs, cap):
        i = read_u32(state)
        if i >= cap:
            return
        write_u32(state, i + 1)
        write_u64(stamps + 16 * i, now_ns())
        write_u32(errs + 4 * i, self.device_launch(target, mode == self.MODE_TAIL))

    def k_rl_dl_target(self, state, stamps, cap):
        t, j = now_ns(), read_u32(state + 4)
        if j < cap:
            write_u64(stamps + 16 * j + 8, t)
        write_u32(state + 4, j + 1)

    def k_rl_dl_tail_loop(self, state, stamps, errs, cap):
        t, c = now_ns(), read_u32(state) + 1
        write_u32(state, c)
        if c <= cap:
            write_u64(stamps + 8 * (c - 1), t)
        if c < read_u32(state + 4) and c < cap:
            e = self.device_launch(0, True)  # 0: the graph running this kernel
            if e and not read_u32(errs):
                write_u32(errs, e)
                write_u32(errs + 4, c)

    def k_rl_dl_persistent(self, g0, g1, g2, g3, n, state, stamps, errs, ctl, wait_ns, budget_ns):
        gl, t_start = self._gl, now_ns()
        done, reason = 0, gl.EXIT_DONE
        for i in range(n):
            t0 = now_ns()
            write_u64(stamps + 16 * i, t0)
            write_u32(state, i + 1)
            e = self.device_launch((g0, g1, g2, g3)[i % 4], False)
            write_u32(errs + 4 * i, e)
            if e:
                reason = gl.EXIT_LAUNCH_ERROR
                break
            while read_u32(state + 4) < i + 1:
                now = now_ns()
                if now - t0 > wait_ns:
                    reason = gl.EXIT_NOT_RUN
                elif now - t_start > budget_ns:
                    reason = gl.EXIT_DEADLINE
                elif read_u32(ctl + 4 * gl.CTL_SHUTDOWN):
                    reason = gl.EXIT_SHUTDOWN
                if reason != gl.EXIT_DONE:
                    break
                time.sleep(0)
            if reason != gl.EXIT_DONE:
                break
            done = i + 1
        write_u32(ctl + 4 * gl.CTL_DONE0, done)
        write_u32(ctl + 4 * gl.CTL_EXIT, reason)
