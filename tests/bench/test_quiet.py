"""Waiting for a quiet host: /proc/stat's counters read by hand, the wait's stopping rule."""

from pathlib import Path

import pytest

from conflux_jax.bench.quiet import Quiet, busy_fraction, cpu_ticks, wait_quiet


def stat(user: int, system: int, idle: int, iowait: int = 0, steal: int = 0) -> str:
    # user nice system idle iowait irq softirq steal guest guest_nice (+ a per-CPU line)
    return (f"cpu  {user} 0 {system} {idle} {iowait} 0 0 {steal} 7 0\n"
            f"cpu0 {user} 0 {system} {idle} {iowait} 0 0 {steal} 7 0\nintr 1\n")


def test_cpu_ticks_counts_idle_and_iowait_as_not_busy():
    assert cpu_ticks(stat(100, 20, 300, iowait=5, steal=3)) == (123, 428)


def test_busy_fraction_between_two_readings():
    a, b = cpu_ticks(stat(100, 20, 300)), cpu_ticks(stat(130, 30, 360))
    assert busy_fraction(a, b) == pytest.approx(40 / 100)
    assert busy_fraction(a, a) == 0.0


def test_wait_stops_at_the_first_quiet_window():
    readings = iter([stat(0, 0, 0), stat(90, 0, 10), stat(180, 0, 20), stat(182, 0, 118)])
    slept: list[float] = []
    q = wait_quiet(busy_below=0.1, window_s=0.2, read=lambda: next(readings),
                   sleep=slept.append)
    assert q.busy == pytest.approx(2 / 100) and slept == [0.2, 0.2, 0.2]
    assert q.waited_s == pytest.approx(0.6)


def test_wait_gives_up_after_max_wait():
    ticks = iter(range(0, 10**6, 100))
    slept: list[float] = []
    q = wait_quiet(window_s=0.5, max_wait_s=2.0, read=lambda: stat(next(ticks), 0, 0),
                   sleep=slept.append)
    assert q == Quiet(1.0, 2.0) and slept == [0.5] * 4


def test_no_counters_no_wait():
    slept: list[float] = []
    assert wait_quiet(read=lambda: None, sleep=slept.append) == Quiet(0.0, 0.0)
    assert slept == []


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="no /proc/stat")
def test_this_hosts_counters_parse():
    busy, total = cpu_ticks(Path("/proc/stat").read_text())
    assert 0 <= busy <= total and total > 0
