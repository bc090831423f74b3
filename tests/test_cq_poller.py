"""The CQ poller of the CUDA device scheduler (device/backends/cq_poller.py) on simulated time: a
device that publishes CQ events at given instants, a frontend that rings the doorbell at given
instants, and a clock that only the poller's sleeps and waits move (each sleep overshoots by
OVERSHOOT_S, as a Linux timer does).  Every event must be seen, soon, with few reads."""

from __future__ import annotations

import bisect

import numpy as np
import pytest

from ringleader.device.backends.cq_poller import CqPoller

OVERSHOOT_S = 55e-6  # a sleep of d returns after d + this (timer slack on Linux)
SEEN_WITHIN_S = CqPoller.FINE_S + OVERSHOOT_S + 1e-9  # one fine poll after the event


class SimulatedDevice:
    def __init__(self, events: list[float], submissions: list[float] = (), end: float = 1.0):
        self.events = sorted(events)
        self.submissions = sorted(submissions)
        self.end = end
        self.now = 0.0
        self.cleared_at = -1.0  # the doorbell holds the submissions after this instant
        self.seen: list[tuple[int, float]] = []  # (tail, when the completion thread was woken)

    # the poller's view
    def read_tail(self) -> int:
        return bisect.bisect_right(self.events, self.now)

    def ended(self) -> bool:
        return self.now >= self.end

    def wake(self) -> None:
        self.seen.append((self.read_tail(), self.now))

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds + OVERSHOOT_S

    # the doorbell (threading.Event's methods the poller uses)
    def _rung(self, until: float) -> float | None:
        i = bisect.bisect_right(self.submissions, self.cleared_at)
        return self.submissions[i] if i < len(self.submissions) and self.submissions[i] <= until else None

    def is_set(self) -> bool:
        return self._rung(self.now) is not None

    def clear(self) -> None:
        self.cleared_at = self.now

    def wait(self, timeout: float) -> bool:
        at = self._rung(self.now + timeout)
        if at is None:
            self.now += timeout + OVERSHOOT_S
            return False
        self.now = max(self.now, at)
        return True

    def run(self) -> CqPoller:
        poller = CqPoller(self.read_tail, self.ended, self.wake, self, clock=self.clock, sleep=self.sleep)
        poller.run()
        return poller

    def delays(self) -> np.ndarray:
        """For each event, how long after it the completion thread was woken with it in the CQ."""
        out = []
        for k, t in enumerate(self.events):
            woken = [when for tail, when in self.seen if tail > k]
            assert woken, f"event {k} at {t:.6f} s was never seen"
            out.append(woken[0] - t)
        return np.array(out)


def steady(period: float, n: int, start: float = 0.01) -> list[float]:
    return [start + k * period for k in range(n)]


@pytest.mark.parametrize("period", [226e-6, 1.57e-3, 2.0e-3, 20e-3])  # tiny, llama-1b at 1 and 64 streams
def test_steady_steps_are_each_seen_within_one_fine_poll_with_a_few_reads_per_step(period):
    sim = SimulatedDevice(steady(period, 400), submissions=[0.0], end=0.01 + 400 * period)
    poller = sim.run()
    delays = sim.delays()
    assert delays.min() >= 0
    late = delays[3:] > SEEN_WITHIN_S  # from the third event on: an interval is known
    assert not late.any(), (np.flatnonzero(late), delays[3:][late])
    reads_per_step = poller.polls / 400
    fixed = period / (CqPoller.FINE_S + OVERSHOOT_S)  # what polling every FINE_S costs
    assert reads_per_step <= max(4.0, 0.3 * fixed), (reads_per_step, fixed)


@pytest.mark.parametrize("period", [226e-6, 2.0e-3])
def test_its_figures_bound_how_late_each_change_was_seen(period):
    """figures(): one change per step here, reads per change as counted, and the seen-lag bound
    (read to read) never below the true delay of the event it saw."""
    sim = SimulatedDevice(steady(period, 200), submissions=[0.0], end=0.01 + 200 * period)
    poller = sim.run()
    fig = poller.figures()
    assert poller.changes == 200 and fig["cq_polls"] == poller.polls
    assert fig["cq_polls_per_change"] == pytest.approx(poller.polls / 200)
    lags = np.fromiter(poller.seen_lag_us, dtype=np.float64)
    assert len(lags) == 200
    assert lags.sum() / 1e6 >= sim.delays().sum()  # each bound covers its event's delay
    assert fig["cq_seen_lag_us_p99"] is not None and fig["cq_seen_lag_us_p50"] <= fig["cq_seen_lag_us_p99"]


def test_steps_that_get_shorter_are_late_for_one_step_only():
    events = steady(2.0e-3, 100) + steady(1.0e-3, 200, start=0.01 + 100 * 2.0e-3)
    sim = SimulatedDevice(events, submissions=[0.0], end=events[-1] + 0.01)
    sim.run()
    delays = sim.delays()
    late = np.flatnonzero(delays > SEEN_WITHIN_S)
    assert len(late[late >= 3]) <= 2, (late, delays[late])
    assert delays.max() < 1.0e-3  # never later than the old interval's overshoot


def test_irregular_steps_are_all_seen():
    rng = np.random.default_rng(0)
    events = list(np.cumsum(rng.uniform(0.2e-3, 3e-3, size=500)) + 0.01)
    sim = SimulatedDevice(events, submissions=[0.0], end=events[-1] + 0.01)
    sim.run()
    delays = sim.delays()
    assert delays.min() >= 0 and np.median(delays) <= SEEN_WITHIN_S


def test_idle_costs_a_read_per_doorbell_wait_and_a_submission_is_watched_at_once():
    submit = 0.7
    sim = SimulatedDevice([submit + 3e-3, submit + 4.5e-3], submissions=[submit], end=1.0)
    poller = sim.run()
    delays = sim.delays()
    assert (delays <= SEEN_WITHIN_S).all(), delays  # the first token of a request submitted when idle
    watched = 2 * CqPoller.IDLE_AFTER_S + 5e-3  # after the start, and from the submission on
    busy_reads = watched / (CqPoller.FINE_S + OVERSHOOT_S)
    idle_reads = (sim.end - watched) / (CqPoller.IDLE_S + OVERSHOOT_S)
    assert poller.polls <= busy_reads + idle_reads + 10, (poller.polls, busy_reads, idle_reads)


def test_it_returns_once_the_scheduler_has_ended_even_when_idle():
    sim = SimulatedDevice([], end=0.3)
    sim.run()
    assert 0.3 <= sim.now <= 0.3 + CqPoller.IDLE_S + OVERSHOOT_S


def test_the_benchmark_runs_both_pollers_against_a_real_process_and_each_sees_every_event(tmp_path):
    import json

    from ringleader.bench.lab import cq_poll_micro

    out = tmp_path / "cq.json"
    assert (
        cq_poll_micro.main(["--periods-us", "1000", "--events", "60", "--repeats", "1", "--json", str(out)])
        == 0
    )
    runs = json.loads(out.read_text())["runs"]
    assert {r["poller"] for r in runs} == {"fixed-20us", "CqPoller"}
    assert all(r["events_seen"] == 60 and r["delay_us_p50"] >= 0 for r in runs), runs
