"""What watching the CQ costs the host in device mode, measured without a GPU.

A process of its own stands in for the device scheduler: it publishes CQ events (a tail counter
and the instant of each event, in shared memory) at a fixed step period, busy-waiting for each
instant.  In this process a thread watches the tail as `CudaBackend` does and wakes a stand-in
completion thread, with two pollers side by side: `fixed` (the poller of the first H100 run,
a read every 20 µs) and `CqPoller` (device/backends/cq_poller.py).  Per run: the watching
thread's CPU-seconds per 1k events, and how long after each event the completion thread was
woken (p50/p99).  Runs alternate between the two pollers.

    python -m ringleader.bench.lab.cq_poll_micro --periods-us 226,1570,2015 --events 3000 --repeats 3 --json PATH
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import threading
import time
from multiprocessing import shared_memory

import numpy as np

from ringleader.device.backends.cq_poller import CqPoller

FIXED_POLL_S = 20e-6  # the first H100 run's poller


def device_stand_in(name: str, period_s: float, n_events: int, start_ns: int) -> None:
    shm = shared_memory.SharedMemory(name=name)
    ring = np.ndarray((n_events + 2,), dtype=np.int64, buffer=shm.buf)  # [tail, ended, at_0, ...]
    for k in range(n_events):
        due = start_ns + int(k * period_s * 1e9)
        while time.perf_counter_ns() < due:
            pass
        ring[2 + k] = time.perf_counter_ns()
        ring[0] = k + 1
    time.sleep(0.01)
    ring[1] = 1
    del ring
    shm.close()


def fixed_poller(read_tail, ended, wake, _doorbell) -> None:
    last = read_tail()
    while not ended():
        tail = read_tail()
        if tail != last:
            last = tail
            wake()
        time.sleep(FIXED_POLL_S)


def cq_poller(read_tail, ended, wake, doorbell) -> None:
    CqPoller(read_tail, ended, wake, doorbell).run()


POLLERS = {"fixed-20us": fixed_poller, "CqPoller": cq_poller}


def one_run(poller: str, period_s: float, n_events: int) -> dict:
    shm = shared_memory.SharedMemory(create=True, size=8 * (n_events + 2))
    ring = np.ndarray((n_events + 2,), dtype=np.int64, buffer=shm.buf)
    ring[:] = 0
    woken: list[tuple[int, int]] = []
    doorbell = threading.Event()
    cpu = {}

    def watch():
        t0 = time.thread_time()
        POLLERS[poller](
            lambda: int(ring[0]),
            lambda: bool(ring[1]),
            lambda: woken.append((int(ring[0]), time.perf_counter_ns())),
            doorbell,
        )
        cpu["s"] = time.thread_time() - t0

    start_ns = time.perf_counter_ns() + int(0.2e9)
    dev = mp.get_context("spawn").Process(
        target=device_stand_in, args=(shm.name, period_s, n_events, start_ns)
    )
    dev.start()
    watcher = threading.Thread(target=watch, name="rl-cq-poll")
    watcher.start()
    doorbell.set()  # the requests were submitted
    dev.join()
    watcher.join()
    at = ring[2 : 2 + n_events].copy()
    ring = None  # the view goes before the memory it maps
    shm.close()
    shm.unlink()
    tails = np.array([t for t, _ in woken])
    times = np.array([w for _, w in woken])
    first = np.searchsorted(tails, np.arange(1, n_events + 1))  # the first wake that saw event k
    seen = first < len(tails)
    delay_us = (times[first[seen]] - at[seen]) / 1e3
    return {
        "poller": poller,
        "period_us": round(period_s * 1e6, 1),
        "events": n_events,
        "events_seen": int(seen.sum()),
        "cpu_s_per_1k_events": cpu["s"] / n_events * 1e3,
        "delay_us_p50": float(np.percentile(delay_us, 50)),
        "delay_us_p99": float(np.percentile(delay_us, 99)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ringleader.bench.lab.cq_poll_micro", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--periods-us", default="226,1570,2015", help="step periods to stand in for (µs)")
    p.add_argument("--events", type=int, default=3000, help="CQ events per run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each poller per period, alternating")
    p.add_argument("--json", help="write every run and the medians here")
    args = p.parse_args(argv)
    runs = []
    for period_us in (float(x) for x in args.periods_us.split(",")):
        for _ in range(args.repeats):
            for poller in POLLERS:
                r = one_run(poller, period_us * 1e-6, args.events)
                runs.append(r)
                print(
                    f"{poller:11s} period {r['period_us']:7.1f} us: {r['cpu_s_per_1k_events']:.4f} CPU-s/1k events, "
                    f"woken p50 {r['delay_us_p50']:6.1f} us p99 {r['delay_us_p99']:6.1f} us, "
                    f"seen {r['events_seen']}/{r['events']}",
                    flush=True,
                )
    medians = []
    print("\npoller       period us  CPU-s/1k events  woken p50 us  woken p99 us   (medians)")
    for period in sorted({r["period_us"] for r in runs}):
        for poller in POLLERS:
            rs = [r for r in runs if r["poller"] == poller and r["period_us"] == period]
            m = {
                k: float(np.median([r[k] for r in rs]))
                for k in ("cpu_s_per_1k_events", "delay_us_p50", "delay_us_p99")
            }
            medians.append({"poller": poller, "period_us": period, **m})
            print(
                f"{poller:11s} {period:10.1f} {m['cpu_s_per_1k_events']:16.4f} {m['delay_us_p50']:13.1f} {m['delay_us_p99']:13.1f}"
            )
    if args.json:
        doc = {
            "schema": "ringleader.cq_poll_micro/1",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "cores": mp.cpu_count(),
                "python": platform.python_version(),
            },
            "settings": vars(args),
            "runs": runs,
            "medians": medians,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
