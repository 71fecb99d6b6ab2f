"""The Conflux iteration latency model (§6.2, Eqs. 2-6, Appendix D).

    T_iter = L * (T_gemm + T_attn + T_X) + overhead              Eq. 2 (+ T_X)
    T_gemm = f_gemm(max_r (n_p^r + n_d^r))                       Eq. 3
    T_attn = max(beta * T_P, alpha * T_D)  (both paths; else T_P + T_D)   Eq. 4
             (T_P + T_D always with ``serial_attention``: our step's order)
    T_D    = max_r f_D(sum_{i in D_r} c_i) + T_L                 Eq. 5 (+ T_L)
    T_L    = max_r f_P(sum_{j in L_r} l_j * (c_j + (l_j + 1)/2))  owner-alone suffixes (ours;
             f_P(1/N * sum over ranks) when the ranks share the cores, as f_P was fitted)
    T_P    = f_comm(max_r n_p^r) + f_P((1/N) * sum_i l_i * (c_i + (l_i + 1)/2))   Eq. 6
    T_X    = f_X(max_d x_d)   KV tokens completing prefills move to decode rank d (ours)

The paper's model has no T_X: it pipelines the transfer layer by layer behind the next
layer's GEMMs (§7). Ours prices it, conservatively as if exposed (bytes moved / link
bandwidth in the roofline), so a long prompt's completion step is not under-estimated; a
fit without a transfer coefficient (every shipped CPU fit) has f_X = 0 and prices exactly
as before.

T_L prices the prefix hits whose suffix runs on its owner rank alone (``LocalPrefill``):
each is one ragged sequence of the decode slice, attended by the prefill attention's kernel
over all heads on that one rank, so f_P of its whole work (not the 1/N share), after the
rank's decode attention.

The fit from measured iterations is in :mod:`conflux_jax.latency.fit`; shipped
coefficients in :mod:`conflux_jax.latency.coeffs`.

Each base function is ``f(x) = b + max(a*x, floor)`` for x > 0 and 0 for an empty
component (Appendix D fits an intercept per operator; an operator that does not run
costs nothing). ``floor`` is 0 for fitted models (pure affine, as in the paper); the
roofline source uses it for the weight-read floor of the linears. alpha and beta (>= 1)
are contention factors that only apply when prefill and decode attention overlap.
``overhead`` is a per-iteration constant outside the layers (LM head, sampling).

Two facts of the executor that runs the iterations can be stated, because they change what
a step costs: ``token_buckets`` (the fixed-shape executor pads the token buffer, and the
prefill slice with it, to a bucket, so the linears and the all-to-all cost the padded size)
and ``shared_cores`` (simulated ranks that time-share a CPU's cores: their decode attention
adds up instead of overlapping, so ``T_D`` follows the sum of the ranks' decode context,
not the max). A GPU mesh leaves both off, as the paper's model does.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from conflux_jax.plan import IterationPlan


def attention_work(length: int, context: int) -> float:
    """Causal attention work of a ``length``-token chunk after ``context`` cached tokens:
    ``l * (c + (l + 1) / 2)`` (the summand of Eq. 6; Appendix D, Eq. 9)."""
    return length * (context + (length + 1) / 2)


@dataclasses.dataclass(frozen=True)
class Affine:
    """``f(x) = b + max(a*x, floor)`` for x > 0; ``f(0) = 0``."""

    a: float = 0.0
    b: float = 0.0
    floor: float = 0.0

    def __call__(self, x: float) -> float:
        if x <= 0:
            return 0.0
        ax = self.a * x
        return self.b + (ax if ax > self.floor else self.floor)


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The workload features of one iteration that the latency model depends on.

    ``n_p``/``n_d``: prefill/decode tokens per rank; ``w_d``: summed decode context
    per rank (each decode attends to its KV length + 1); ``w_l``: the causal attention work
    of the owner-alone suffixes per rank (``LocalPrefill``, T_L); ``a_p``: total causal prefill
    attention work sum_i l_i*(c_i + (l_i+1)/2) over all chunks of the iteration; ``x_kv``:
    the KV tokens (all heads) that completing prefills move to the busiest decode rank.
    """

    n_p: tuple[int, ...]
    n_d: tuple[int, ...]
    w_d: tuple[int, ...]
    a_p: float
    x_kv: int = 0
    w_l: tuple[float, ...] = ()

    @property
    def num_ranks(self) -> int:
        return len(self.n_p)

    @classmethod
    def from_plan(cls, plan: IterationPlan, num_ranks: int) -> BatchShape:
        """Features of a plan (each decode slot attends to its ``position + 1`` tokens; a
        local prefill's tokens are decode-slice tokens of its rank)."""
        w_d = [0] * num_ranks
        for d in plan.decode:
            w_d[d.rank] += d.position + 1
        w_l = [0.0] * num_ranks
        for lp in plan.local_prefill:
            w_l[lp.rank] += attention_work(lp.length, lp.start)
        a_p = sum(attention_work(p.length, p.start) for p in plan.prefill)
        return cls(tuple(plan.prefill_per_rank(num_ranks)),
                   tuple(plan.decode_per_rank(num_ranks)), tuple(w_d), a_p,
                   transfer_tokens(plan, num_ranks), tuple(w_l))


