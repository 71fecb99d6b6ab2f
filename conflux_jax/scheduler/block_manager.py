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
"""

from __future__ import annotations

import dataclasses


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
                 "prefill_view", "decode_view")

    def __init__(self) -> None:
        self.prefill: list[list[int]] | None = None
        self.prefill_tokens = 0
        self.decode_rank: int | None = None
        self.decode: list[int] | None = None
        self.decode_tokens = 0
        self.prefill_view: tuple[tuple[int, ...], ...] = ()  # snapshots for plans
        self.decode_view: tuple[int, ...] = ()


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
        # Pop from the end: low page ids are handed out first (deterministic tables).
        self._free: list[list[int]] = [list(range(num_pages - 1, -1, -1))
                                       for _ in range(num_ranks)]
        self._reqs: dict[int, _Alloc] = {}

    # ---- sizes -------------------------------------------------------------------
    def prefill_pages_for(self, tokens: int) -> int:
        """Pages needed on every rank for ``tokens`` tokens of head-sharded prefill KV."""
        return _cdiv(tokens, self.page_size * self.num_ranks)

    def decode_pages_for(self, tokens: int) -> int:
        """Pages needed on the decode rank for ``tokens`` tokens of full-head KV."""
        return _cdiv(tokens, self.page_size)

    def free_pages(self, rank: int) -> int:
        return len(self._free[rank])

    def used_pages(self, rank: int) -> int:
        return self.num_pages - len(self._free[rank])

    def utilization(self, rank: int) -> float:
        return 1.0 - len(self._free[rank]) / self.num_pages

    def min_free_pages(self) -> int:
        return min(len(f) for f in self._free)

    def __contains__(self, req: int) -> bool:
        return req in self._reqs

    @property
    def requests(self) -> list[int]:
        return list(self._reqs)

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
                if not a.prefill[0]:
                    del self._reqs[req]
                raise OutOfPagesError(
                    f"request {req}: prefill of {total_tokens} tokens needs {need} more pages "
                    f"per rank, only {self.min_free_pages()} free on the fullest rank")
            for r in range(self.num_ranks):
                free = self._free[r]
                a.prefill[r].extend(free.pop() for _ in range(need))
            a.prefill_view = tuple(tuple(p) for p in a.prefill)
        a.prefill_tokens = max(a.prefill_tokens, total_tokens)
        return a.prefill

    # ---- transition + decode ------------------------------------------------------
    def can_transition(self, rank: int, tokens: int, headroom_pages: int = 0) -> bool:
        return self.decode_pages_for(tokens) + headroom_pages <= len(self._free[rank])

    def transition(self, req: int, rank: int, tokens: int,
                   keep_prefill: bool = False) -> list[int]:
        """Allocate full-head decode pages for ``tokens`` tokens on ``rank``.

        The prefill pages are freed on every rank unless ``keep_prefill`` (the executor
        still reads them during the completing step; call :meth:`release_prefill` after).
        """
        a = self._reqs.get(req)
        if a is None:
            a = self._reqs[req] = _Alloc()
        if a.decode is not None:
            raise BlockManagerError(f"request {req} already transitioned to rank {a.decode_rank}")
        need = self.decode_pages_for(tokens)
        free = self._free[rank]
        if need > len(free):
            raise OutOfPagesError(f"request {req}: decode KV of {tokens} tokens needs {need} "
                                  f"pages on rank {rank}, {len(free)} free")
        a.decode_rank = rank
        a.decode = [free.pop() for _ in range(need)]
        a.decode_view = tuple(a.decode)
        a.decode_tokens = tokens
        if not keep_prefill:
            self.release_prefill(req)
        return a.decode

    def release_prefill(self, req: int) -> None:
        """Free the head-sharded prefill pages of ``req`` on every rank (no-op if none)."""
        a = self._get(req)
        if a.prefill is not None:
            for r, pages in enumerate(a.prefill):
                self._free[r].extend(reversed(pages))
            a.prefill = None
            a.prefill_view = ()
            a.prefill_tokens = 0

    def can_append_decode(self, req: int, new_len: int) -> bool:
        a = self._get(req)
        if a.decode is None or a.decode_rank is None:
            return False
        need = self.decode_pages_for(new_len) - len(a.decode)
        return need <= len(self._free[a.decode_rank])

    def append_decode(self, req: int, new_len: int) -> list[int]:
        """Grow ``req``'s decode KV to ``new_len`` tokens; returns the newly added page ids."""
        a = self._get(req)
        if a.decode is None or a.decode_rank is None:
            raise BlockManagerError(f"request {req} is not decoding")
        need = self.decode_pages_for(new_len) - len(a.decode)
        added: list[int] = []
        if need > 0:
            free = self._free[a.decode_rank]
            if need > len(free):
                raise OutOfPagesError(f"request {req}: rank {a.decode_rank} is out of pages")
            added = [free.pop() for _ in range(need)]
            a.decode.extend(added)
            a.decode_view = tuple(a.decode)
        a.decode_tokens = max(a.decode_tokens, new_len)
        return added

    # ---- release -----------------------------------------------------------------
    def free(self, req: int) -> None:
        """Return every page of ``req`` to its rank's free list."""
        a = self._reqs.pop(req, None)
        if a is None:
            raise BlockManagerError(f"free of unknown request {req} (double free?)")
        if a.prefill is not None:
            for r, pages in enumerate(a.prefill):
                self._free[r].extend(reversed(pages))
        if a.decode is not None and a.decode_rank is not None:
            self._free[a.decode_rank].extend(reversed(a.decode))

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
        """Every page is either free or owned by exactly one request (tests use this)."""
        for r in range(self.num_ranks):
            owned: list[int] = list(self._free[r])
            for a in self._reqs.values():
                if a.prefill is not None:
                    owned.extend(a.prefill[r])
                if a.decode is not None and a.decode_rank == r:
                    owned.extend(a.decode)
            if sorted(owned) != list(range(self.num_pages)):
                raise BlockManagerError(f"rank {r}: pages leaked or double-owned")

    def _get(self, req: int) -> _Alloc:
        a = self._reqs.get(req)
        if a is None:
            raise BlockManagerError(f"unknown request {req}")
        return a
