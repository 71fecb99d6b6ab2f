"""Waterfill prefill dispatch (§6.3, Appendix E, Alg. 2).

Within one iteration a :class:`Dispatcher` holds the combined load of every rank
(resident decodes + prefill tokens already dispatched) and answers two queries:

* :meth:`Dispatcher.budget` (Alg. 2 with i = ∅): the largest q-aligned common level
  ``n_target`` whose full fill keeps the estimated latency within the TBT SLO, and the
  budget ``B0 = sum_r max(0, n_target - load_r)`` (the candidate's attention work is
  omitted, as in the paper).
* :meth:`Dispatcher.dispatch` (Alg. 2 with a request): the largest TBT-safe chunk of a
  request with ``m`` prompt tokens left after ``c`` done, and its per-rank assignment,
  filled decode-light ranks first toward a common level. The level search is the paper's
  q-aligned binary search; the chunk is then refined between the last feasible and the
  first infeasible level at token granularity, so the chunk is the largest TBT-safe one
  for a waterfill-shaped assignment (not just the largest at an aligned level).

Latency is nondecreasing in the level (both the max combined load and the max prefill
shard grow with it), which is what makes both binary searches valid.
"""

from __future__ import annotations

from collections.abc import Sequence

from conflux_jax.latency import LatencyModel, attention_work


def waterfill_assign(loads: Sequence[int], amount: int) -> list[int]:
    """Split ``amount`` tokens over ranks, raising the lightest ranks to a common level.

    Returns the per-rank additions. The resulting max load is the smallest possible
    for ``amount``; leftover tokens of an uneven split go to the lightest ranks (lowest
    index on ties). Additions are monotone in ``amount`` rank by rank.
    """
    n = len(loads)
    add = [0] * n
    if amount <= 0:
        return add
    order = sorted(range(n), key=lambda r: (loads[r], r))
    s = 0
    k = n
    for i in range(n):
        s += loads[order[i]]
        if i + 1 == n or s + amount <= loads[order[i + 1]] * (i + 1):
            k = i + 1
            break
    base, extra = divmod(s + amount, k)
    for j in range(k):
        r = order[j]
        add[r] = base - loads[r] + (1 if j < extra else 0)
    return add


def capacity_at(loads: Sequence[int], level: int) -> int:
    """Budget ``sum_r max(0, level - load_r)`` of a common level."""
    return sum(level - x for x in loads if x < level)


def level_for(loads: Sequence[int], amount: int) -> int:
    """Smallest common level whose capacity holds ``amount`` tokens."""
    add = waterfill_assign(loads, amount)
    return max(x + a for x, a in zip(loads, add, strict=True) if a > 0) if amount > 0 else 0


