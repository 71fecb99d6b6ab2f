"""Host-side KV page accounting with KV aliasing (DESIGN.md §3).

Each of the N ranks owns one physical pool of ``num_pages`` pages, each holding
``page_size`` tokens of *all* KV heads. The same physical page has two views:

* decode view: ``page_size`` tokens x all heads (a decoding request lives on one rank);
* prefill view: ``page_size * N`` tokens x ``Hkv / N`` heads (a request in prefill is
  head-sharded over every rank).

So a request in prefill with T tokens needs ``ceil(T / (page_size * N))`` pages on
*every* rank, and a decoding request with T tokens needs ``ceil(T / page_size)`` pages on
its decode rank. At the prefill->decode transition the decode pages are allocated first
(the executor copies the KV into them during the completing step) and the prefill pages
are released afterwards (:meth:`BlockManager.release_prefill`).

The scheduler owns the block manager (as vLLM keeps its KV cache manager beside its
scheduler) and copies the page ids it allocated into each plan; executors never read it.

Page ids are per rank: every rank has its own free list, ids ``0..num_pages-1``.

Prefix caching (:mod:`~conflux_jax.scheduler.prefix_cache`): full decode pages are named
by chained hashes once their KV is written (:meth:`BlockManager.register`) and outlive
their request in the rank's LRU free queue. A request that starts with a cached prefix
takes those pages (:meth:`BlockManager.acquire_hit`); if it later decodes on that rank
they become the head of its decode pages (already resident: nothing moves), otherwise
they are released when its prefill pages are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from conflux_jax.scheduler.prefix_cache import PageHash, RankPages


class BlockManagerError(RuntimeError):
    """Misuse of the block manager (unknown request, double free, bad state)."""


class OutOfPagesError(BlockManagerError):
    """A rank has too few free pages for the requested allocation."""


@dataclasses.dataclass(frozen=True)
class PageTable:
    """Snapshot of one request's pages. ``prefill[r]`` are rank r's head-sharded pages."""

    prefill: tuple[tuple[int, ...], ...] | None
    decode_rank: int | None
    decode: tuple[int, ...] | None


class _Alloc:
    __slots__ = ("prefill", "prefill_tokens", "decode_rank", "decode", "decode_tokens",
                 "prefill_view", "decode_view", "hit_rank", "hits", "resident")

    def __init__(self) -> None:
        self.prefill: list[list[int]] | None = None
        self.prefill_tokens = 0
        self.decode_rank: int | None = None
        self.decode: list[int] | None = None
        self.decode_tokens = 0
        self.prefill_view: tuple[tuple[int, ...], ...] = ()  # snapshots for plans
        self.decode_view: tuple[int, ...] = ()
        self.hit_rank: int | None = None  # rank of the cached prefix pages in ``hits``
        self.hits: list[int] = []  # acquired cached pages not (yet) part of ``decode``
        self.resident = 0  # leading decode pages that were cache hits (KV already there)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Per-rank paged KV allocator shared by the scheduler and the executor."""

    def __init__(self, num_ranks: int, num_pages: int, page_size: int) -> None:
        if num_ranks < 1 or num_pages < 1 or page_size < 1:
            raise ValueError("num_ranks, num_pages and page_size must be positive")
        self.num_ranks = num_ranks
        self.num_pages = num_pages
        self.page_size = page_size
        self._ranks = [RankPages(num_pages) for _ in range(num_ranks)]
        self._reqs: dict[int, _Alloc] = {}

    # ---- sizes -------------------------------------------------------------------
    def prefill_pages_for(self, tokens: int) -> int:
        """Pages needed on every rank for ``tokens`` tokens of head-sharded prefill KV."""
        return _cdiv(tokens, self.page_size * self.num_ranks)

    def decode_pages_for(self, tokens: int) -> int:
        """Pages needed on the decode rank for ``tokens`` tokens of full-head KV."""
        return _cdiv(tokens, self.page_size)

    def free_pages(self, rank: int) -> int:
        """Pages an allocation on ``rank`` may take (cached-but-free ones included)."""
        return self._ranks[rank].num_free()

    def used_pages(self, rank: int) -> int:
        return self.num_pages - self._ranks[rank].num_free()

    def utilization(self, rank: int) -> float:
        """vLLM's KV usage: cached pages nobody reads count as free."""
        return 1.0 - self._ranks[rank].num_free() / self.num_pages

    def min_free_pages(self) -> int:
        return min(r.num_free() for r in self._ranks)

    def cached_pages(self, rank: int) -> int:
        """Pages of ``rank`` the prefix cache names (in use or free)."""
        return self._ranks[rank].num_cached()

    def __contains__(self, req: int) -> bool:
        return req in self._reqs

    @property
    def requests(self) -> list[int]:
        return list(self._reqs)

    # ---- prefix cache ------------------------------------------------------------
    def longest_hit(self, hashes: Sequence[PageHash]) -> tuple[int, list[int]]:
        """(rank, pages) of the rank caching the longest leading run of ``hashes``
        (lowest rank on ties; ``(-1, [])`` when no rank has the first page)."""
        best_rank, best = -1, []
        for r, pages in enumerate(self._ranks):
            hit = pages.longest_hit(hashes)
            if len(hit) > len(best):
                best_rank, best = r, hit
        return best_rank, best

    def caches(self, rank: int, h: PageHash, page: int) -> bool:
        """Does ``rank`` still cache ``page`` under hash ``h``?"""
        return self._ranks[rank].page_for(h) == page

    def any_caches(self, h: PageHash) -> bool:
        """Does any rank cache a page under hash ``h``?"""
        return any(pages.page_for(h) is not None for pages in self._ranks)

    def acquire_hit(self, req: int, rank: int, pages: Sequence[int]) -> None:
        """``req`` (holding nothing yet) takes the cached prefix ``pages`` of ``rank``."""
        if req in self._reqs:
            raise BlockManagerError(f"request {req} already holds pages")
        self._ranks[rank].acquire(pages)
        a = self._reqs[req] = _Alloc()
        a.hit_rank, a.hits = rank, list(pages)

    def hit(self, req: int) -> tuple[int | None, tuple[int, ...]]:
        """The cached prefix ``req`` holds outside its decode pages: (rank, pages)."""
        a = self._get(req)
        return a.hit_rank, tuple(a.hits)

    def resident_pages(self, req: int) -> int:
        """Leading decode pages of ``req`` that were cache hits (their KV is in place)."""
        return self._get(req).resident

    def register(self, req: int, hashes: Sequence[PageHash]) -> None:
        """Name ``req``'s leading decode pages by ``hashes`` (their KV has been written)."""
        a = self._get(req)
        if a.decode is None or a.decode_rank is None:
            raise BlockManagerError(f"request {req} is not decoding")
        self._ranks[a.decode_rank].register(a.decode, hashes)

    def clear_cache(self) -> None:
        """Forget every cached page (the executor lost its KV)."""
        for pages in self._ranks:
            pages.clear()

    # ---- prefill -----------------------------------------------------------------
    def can_allocate_prefill(self, req: int, total_tokens: int) -> bool:
        a = self._reqs.get(req)
        have = len(a.prefill[0]) if a is not None and a.prefill is not None else 0
        need = self.prefill_pages_for(total_tokens) - have
        return need <= 0 or need <= self.min_free_pages()

    def allocate_prefill(self, req: int, total_tokens: int) -> list[list[int]]:
        """Ensure ``req`` holds prefill pages for ``total_tokens`` tokens on every rank.

        Grows an existing prefill allocation; returns the per-rank page lists.
        """
        a = self._reqs.get(req)
        if a is None:
            a = self._reqs[req] = _Alloc()
        if a.decode is not None:
            raise BlockManagerError(f"request {req} is already decoding")
        if a.prefill is None:
            a.prefill = [[] for _ in range(self.num_ranks)]
            a.prefill_view = ((),) * self.num_ranks
        need = self.prefill_pages_for(total_tokens) - len(a.prefill[0])
        if need > 0:
            if need > self.min_free_pages():
                if not a.prefill[0] and not a.hits:
                    del self._reqs[req]
                raise OutOfPagesError(
                    f"request {req}: prefill of {total_tokens} tokens needs {need} more pages "
                    f"per rank, only {self.min_free_pages()} free on the fullest rank")
            for r, pages in enumerate(self._ranks):
                a.prefill[r].extend(pages.take(need))
            a.prefill_view = tuple(tuple(p) for p in a.prefill)
        a.prefill_tokens = max(a.prefill_tokens, total_tokens)
        return a.prefill

    # ---- transition + decode ------------------------------------------------------
    def can_transition(self, rank: int, tokens: int, headroom_pages: int = 0) -> bool:
        return self.decode_pages_for(tokens) + headroom_pages <= self.free_pages(rank)

    def transition(self, req: int, rank: int, tokens: int,
                   keep_prefill: bool = False) -> list[int]:
        """Allocate full-head decode pages for ``tokens`` tokens on ``rank``.

        A cached prefix ``req`` holds on ``rank`` becomes the head of its decode pages
        (only the rest is allocated). The prefill pages (and a cached prefix held on
        another rank) are freed unless ``keep_prefill`` (the executor still reads them
        during the completing step; call :meth:`release_prefill` after).
        """
        a = self._reqs.get(req)
        if a is None:
            a = self._reqs[req] = _Alloc()
        if a.decode is not None:
            raise BlockManagerError(f"request {req} already transitioned to rank {a.decode_rank}")
        resident = a.hits if a.hit_rank == rank else []
        need = self.decode_pages_for(tokens) - len(resident)
        pages = self._ranks[rank]
        if need > pages.num_free():
            raise OutOfPagesError(f"request {req}: decode KV of {tokens} tokens needs {need} "
                                  f"pages on rank {rank}, {pages.num_free()} free")
        a.decode_rank = rank
        a.decode = [*resident, *pages.take(max(0, need))]
        a.resident = len(resident)
        if resident:
            a.hit_rank, a.hits = None, []
        a.decode_view = tuple(a.decode)
        a.decode_tokens = tokens
        if not keep_prefill:
            self.release_prefill(req)
        return a.decode

    def release_prefill(self, req: int) -> None:
        """Free the head-sharded prefill pages of ``req`` on every rank, and a cached
        prefix it holds outside its decode pages (no-op if none)."""
        a = self._get(req)
        if a.prefill is not None:
            for r, pages in enumerate(a.prefill):
                self._ranks[r].release(pages)
            a.prefill = None
            a.prefill_view = ()
            a.prefill_tokens = 0
        if a.hits:
            assert a.hit_rank is not None
            self._ranks[a.hit_rank].release(a.hits)
            a.hit_rank, a.hits = None, []

    def can_append_decode(self, req: int, new_len: int) -> bool:
        a = self._get(req)
        if a.decode is None or a.decode_rank is None:
            return False
        need = self.decode_pages_for(new_len) - len(a.decode)
        return need <= self.free_pages(a.decode_rank)

    def append_decode(self, req: int, new_len: int) -> list[int]:
        """Grow ``req``'s decode KV to ``new_len`` tokens; returns the newly added page ids."""
        a = self._get(req)
        if a.decode is None or a.decode_rank is None:
            raise BlockManagerError(f"request {req} is not decoding")
        need = self.decode_pages_for(new_len) - len(a.decode)
        added: list[int] = []
        if need > 0:
            pages = self._ranks[a.decode_rank]
            if need > pages.num_free():
                raise OutOfPagesError(f"request {req}: rank {a.decode_rank} is out of pages")
            added = pages.take(need)
            a.decode.extend(added)
            a.decode_view = tuple(a.decode)
        a.decode_tokens = max(a.decode_tokens, new_len)
        return added

    # ---- release -----------------------------------------------------------------
    def free(self, req: int) -> None:
        """Drop every page of ``req`` (tail first); cached ones stay cached, free."""
        if req not in self._reqs:
            raise BlockManagerError(f"free of unknown request {req} (double free?)")
        self.release_prefill(req)
        a = self._reqs.pop(req)
        if a.decode is not None and a.decode_rank is not None:
            self._ranks[a.decode_rank].release(a.decode)

    def page_table(self, req: int) -> PageTable:
        a = self._get(req)
        return PageTable(prefill=None if a.prefill is None else a.prefill_view,
                         decode_rank=a.decode_rank,
                         decode=None if a.decode is None else a.decode_view)

    def prefill_pages(self, req: int) -> tuple[tuple[int, ...], ...]:
        """Prefill-view page ids of ``req`` per rank (empty when it holds none)."""
        return self._get(req).prefill_view

    def decode_pages(self, req: int) -> tuple[int, ...]:
        """Decode-view page ids of ``req`` on its decode rank (empty when it has none)."""
        return self._get(req).decode_view

    def decode_rank(self, req: int) -> int | None:
        return self._get(req).decode_rank

    def check_consistency(self) -> None:
        """Every page is free (cached or not) or held, and its refcount is the number of
        requests holding it (tests use this)."""
        for r, pages in enumerate(self._ranks):
            owners: list[int] = []
            for a in self._reqs.values():
                if a.prefill is not None:
                    owners.extend(a.prefill[r])
                if a.decode is not None and a.decode_rank == r:
                    owners.extend(a.decode)
                if a.hit_rank == r:
                    owners.extend(a.hits)
            try:
                pages.check(owners)
            except ValueError as exc:
                raise BlockManagerError(f"rank {r}: {exc}") from exc

    def _get(self, req: int) -> _Alloc:
        a = self._reqs.get(req)
        if a is None:
            raise BlockManagerError(f"unknown request {req}")
        return a
