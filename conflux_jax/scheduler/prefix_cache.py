"""Automatic prefix caching: vLLM v1's block index, kept per rank over decode-view pages.

A *full* decode-view page (``page_size`` tokens, all KV heads, on one rank) is named by a
chained hash: ``H(parent hash, the page's tokens, extras)``, where extras (a tenant's
``cache_salt``) enter the first page only, so two prompts share a page exactly when they
share every token up to its end and the salt. Pages are refcounted by the requests that
read them. A page whose last reader leaves keeps its hash and joins the rank's LRU free
queue: it still counts as free (the pool may evict it whenever it needs a page) but a
later request with the same prefix takes it back instead of recomputing it. Only decode
pages are cached: head-sharded prefill pages are scratch (DESIGN.md §3) and a finished
request's KV lives, whole, on its decode rank.

:class:`RankPages` is one rank's free list, LRU queue, refcounts and index; the
:class:`~conflux_jax.scheduler.block_manager.BlockManager` owns one per rank.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

PageHash = bytes

_ROOT = b"conflux-prefix-cache-v1"


def chain_hashes(page_keys: Iterable[bytes], parent: PageHash | None = None,
                 salt: str = "") -> list[PageHash]:
    """Chained hashes of consecutive full pages, given each page's content bytes.

    ``parent`` is the hash of the page before the first one (None: these start the
    sequence, and the salt is mixed in). SHA-256, as vLLM's default: a collision would
    hand one request another's KV.
    """
    out: list[PageHash] = []
    h = parent if parent is not None else hashlib.sha256(
        _ROOT + salt.encode("utf-8", "surrogatepass")).digest()
    for key in page_keys:
        h = hashlib.sha256(h + key).digest()
        out.append(h)
    return out


def token_page_keys(tokens: Sequence[int], page_size: int, first_page: int = 0
                    ) -> list[bytes]:
    """Content bytes of every full page of ``tokens`` from page ``first_page`` on."""
    full = len(tokens) // page_size
    if full <= first_page:
        return []
    arr = np.asarray(tokens[first_page * page_size:full * page_size], np.int64)
    return [row.tobytes() for row in arr.reshape(-1, page_size)]


def block_id_page_keys(block_ids: Sequence[int], block_tokens: int, page_size: int,
                       num_tokens: int, first_page: int = 0) -> list[bytes]:
    """Content bytes of full pages when a trace names its prompt only by block ids
    (Mooncake's ``hash_ids``: one id per ``block_tokens`` tokens): a page is its block's
    id and its offset in the block."""
    if block_tokens % page_size:
        raise ValueError(f"trace blocks of {block_tokens} tokens do not split into pages of "
                         f"{page_size}")
    full = min(num_tokens // page_size, len(block_ids) * block_tokens // page_size)
    per_block = block_tokens // page_size
    return [np.array([block_ids[i // per_block], i % per_block], np.int64).tobytes()
            for i in range(first_page, full)]


class RankPages:
    """One rank's pages: uncached free pages, cached-free pages (LRU order, oldest
    first), refcounts of pages in use, and the hash index of cached pages."""

    __slots__ = ("num_pages", "_free", "_lru", "_ref", "_page_of", "_hash_of")

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first (deterministic tables).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._ref = [0] * num_pages
        self._page_of: dict[PageHash, int] = {}
        self._hash_of: dict[int, PageHash] = {}

    # ---- counts -------------------------------------------------------------------
    def num_free(self) -> int:
        """Pages an allocation may take: uncached free ones plus cached-free ones."""
        return len(self._free) + len(self._lru)

    def num_cached(self) -> int:
        return len(self._page_of)

    def num_cached_free(self) -> int:
        return len(self._lru)

    def refcount(self, page: int) -> int:
        return self._ref[page]

    # ---- allocation ---------------------------------------------------------------
    def take(self, count: int) -> list[int]:
        """``count`` pages for exclusive use (refcount 1): uncached free pages first, then
        the least recently freed cached pages, whose hashes are forgotten."""
        if count > self.num_free():
            raise ValueError(f"{count} pages asked, {self.num_free()} free")
        out: list[int] = []
        free = self._free
        for _ in range(count):
            if free:
                page = free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
            self._ref[page] = 1
            out.append(page)
        return out

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page, last page first: a page nobody reads any more
        goes back free, cached ones to the LRU tail (so a prefix's tail pages, freed
        first, are also evicted first)."""
        ref = self._ref
        for page in reversed(pages):
            if ref[page] <= 0:
                raise ValueError(f"page {page} released more often than taken")
            ref[page] -= 1
            if ref[page] == 0:
                if page in self._hash_of:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    # ---- the cache ----------------------------------------------------------------
    def longest_hit(self, hashes: Sequence[PageHash]) -> list[int]:
        """The cached pages of the longest leading run of ``hashes`` (not acquired)."""
        out: list[int] = []
        page_of = self._page_of
        for h in hashes:
            page = page_of.get(h)
            if page is None:
                break
            out.append(page)
        return out

    def page_for(self, h: PageHash) -> int | None:
        """The cached page named ``h``, if any."""
        return self._page_of.get(h)

    def acquire(self, pages: Sequence[int]) -> None:
        """Take one reference to each cached page (a hit): it leaves the LRU queue."""
        for page in pages:
            if page not in self._hash_of:
                raise ValueError(f"page {page} is not cached")
            if self._ref[page] == 0:
                del self._lru[page]
            self._ref[page] += 1

    def register(self, pages: Sequence[int], hashes: Sequence[PageHash]) -> None:
        """Name in-use pages by their hashes once their KV is written. A page already
        named, or a hash another page already holds (a recomputed duplicate), is left as
        it is: the first copy stays the cached one."""
        for page, h in zip(pages, hashes, strict=False):
            if self._ref[page] <= 0:
                raise ValueError(f"page {page} is not in use")
            if page in self._hash_of or h in self._page_of:
                continue
            self._page_of[h] = page
            self._hash_of[page] = h

    def clear(self) -> None:
        """Forget every cached page (their KV is gone); cached-free pages become free."""
        self._free.extend(reversed(self._lru))
        self._lru.clear()
        self._page_of.clear()
        self._hash_of.clear()

    def check(self, owners: Sequence[int]) -> None:
        """Consistency against the multiset of in-use page ids ``owners`` (tests)."""
        refs = [0] * self.num_pages
        for page in owners:
            refs[page] += 1
        if refs != self._ref:
            raise ValueError("refcounts do not match the requests' pages")
        free = sorted([*self._free, *self._lru])
        if free != [p for p in range(self.num_pages) if refs[p] == 0]:
            raise ValueError("pages leaked or both free and in use")
        if any(p not in self._hash_of for p in self._lru):
            raise ValueError("an uncached page sits in the LRU queue")
        if any(self._page_of[h] != p for p, h in self._hash_of.items()):
            raise ValueError("hash index out of sync")
