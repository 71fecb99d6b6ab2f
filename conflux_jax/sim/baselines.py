"""Simulator-only baselines the real executor cannot express (one XP mesh, one step).

* :class:`MuxLatency` — spatial multiplexing (MuxWise-like, SGLang PD-multiplexing):
  uniform TP over all GPUs; prefill and decode run as *separate* kernels at the same
  time on SM partitions, so linears are not co-batched. Decode gets the smallest SM
  share that keeps it within the TBT SLO; prefill gets the rest. Model (assumptions,
  SIMULATOR.md calls them estimates): decode is memory-bound and needs a share
  ``s_sat`` of the SMs to saturate HBM (slower below it, not faster above); prefill
  time scales with 1/(its share); overlapping kernels inflate the iteration by
  ``1 + eps``. It prices plans like a :class:`LatencyModel` with N = 1, so the normal
  scheduler (waterfill on one rank = largest TBT-safe chunk) and simulator drive it.
* :func:`simulate_disaggregated` — static prefill/decode disaggregation (DistServe-like):
  prefill instances run whole prompts in prefill-only batches; each finished prompt's
  KV crosses NVLink (prompt * KV bytes / bandwidth) to a decode instance that runs
  decode-only iterations; a request waits at the decode side's door while every pool is
  full. The split (TP degree and replicas of each phase) is swept like DistServe's own
  placement search (:func:`conflux_jax.sim.policies.disagg_splits`).
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections.abc import Sequence

from conflux_jax.latency import BatchShape, LatencyModel, attention_work
from conflux_jax.scheduler.prefix_cache import RankPages, block_id_page_keys, chain_hashes
from conflux_jax.scheduler.request import Request
from conflux_jax.sim.driver import RequestRecord, SimReport


@dataclasses.dataclass(frozen=True)
class MuxLatency:
    """Spatially multiplexed iteration latency over one uniform-TP rank (N = 1)."""

    base: LatencyModel  # the TP-G model, N = 1
    tbt_slo_s: float
    s_sat: float = 0.3  # SM share at which decode saturates HBM
    s_min: float = 0.1
    s_max: float = 0.9
    eps: float = 0.1  # cross-kernel contention inflation
    # Decode's SM share is sized for (1 - headroom) * TBT. With none, decode alone fills the
    # whole TBT and every prefill chunk then hangs on a float equality; swept per workload.
    headroom: float = 0.05

    num_ranks: int = 1

    def decode_path(self, w_max: float) -> float:
        return self.base.decode_path(w_max)

    def decode_work(self, w_d: Sequence[float]) -> float:
        return self.base.decode_work(w_d)

    def decode_share(self, t_dec: float) -> float:
        """Fewest SMs that keep the decode pass within the TBT SLO."""
        s = self.s_sat * t_dec * (1 + self.eps) / (self.tbt_slo_s * (1.0 - self.headroom))
        return min(self.s_max, max(self.s_min, s))

    def iteration(self, max_load: int, max_np: int, a_p: float, t_d: float,
                  x_kv: int = 0) -> float:
        del x_kv  # one rank: no KV moves between ranks
        n_d = max_load - max_np
        t_dec = self.base.iteration(n_d, 0, 0.0, t_d) if n_d > 0 else 0.0
        t_pre = self.base.iteration(max_np, max_np, a_p, 0.0) if max_np > 0 else 0.0
        if not t_pre or not t_dec:
            return t_pre + t_dec
        s_d = self.decode_share(t_dec)
        dec = t_dec * max(1.0, self.s_sat / s_d)
        return max(dec, t_pre / (1.0 - s_d)) * (1.0 + self.eps)

    def estimate(self, shape: BatchShape) -> float:
        load = shape.n_p[0] + shape.n_d[0]
        return self.iteration(load, shape.n_p[0], shape.a_p, self.decode_path(shape.w_d[0]))


class _PrefillCache:
    """One prefill instance's prefix cache: the engine's page pool and chained hashes
    (:mod:`~conflux_jax.scheduler.prefix_cache`) over that instance's KV pool. A
    prefill's pages are cached-free as soon as its KV has left for a decode instance."""

    def __init__(self, kv_tokens: int, page_size: int) -> None:
        self.pages = RankPages(max(1, kv_tokens // page_size))
        self.ps = page_size
        self._hashes: dict[int, list[bytes]] = {}

    def hashes(self, r: Request) -> list[bytes]:
        h = self._hashes.get(r.id)
        if h is None:
            keys = block_id_page_keys(r.block_ids, r.block_tokens, self.ps,
                                      r.prompt_len) if r.block_ids else []
            h = self._hashes[r.id] = chain_hashes(keys, salt=r.cache_salt)
        return h

    def hit(self, r: Request) -> list[int]:
        """Cached pages of ``r``'s prefix (its last token is always computed)."""
        return self.pages.longest_hit(self.hashes(r)[:(r.prompt_len - 1) // self.ps])

    def take(self, r: Request, hit: list[int]) -> list[int] | None:
        """Hold ``r``'s prefix hit and pages for the rest of its prompt (None: no room)."""
        self.pages.acquire(hit)
        need = -(-r.prompt_len // self.ps) - len(hit)
        if need > self.pages.num_free():
            self.pages.release(hit)
            return None
        return hit + self.pages.take(need)

    def done(self, r: Request, pages: list[int]) -> None:
        """``r``'s KV is written: name its full pages, then let them go (cached-free)."""
        self.pages.register(pages, self.hashes(r))
        self.pages.release(pages)


def simulate_disaggregated(requests: Sequence[Request], prefill_model: LatencyModel,
                           decode_model: LatencyModel, decode_kv_tokens: int,
                           kv_bytes_per_token: float, ttft_slo_s: float, tbt_slo_s: float,
                           order: str = "fcfs", max_batch_tokens: int = 16384,
                           link_bw: float = 450e9 * 0.8, prefill_replicas: int = 1,
                           decode_replicas: int = 1, noise: float = 0.0,
                           seed: int = 0, prefill_kv_tokens: int = 0,
                           page_size: int = 16) -> SimReport:
    """Discrete-event run of ``prefill_replicas`` prefill and ``decode_replicas`` decode
    instances (each N = 1; ``decode_kv_tokens`` is one decode instance's pool).

    ``prefill_kv_tokens`` > 0 gives each prefill instance a prefix cache of that many
    tokens (requests that name their blocks hit it); 0 = no prefix caching.

    The next prefill batch goes to the first free prefill instance; a transferred KV goes
    to the first decode instance that has room for it. ``noise`` is the truth's relative
    per-iteration jitter, as :class:`~conflux_jax.sim.executor.SimExecutor` applies it.
    """
    rng = random.Random(seed)

    def jitter(t: float) -> float:
        return t * max(0.0, 1.0 + rng.gauss(0.0, noise)) if noise else t

    reqs = sorted(requests, key=lambda r: (r.arrival_s, r.id))
    recs = {r.id: RequestRecord(r.id, r.arrival_s, r.prompt_len, r.max_new_tokens)
            for r in reqs}
    t_p = [0.0] * prefill_replicas
    t_d = [0.0] * decode_replicas
    kv_used = [0] * decode_replicas
    decoding: list[dict[int, list[int]]] = [{} for _ in range(decode_replicas)]
    i = 0
    queue: list[Request] = []
    transfer: list[tuple[float, int, Request]] = []  # (ready time, id, request) heap
    iters = 0
    caches = [_PrefillCache(prefill_kv_tokens, page_size) for _ in range(prefill_replicas)] \
        if prefill_kv_tokens else []
    queries = hits = 0

    def cached(r: Request, k: int) -> int:
        """Prompt tokens prefill instance ``k`` would not compute for ``r``."""
        if r.cached_prefix or not caches:
            return r.cached_prefix
        return len(caches[k].hit(r)) * page_size

    def emit(rid: int, t: float) -> None:
        recs[rid].token_at(t, ttft_slo_s, tbt_slo_s)

    for r in reqs:  # a request longer than a decode pool can never be served
        if r.prompt_len + r.max_new_tokens > decode_kv_tokens:
            recs[r.id].aborted = True
    reqs = [r for r in reqs if not recs[r.id].aborted]
    n = len(reqs)
    inf = float("inf")
    while i < n or queue or transfer or any(decoding):
        # Discrete events: run whichever instance can act earliest (prefill on ties).
        p_k = min(range(prefill_replicas), key=t_p.__getitem__)
        p_next = t_p[p_k] if queue else (max(t_p[p_k], reqs[i].arrival_s) if i < n else inf)
        d_times = [t_d[m] if decoding[m] else
                   (max(t_d[m], transfer[0][0]) if transfer else inf)
                   for m in range(decode_replicas)]
        d_m = min(range(decode_replicas), key=d_times.__getitem__)
        if p_next <= d_times[d_m]:
            t = t_p[p_k] = p_next
            while i < n and reqs[i].arrival_s <= t:
                queue.append(reqs[i])
                i += 1
            if order == "srpt":
                queue.sort(key=lambda r: (r.prompt_len - cached(r, p_k), r.arrival_s))
            batch, tokens, a_p, held = [], 0, 0.0, []
            while queue:
                r = queue[0]
                c = cached(r, p_k)
                if batch and tokens + r.prompt_len - c > max_batch_tokens:
                    break
                if caches and not r.cached_prefix:
                    pages = caches[p_k].take(r, caches[p_k].hit(r))
                    if pages is None and batch:
                        break  # the instance's pool is full: the rest waits
                    held.append((r, pages or []))
                    queries += r.prompt_len
                    hits += c
                queue.pop(0)
                batch.append(r)
                tokens += r.prompt_len - c
                a_p += attention_work(r.prompt_len - c, c)
            t = t_p[p_k] = t + jitter(prefill_model.iteration(tokens, tokens, a_p, 0.0))
            iters += 1
            for r, pages in held:
                caches[p_k].done(r, pages)
            for r in batch:
                emit(r.id, t)
                if r.max_new_tokens == 1:
                    recs[r.id].finish_s = t
                else:
                    ready = t + r.prompt_len * kv_bytes_per_token / link_bw
                    heapq.heappush(transfer, (ready, r.id, r))
            continue
        # Decode instance: admit transferred KV that fits, then one decode-only iteration.
        m = d_m
        t = t_d[m] = d_times[m]
        while transfer and transfer[0][0] <= t:
            r = transfer[0][2]
            need = r.prompt_len + r.max_new_tokens
            if kv_used[m] + need > decode_kv_tokens:
                break
            heapq.heappop(transfer)
            kv_used[m] += need  # reserve the whole output: no preemption on this side
            decoding[m][r.id] = [r.prompt_len, 1, r.max_new_tokens]
        # An idle instance's pool is empty and every request fits one (checked above).
        assert decoding[m]
        w = sum(s[0] + 1 for s in decoding[m].values())
        t = t_d[m] = t + jitter(decode_model.iteration(
            len(decoding[m]), 0, 0.0, decode_model.decode_path(w)))
        iters += 1
        done = []
        for rid, st in decoding[m].items():
            st[0] += 1
            st[1] += 1
            emit(rid, t)
            if st[1] >= st[2]:
                done.append(rid)
        for rid in done:
            st = decoding[m].pop(rid)
            kv_used[m] -= recs[rid].prompt_len + st[2]
            recs[rid].finish_s = t
    return SimReport(records=list(recs.values()), iterations=iters,
                     sim_seconds=max(t_p + t_d), busy_seconds=0.0, preemptions=0,
                     slo_claim_violations=0, prefix_queries=queries, prefix_hits=hits)