def transfer_tokens(plan: IterationPlan, num_ranks: int) -> int:
    """KV tokens the plan moves to (or, loading a cached prefix, from) the busiest rank:
    a completing request moves its prompt, ``start + length`` positions less those
    already resident on its decode rank; a chunk after a prefix-cache hit loads the
    ``start`` cached positions from their owner."""
    moved = [0] * num_ranks
    for p in plan.prefill:
        if p.completes and p.decode_rank is not None:
            moved[p.decode_rank] += p.start + p.length - p.resident_tokens
        if p.load_rank is not None:
            moved[p.load_rank] += p.start
    return max(moved, default=0)


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """Coefficients of the latency model for one (model, hardware, mesh)."""

    num_layers: int
    num_ranks: int
    gemm: Affine
    dec: Affine
    pre: Affine
    comm: Affine
    alpha: float = 1.0
    beta: float = 1.0
    overhead_s: float = 0.0
    token_buckets: tuple[int, ...] = ()  # the executor's token buckets; () = no padding
    # Measured per-layer GEMM seconds of each token bucket (one executable each), when
    # fitted that way; ``gemm`` then only prices loads beyond the largest bucket.
    gemm_per_bucket: tuple[float, ...] = ()
    shared_cores: bool = False  # ranks time-share host cores (simulated CPU mesh)
    # Prefill and decode attention run one after the other (T_P + T_D, as our step runs
    # them), not overlapped as Eq. 4 models the paper's SM-partitioned kernels.
    serial_attention: bool = False
    # T_X per layer of the KV tokens moved to one decode rank; zero on one rank and in fits
    # that do not measure it.
    transfer: Affine = Affine()
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    # ---- evaluation ---------------------------------------------------------------
    def padded(self, load: int) -> int:
        """The token-buffer size the executor runs for a per-rank ``load``."""
        i = bisect.bisect_left(self.token_buckets, load)
        return self.token_buckets[i] if load > 0 and i < len(self.token_buckets) else load

    def gemm_time(self, load: int) -> float:
        """Per-layer time of the linears for a per-rank ``load`` (padded as executed)."""
        i = bisect.bisect_left(self.token_buckets, load)
        if load > 0 and i < len(self.gemm_per_bucket):
            return self.gemm_per_bucket[i]
        return self.gemm(self.padded(load))

    def for_buckets(self, token_buckets: Sequence[int]) -> LatencyModel:
        """The same fit priced for an executor with other token buckets: per-bucket GEMM
        times are interpolated between the measured buckets (``gemm`` beyond them)."""
        buckets = tuple(int(b) for b in token_buckets)
        table: tuple[float, ...] = ()
        if self.gemm_per_bucket:
            xs, ys = self.token_buckets, self.gemm_per_bucket
            table = tuple(float(np.interp(b, xs, ys)) if b <= xs[-1] else self.gemm(b)
                          for b in buckets)
        return dataclasses.replace(self, token_buckets=buckets, gemm_per_bucket=table)

    def decode_work(self, w_d: Sequence[float]) -> float:
        """The decode context that sets ``T_D``, from the per-rank decode contexts."""
        return float(sum(w_d)) if self.shared_cores else float(max(w_d, default=0))

    def decode_path(self, w_max: float) -> float:
        """T_D for the rank with the largest decode context (f_D is nondecreasing)."""
        return self.dec(w_max)

    def local_path(self, w_l: Sequence[float]) -> float:
        """T_L: the owner-alone suffixes' attention, ``f_P`` of the busiest rank's work.

        When ranks share the cores, ``f_P`` was fitted to the 1/N share of work that in
        truth all ranks run on the same cores, so the summed local work counts 1/N too."""
        if not w_l:
            return 0.0
        if self.shared_cores:
            return self.pre(sum(w_l) / self.num_ranks)
        return self.pre(max(w_l))

    def prefill_path(self, max_np: int, a_p: float, max_load: int = 0) -> float:
        """T_P: all-to-all on the largest shard + attention over the 1/N share.

        With token buckets the all-to-all moves the whole padded prefill slice, which the
        executor sizes like the token buffer (from ``max_load``)."""
        if max_np <= 0:
            return 0.0
        shard = self.padded(max(max_load, max_np)) if self.token_buckets else max_np
        comm = self.comm(shard) if self.num_ranks > 1 else 0.0
        return comm + self.pre(a_p / self.num_ranks)

    def transfer_path(self, x_kv: int) -> float:
        """T_X: moving ``x_kv`` KV tokens of completing prefills to their decode rank."""
        return self.transfer(x_kv) if self.num_ranks > 1 else 0.0

    def iteration(self, max_load: int, max_np: int, a_p: float, t_d: float,
                  x_kv: int = 0) -> float:
        """T_iter from the aggregate features (the scheduler's hot path)."""
        if max_load <= 0:
            return 0.0
        t_x = self.transfer_path(x_kv) if x_kv > 0 else 0.0
        t_p = self.prefill_path(max_np, a_p, max_load)
        if t_p > 0.0 and t_d > 0.0 and not self.serial_attention:
            bp = self.beta * t_p
            ad = self.alpha * t_d
            t_attn = bp if bp > ad else ad
        else:
            t_attn = t_p + t_d
        return self.num_layers * (self.gemm_time(max_load) + t_attn + t_x) + self.overhead_s

    def estimate(self, shape: BatchShape) -> float:
        loads = [p + d for p, d in zip(shape.n_p, shape.n_d, strict=True)]
        t_d = self.decode_path(self.decode_work(shape.w_d)) + self.local_path(shape.w_l)
        return self.iteration(max(loads), max(shape.n_p), shape.a_p, t_d, shape.x_kv)

    # ---- persistence --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers, "num_ranks": self.num_ranks,
            "gemm": dataclasses.asdict(self.gemm), "dec": dataclasses.asdict(self.dec),
            "pre": dataclasses.asdict(self.pre), "comm": dataclasses.asdict(self.comm),
            "alpha": self.alpha, "beta": self.beta, "overhead_s": self.overhead_s,
            "token_buckets": list(self.token_buckets), "shared_cores": self.shared_cores,
            "gemm_per_bucket": list(self.gemm_per_bucket),
            "serial_attention": self.serial_attention,
            "transfer": dataclasses.asdict(self.transfer),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LatencyModel:
        return cls(num_layers=int(d["num_layers"]), num_ranks=int(d["num_ranks"]),
                   gemm=Affine(**d["gemm"]), dec=Affine(**d["dec"]), pre=Affine(**d["pre"]),
                   comm=Affine(**d["comm"]), alpha=float(d["alpha"]), beta=float(d["beta"]),
                   overhead_s=float(d.get("overhead_s", 0.0)),
                   token_buckets=tuple(int(b) for b in d.get("token_buckets", ())),
                   shared_cores=bool(d.get("shared_cores", False)),
                   gemm_per_bucket=tuple(float(x) for x in d.get("gemm_per_bucket", ())),
                   serial_attention=bool(d.get("serial_attention", False)),
                   transfer=Affine(**d.get("transfer", {})),  # absent in fits before T_X
                   meta=dict(d.get("meta", {})))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LatencyModel:
        return cls.from_dict(json.loads(Path(path).read_text()))