class Dispatcher:
    """Per-iteration waterfill state over N ranks (combined loads, prefill shards)."""

    __slots__ = ("model", "tau", "q", "max_level", "loads", "n_p", "a_p", "t_d", "n",
                 "moved", "w_d", "w_l")

    def __init__(self, model: LatencyModel, tau: float, decode_tokens: Sequence[int],
                 t_d: float, quantum: int = 16, max_level: int = 8192,
                 decode_work: Sequence[float] | None = None) -> None:
        self.model = model
        self.tau = tau
        self.q = max(1, quantum)
        self.max_level = max_level
        self.loads = list(decode_tokens)
        self.n = len(self.loads)
        self.n_p = [0] * self.n
        self.a_p = 0.0
        self.t_d = t_d
        self.moved = [0] * self.n  # KV tokens completing prefills move to each decode rank
        # Per-rank decode attention work behind ``t_d`` (needed to add local prefills;
        # None: ``t_d`` is fixed), and the local prefills' attention work (T_L).
        self.w_d = None if decode_work is None else list(decode_work)
        self.w_l = [0.0] * self.n

    # ---- latency of the current state plus an optional addition --------------------
    def estimate(self, add: Sequence[int] | None = None, extra_work: float = 0.0,
                 extra_moved: int = 0) -> float:
        # A completing candidate's decode rank is not chosen yet: price its transfer as if
        # it lands on the rank already receiving the most (an upper bound).
        x_kv = max(self.moved) + extra_moved
        if add is None:
            return self.model.iteration(max(self.loads), max(self.n_p), self.a_p, self.t_d,
                                        x_kv)
        g = max(x + a for x, a in zip(self.loads, add, strict=True))
        c = max(x + a for x, a in zip(self.n_p, add, strict=True))
        return self.model.iteration(g, c, self.a_p + extra_work, self.t_d, x_kv)

    def _decode_path_with(self, rank: int, work: float) -> float:
        """T_D (with T_L) once ``rank`` also runs a local prefill of attention ``work``."""
        if self.w_d is None:
            raise ValueError("a Dispatcher built without decode_work cannot add local rows")
        w_l = list(self.w_l)
        w_l[rank] += work
        m = self.model
        return m.decode_path(m.decode_work(self.w_d)) + m.local_path(w_l)

    def estimate_local(self, rank: int, length: int, c: int) -> float:
        """The iteration's latency with a ``length``-token local prefill after ``c``
        cached tokens on ``rank`` (decode-slice rows: its linears, its attention)."""
        g = max(max(self.loads), self.loads[rank] + length)
        return self.model.iteration(g, max(self.n_p), self.a_p,
                                    self._decode_path_with(rank, attention_work(length, c)),
                                    max(self.moved))

    def estimate_ulysses(self, length: int, c: int, moved: int) -> float:
        """The iteration's latency with a ``length``-token chunk after ``c`` done,
        waterfilled over the ranks, that moves ``moved`` KV tokens (load and transfer)."""
        return self.estimate(waterfill_assign(self.loads, length), attention_work(length, c),
                             moved)

    def commit_local(self, rank: int, length: int, c: int) -> None:
        """Accumulate a local prefill (see :meth:`estimate_local`)."""
        self.t_d = self._decode_path_with(rank, attention_work(length, c))
        self.w_l[rank] += attention_work(length, c)
        self.loads[rank] += length

    def _fits_level(self, level: int) -> bool:
        """Budget mode: the full fill of ``level`` meets the SLO (candidate omitted)."""
        add = [level - x if x < level else 0 for x in self.loads]
        return self.estimate(add) <= self.tau

    def _fits_chunk(self, length: int, c: int, m: int, load: int = 0
                    ) -> tuple[bool, list[int]]:
        """Does a ``length``-token chunk fit; the chunk that completes (``length == m``)
        also moves the request's ``c + m`` KV tokens to its decode rank, and a chunk
        after a prefix-cache hit first loads the ``load`` cached tokens."""
        add = waterfill_assign(self.loads, length)
        moved = (c + m if length == m else 0) + load
        return self.estimate(add, attention_work(length, c), moved) <= self.tau, add

    def _search_levels(self, k_lo: int, k_hi: int, fits) -> int:  # noqa: ANN001
        """Largest k in [k_lo, k_hi] with fits(k); k_lo is assumed feasible."""
        while k_lo < k_hi:
            mid = (k_lo + k_hi + 1) // 2
            if fits(mid):
                k_lo = mid
            else:
                k_hi = mid - 1
        return k_lo

    # ---- Alg. 2 ------------------------------------------------------------------------
    def budget(self) -> tuple[int, int]:
        """(B0, n_target) with no candidate (Alg. 2, i = ∅)."""
        q = self.q
        if self.estimate() > self.tau:
            return 0, min(self.loads)
        k_lo = min(self.loads) // q
        k_hi = self.max_level // q
        if k_hi <= k_lo:
            return 0, min(self.loads)
        k = self._search_levels(k_lo, k_hi, lambda k: self._fits_level(k * q))
        level = k * q
        return capacity_at(self.loads, level), level

    def dispatch(self, m: int, c: int, load: int = 0) -> tuple[int, list[int]]:
        """Largest TBT-safe chunk of a request with ``m`` tokens left after ``c`` done
        (``load``: cached prefix tokens the chunk loads first).

        Returns ``(length, per-rank additions)``; length 0 means no budget is left.
        """
        q = self.q
        n = self.n
        if m <= 0 or self.estimate() > self.tau:
            return 0, [0] * n
        cap_max = capacity_at(self.loads, self.max_level)
        if cap_max <= 0:
            return 0, [0] * n
        m_eff = min(m, cap_max)
        # Beyond the level that holds m_eff tokens nothing changes: cap the search there.
        k_lo = min(self.loads) // q
        k_hi = min(-(-level_for(self.loads, m_eff) // q), self.max_level // q)
        k = self._search_levels(
            k_lo, k_hi,
            lambda k: self._fits_chunk(min(m_eff, capacity_at(self.loads, k * q)), c, m, load)[0])
        lo = min(m_eff, capacity_at(self.loads, k * q))  # feasible (or 0)
        hi = min(m_eff, capacity_at(self.loads, min((k + 1) * q, self.max_level)))
        if hi > lo and not self._fits_chunk(hi, c, m, load)[0]:
            hi -= 1
            while lo < hi:  # refine at token granularity inside the next quantum
                mid = (lo + hi + 1) // 2
                if self._fits_chunk(mid, c, m, load)[0]:
                    lo = mid
                else:
                    hi = mid - 1
        else:
            lo = hi
        if lo <= 0:
            return 0, [0] * n
        return lo, waterfill_assign(self.loads, lo)

    def commit(self, add: Sequence[int], c: int, decode_rank: int | None = None,
               resident: int = 0, load_rank: int = -1, load: int = 0) -> None:
        """Accumulate a dispatched chunk (assignment ``add``, prior context ``c``); a chunk
        that completes its prefill moves ``c + length`` KV tokens to ``decode_rank``, less
        the ``resident`` cached ones already there; one that loads a cached prefix moves
        ``load`` tokens from ``load_rank``."""
        length = 0
        for r, a in enumerate(add):
            if a:
                self.loads[r] += a
                self.n_p[r] += a
                length += a
        self.a_p += attention_work(length, c)
        if decode_rank is not None:
            self.moved[decode_rank] += c + length - resident
        if load:
            self.moved[load_rank] += load
