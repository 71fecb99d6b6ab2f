"""The CPU's weights and KV pools on transparent huge pages (Linux).

A CPU decode step streams every weight once (540 MB for SmolLM2-135M in fp32) and the
resident sequences' KV pages: with 4 KiB pages that is a TLB miss per 4 KiB and a hardware
prefetcher that stops at each page's end. Hosts with transparent huge pages in ``madvise``
mode (the kernel's default) give 2 MiB pages only to memory that asks for them, and XLA's
buffers do not ask; so the executor asks for the long-lived ones (``madvise(MADV_HUGEPAGE)``)
and has the kernel rebuild them as huge pages at once (``MADV_COLLAPSE``, Linux 6.1+; where
that is missing or fails, ``khugepaged`` collapses them in its own time). Contents and
addresses stay as they are. On the AMX Xeon host (bench/RESULTS.md, `python
bench/ab_revisions.py`): decode steps of 16 requests 1.02-1.14x, of one 1.02-1.77x; a
prefill chunk unchanged.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable

import jax

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes of an x86-64 / arm64 transparent huge page
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


@dataclasses.dataclass(frozen=True)
class Advised:
    """What ``advise_huge_pages`` asked for (bytes): ``advised`` got MADV_HUGEPAGE, of which
    ``collapsed`` was rebuilt as huge pages at once."""

    advised: int = 0
    collapsed: int = 0
    seconds: float = 0.0


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_page_span(pointer: int, nbytes: int) -> tuple[int, int]:
    """(start, length) of the whole huge pages inside [pointer, pointer + nbytes): the part
    of a buffer that can be advised without touching its neighbours' pages."""
    start = -(-pointer // HUGE_PAGE) * HUGE_PAGE
    end = (pointer + nbytes) // HUGE_PAGE * HUGE_PAGE
    return start, max(0, end - start)


def cpu_spans(arrays: Iterable[jax.Array]) -> list[tuple[int, int]]:
    """(start, length) of the whole huge pages under each CPU shard of ``arrays``; shards
    on other devices and buffers under 2 MiB give none."""
    spans = []
    for a in arrays:
        for shard in a.addressable_shards:
            if shard.device.platform == "cpu":
                data = shard.data
                span = huge_page_span(data.unsafe_buffer_pointer(), data.nbytes)
                if span[1]:
                    spans.append(span)
    return spans


def advise_huge_pages(spans: Iterable[tuple[int, int]], collapse: bool = True) -> Advised:
    """Ask for huge pages under each (start, length) span (``cpu_spans``) and, with
    ``collapse``, rebuild them as huge pages now. Off Linux nothing is done. Never changes
    a value or an address."""
    madvise = _madvise()
    if madvise is None:
        return Advised()
    t0 = time.perf_counter()
    advised = collapsed = 0
    for start, length in spans:
        if madvise(start, length, MADV_HUGEPAGE) != 0:
            continue
        advised += length
        if collapse and madvise(start, length, MADV_COLLAPSE) == 0:
            collapsed += length
    return Advised(advised, collapsed, time.perf_counter() - t0)


class Advice(threading.Thread):
    """``advise_huge_pages`` of some buffers on a daemon thread (collapsing 0.5 GB takes
    ~1.5 s, which start-up need not wait for: steps before it ends run on small pages);
    ``result`` once it has run. The spans are read at construction: a pool donated to a
    step meanwhile keeps its buffer (the step aliases it), and advice on memory freed
    since changes nothing."""

    def __init__(self, arrays: Iterable[jax.Array], what: str) -> None:
        super().__init__(name="huge-pages", daemon=True)
        self.spans, self.what = cpu_spans(arrays), what
        self.result: Advised | None = None

    def run(self) -> None:
        self.result = done = advise_huge_pages(self.spans)
        if done.advised:
            log.info("huge pages: %s, %.0f MB advised, %.0f MB collapsed in %.1f s",
                     self.what, done.advised / 1e6, done.collapsed / 1e6, done.seconds)


def advise_in_background(arrays: Iterable[jax.Array], what: str) -> Advice:
    """Start an :class:`Advice` of ``arrays``' buffers (``what`` names them in the log)."""
    advice = Advice(arrays, what)
    advice.start()
    return advice
