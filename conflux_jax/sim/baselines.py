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
  a prefill instance (TP over half the GPUs) runs whole prompts in prefill-only
  batches; each finished prompt's KV crosses NVLink (prompt * KV bytes / bandwidth)
  to a decode instance (TP over the other half) that runs decode-only iterations; a
  request waits at the decode instance's door while its KV pool is full.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from conflux_jax.latency import BatchShape, LatencyModel, attention_work
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

    num_ranks: int = 1

    def decode_path(self, w_max: float) -> float:
        return self.base.decode_path(w_max)

    def decode_work(self, w_d: Sequence[float]) -> float:
        return self.base.decode_work(w_d)

    def decode_share(self, t_dec: float) -> float:
        """Fewest SMs that keep the decode pass within the TBT SLO."""
        s = self.s_sat * t_dec * (1 + self.eps) / self.tbt_slo_s
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


def _uncached(r: Request) -> int:
    """Prompt tokens the prefill instance must compute (a cached prefix is skipped)."""
    return r.prompt_len - r.cached_prefix


def simulate_disaggregated(requests: Sequence[Request], prefill_model: LatencyModel,
                           decode_model: LatencyModel, decode_kv_tokens: int,
                           kv_bytes_per_token: float, ttft_slo_s: float, tbt_slo_s: float,
                           order: str = "fcfs", max_batch_tokens: int = 16384,
                           link_bw: float = 450e9 * 0.8) -> SimReport:
    """Discrete-event run of one prefill and one decode instance (both N = 1)."""
    reqs = sorted(requests, key=lambda r: (r.arrival_s, r.id))
    recs = {r.id: RequestRecord(r.id, r.arrival_s, r.prompt_len, r.max_new_tokens)
            for r in reqs}
    t_p = t_d = 0.0
    i = 0
    queue: list[Request] = []
    transfer: list[tuple[float, int, Request]] = []  # (ready time, id, request) heap
    decoding: dict[int, list[int]] = {}  # id -> [kv_len, generated, max_new]
    kv_used = 0
    iters = 0

    def emit(rid: int, t: float) -> None:
        recs[rid].token_at(t, ttft_slo_s, tbt_slo_s)

    for r in reqs:  # a request longer than the decode pool can never be served
        if r.prompt_len + r.max_new_tokens > decode_kv_tokens:
            recs[r.id].aborted = True
    reqs = [r for r in reqs if not recs[r.id].aborted]
    n = len(reqs)
    inf = float("inf")
    while i < n or queue or transfer or decoding:
        # Discrete events: run whichever instance can act earliest (prefill on ties).
        p_next = t_p if queue else (max(t_p, reqs[i].arrival_s) if i < n else inf)
        d_next = t_d if decoding else (max(t_d, transfer[0][0]) if transfer else inf)
        if p_next <= d_next:
            t_p = p_next
            while i < n and reqs[i].arrival_s <= t_p:
                queue.append(reqs[i])
                i += 1
            if order == "srpt":
                queue.sort(key=lambda r: (_uncached(r), r.arrival_s))
            batch, tokens = [], 0
            while queue and (not batch or tokens + _uncached(queue[0]) <= max_batch_tokens):
                r = queue.pop(0)
                batch.append(r)
                tokens += _uncached(r)
            a_p = sum(attention_work(_uncached(r), r.cached_prefix) for r in batch)
            t_p += prefill_model.iteration(tokens, tokens, a_p, 0.0)
            iters += 1
            for r in batch:
                emit(r.id, t_p)
                if r.max_new_tokens == 1:
                    recs[r.id].finish_s = t_p
                else:
                    ready = t_p + r.prompt_len * kv_bytes_per_token / link_bw
                    heapq.heappush(transfer, (ready, r.id, r))
            continue
        # Decode instance: admit transferred KV that fits, then one decode-only iteration.
        t_d = d_next
        while transfer and transfer[0][0] <= t_d:
            r = transfer[0][2]
            need = r.prompt_len + r.max_new_tokens
            if kv_used + need > decode_kv_tokens:
                break
            heapq.heappop(transfer)
            kv_used += need  # reserve the whole output: no preemption on this side
            decoding[r.id] = [r.prompt_len, 1, r.max_new_tokens]
        w = sum(s[0] + 1 for s in decoding.values())
        t_d += decode_model.iteration(len(decoding), 0, 0.0, decode_model.decode_path(w))
        iters += 1
        done = []
        for rid, s in decoding.items():
            s[0] += 1
            s[1] += 1
            emit(rid, t_d)
            if s[1] >= s[2]:
                done.append(rid)
        for rid in done:
            s = decoding.pop(rid)
            kv_used -= recs[rid].prompt_len + s[2]
            recs[rid].finish_s = t_d
    return SimReport(records=list(recs.values()), iterations=iters, sim_seconds=max(t_p, t_d),
                     busy_seconds=0.0, preemptions=0, slo_claim_violations=0)
