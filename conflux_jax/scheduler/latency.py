"""The Conflux iteration latency model (§6.2, Eqs. 2-6, Appendix D) and its fitting.

    T_iter = L * (T_gemm + T_attn) + overhead
    T_gemm = f_gemm(max_r (n_p^r + n_d^r))
    T_attn = max(beta * T_P, alpha * T_D)      (both paths present; else T_P + T_D)
    T_D    = max_r f_D(sum_{i in D_r} c_i)
    T_P    = f_comm(max_r n_p^r) + f_P((1/N) * sum_i l_i * (c_i + (l_i + 1)/2))

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
    per rank (each decode attends to its KV length + 1); ``a_p``: total causal prefill
    attention work sum_i l_i*(c_i + (l_i+1)/2) over all chunks of the iteration.
    """

    n_p: tuple[int, ...]
    n_d: tuple[int, ...]
    w_d: tuple[int, ...]
    a_p: float

    @property
    def num_ranks(self) -> int:
        return len(self.n_p)

    @classmethod
    def from_plan(cls, plan: Any, kv_lens: dict[int, int], num_ranks: int) -> BatchShape:
        """Features of an :class:`IterationPlan`; ``kv_lens`` = KV length of each decode."""
        n_p = [0] * num_ranks
        n_d = [0] * num_ranks
        w_d = [0] * num_ranks
        a_p = 0.0
        for p in plan.prefill:
            for r, c in enumerate(p.counts):
                n_p[r] += c
            a_p += p.attention_work()
        for d in plan.decode:
            n_d[d.rank] += 1
            w_d[d.rank] += kv_lens[d.request_id] + 1
        return cls(tuple(n_p), tuple(n_d), tuple(w_d), a_p)


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

    def prefill_path(self, max_np: int, a_p: float, max_load: int = 0) -> float:
        """T_P: all-to-all on the largest shard + attention over the 1/N share.

        With token buckets the all-to-all moves the whole padded prefill slice, which the
        executor sizes like the token buffer (from ``max_load``)."""
        if max_np <= 0:
            return 0.0
        shard = self.padded(max(max_load, max_np)) if self.token_buckets else max_np
        comm = self.comm(shard) if self.num_ranks > 1 else 0.0
        return comm + self.pre(a_p / self.num_ranks)

    def iteration(self, max_load: int, max_np: int, a_p: float, t_d: float) -> float:
        """T_iter from the aggregate features (the scheduler's hot path)."""
        if max_load <= 0:
            return 0.0
        t_p = self.prefill_path(max_np, a_p, max_load)
        if t_p > 0.0 and t_d > 0.0:
            bp = self.beta * t_p
            ad = self.alpha * t_d
            t_attn = bp if bp > ad else ad
        else:
            t_attn = t_p + t_d
        return self.num_layers * (self.gemm_time(max_load) + t_attn) + self.overhead_s

    def estimate(self, shape: BatchShape) -> float:
        loads = [p + d for p, d in zip(shape.n_p, shape.n_d, strict=True)]
        return self.iteration(max(loads), max(shape.n_p), shape.a_p,
                              self.decode_path(self.decode_work(shape.w_d)))

    # ---- persistence --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers, "num_ranks": self.num_ranks,
            "gemm": dataclasses.asdict(self.gemm), "dec": dataclasses.asdict(self.dec),
            "pre": dataclasses.asdict(self.pre), "comm": dataclasses.asdict(self.comm),
            "alpha": self.alpha, "beta": self.beta, "overhead_s": self.overhead_s,
            "token_buckets": list(self.token_buckets), "shared_cores": self.shared_cores,
            "gemm_per_bucket": list(self.gemm_per_bucket),
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
                   meta=dict(d.get("meta", {})))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LatencyModel:
        return cls.from_dict(json.loads(Path(path).read_text()))


COEFFS_DIR = Path(__file__).parent / "coeffs"


def coeffs_path(model: str, hardware: str, sp: int, tp: int = 1) -> Path:
    """Conventional JSON location for fitted coefficients of (model, hardware, mesh)."""
    return COEFFS_DIR / f"{model}__{hardware}__sp{sp}_tp{tp}.json"


def profile_name(model: str) -> str:
    """The name a checkpoint's fitted coefficients go by (``coeffs_path``'s ``model``)."""
    return "smollm2-135m" if model == "default" else Path(str(model)).stem


def load_fitted(model: str, hardware: str, sp: int, tp: int,
                token_buckets: Sequence[int]) -> LatencyModel | None:
    """The shipped (or profiled) fit for this (model, hardware, mesh), if there is one,
    priced for an executor with ``token_buckets`` (the per-token coefficients carry over;
    only the padding changes)."""
    path = coeffs_path(profile_name(model), hardware, sp, tp)
    if not path.is_file():
        return None
    return LatencyModel.load(path).for_buckets(token_buckets)


# ---- fitting ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ProfileSample:
    """One measured iteration: its batch features and the measured seconds."""

    shape: BatchShape
    seconds: float


def mape(model: LatencyModel, samples: Sequence[ProfileSample]) -> float:
    """Mean absolute percentage error (in %) of ``model`` on ``samples``."""
    if not samples:
        raise ValueError("mape needs at least one sample")
    errs = [abs(model.estimate(s.shape) - s.seconds) / s.seconds for s in samples]
    return 100.0 * float(np.mean(errs))


# Column order of the fitted parameter vector.
_PARAMS = ("g_a", "g_b", "d_a", "d_b", "p_a", "p_b", "c_a", "c_b")


def _features(samples: Sequence[ProfileSample], shape_of: LatencyModel) -> np.ndarray:
    """Per sample: [G, has_G, W, has_D, A/N, has_P, C (N>1), has_comm], with G, C and W
    as ``shape_of`` (its rank count, buckets and core sharing) sees them."""
    num_ranks = shape_of.num_ranks
    f = np.zeros((len(samples), 8))
    for k, s in enumerate(samples):
        sh = s.shape
        load = max(p + d for p, d in zip(sh.n_p, sh.n_d, strict=True))
        g = shape_of.padded(load)
        c = max(sh.n_p)
        if c and shape_of.token_buckets:
            c = shape_of.padded(load)
        w = shape_of.decode_work(sh.w_d)
        f[k] = (g, g > 0, w, w > 0, sh.a_p / num_ranks, c > 0,
                c if num_ranks > 1 else 0, c > 0 and num_ranks > 1)
    return f


def _gemm_columns(f: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
    """The GEMM part of the design matrix: [G, has_G] (affine), or with token buckets one
    indicator per bucket (each bucket is one executable with its own measured time)."""
    if not buckets:
        return f[:, :2]
    return np.column_stack([f[:, 0] == b for b in buckets]).astype(float)


def _solve(f: np.ndarray, g: np.ndarray, y: np.ndarray, L: int, alpha: float, beta: float,
           dom_p: np.ndarray) -> np.ndarray:
    """Linear least squares in the GEMM columns ``g`` and the 6 attention coefficients,
    given which attention path dominates each mixed sample.

    Rows are scaled by 1/y so the fit minimises relative error (the MAPE target).
    """
    mixed = (f[:, 3] > 0) & (f[:, 5] > 0)
    wd = np.where(mixed, np.where(dom_p, 0.0, alpha), 1.0)
    wp = np.where(mixed, np.where(dom_p, beta, 0.0), 1.0)
    x = L * np.column_stack([g, wd * f[:, 2], wd * f[:, 3],
                             wp * f[:, 4], wp * f[:, 5], wp * f[:, 6], wp * f[:, 7]])
    x = x / y[:, None]
    theta = np.linalg.lstsq(x, np.ones_like(y), rcond=None)[0]
    return np.clip(theta, 0.0, None)


def _paths(f: np.ndarray, th: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = th[-6:]  # attention coefficients: d_a, d_b, p_a, p_b, c_a, c_b
    t_d = a[0] * f[:, 2] + a[1] * f[:, 3]
    t_p = (a[2] * f[:, 4] + a[3] * f[:, 5] + a[4] * f[:, 6] + a[5] * f[:, 7]) * (f[:, 5] > 0)
    return t_p, t_d


def _predict(f: np.ndarray, g: np.ndarray, th: np.ndarray, L: int, alpha: float,
             beta: float) -> np.ndarray:
    t_p, t_d = _paths(f, th)
    mixed = (t_p > 0) & (t_d > 0)
    attn = np.where(mixed, np.maximum(beta * t_p, alpha * t_d), t_p + t_d)
    return L * (g @ th[:-6] + attn)


def fit(samples: Sequence[ProfileSample], num_layers: int, num_ranks: int,
        meta: dict[str, Any] | None = None,
        contention_grid: Sequence[float] = tuple(np.round(np.arange(1.0, 2.001, 0.05), 3)),
        token_buckets: Sequence[int] = (), shared_cores: bool = False) -> LatencyModel:
    """Least-squares fit of all coefficients from measured whole-iteration samples.

    Include decode-only, prefill-only and mixed batches: the intercepts of the
    components are identified by which components are present, and alpha/beta only by
    mixed batches. For each (alpha, beta) on ``contention_grid`` the affine coefficients
    are found by alternating least squares (which path dominates a mixed sample depends
    on the coefficients); the pair with the lowest training MAPE wins. The per-iteration
    constant overhead is absorbed into the GEMM intercept (the two are collinear).
    ``token_buckets`` and ``shared_cores`` describe the executor that was timed (see the
    module docstring) and are kept in the fitted model.
    """
    if len(samples) < len(_PARAMS):
        raise ValueError(f"fit needs at least {len(_PARAMS)} samples, got {len(samples)}")
    shape_of = LatencyModel(num_layers, num_ranks, Affine(), Affine(), Affine(), Affine(),
                            token_buckets=tuple(token_buckets), shared_cores=shared_cores)
    f = _features(samples, shape_of)
    g = _gemm_columns(f, shape_of.token_buckets)
    y = np.array([s.seconds for s in samples], dtype=float)
    L = num_layers
    has_mixed = bool(np.any((f[:, 3] > 0) & (f[:, 5] > 0)))
    grid = contention_grid if has_mixed else (1.0,)
    best: tuple[float, np.ndarray, float, float] | None = None
    for alpha in grid:
        for beta in grid:
            dom_p = np.zeros(len(y), dtype=bool)
            th = _solve(f, g, y, L, alpha, beta, dom_p)
            for _ in range(6):
                t_p, t_d = _paths(f, th)
                new_dom = beta * t_p > alpha * t_d
                if np.array_equal(new_dom, dom_p):
                    break
                dom_p = new_dom
                th = _solve(f, g, y, L, alpha, beta, dom_p)
            err = float(np.mean(np.abs(_predict(f, g, th, L, alpha, beta) - y) / y))
            if best is None or err < best[0]:
                best = (err, th, float(alpha), float(beta))
    assert best is not None
    _, th, alpha, beta = best
    a = [float(x) for x in th[-6:]]
    gemm, per_bucket = Affine(float(th[0]), float(th[1])), ()
    if shape_of.token_buckets:
        gemm, per_bucket = _bucket_table(shape_of.token_buckets, th[:-6], g.any(axis=0))
    return LatencyModel(
        num_layers=L, num_ranks=num_ranks, gemm=gemm, dec=Affine(a[0], a[1]),
        pre=Affine(a[2], a[3]), comm=Affine(a[4], a[5]),
        alpha=alpha, beta=beta, overhead_s=0.0, token_buckets=shape_of.token_buckets,
        shared_cores=shared_cores, gemm_per_bucket=per_bucket,
        meta={**(meta or {}), "source": "profile", "num_samples": len(samples)})


def _bucket_table(buckets: Sequence[int], times: np.ndarray, seen: np.ndarray
                  ) -> tuple[Affine, tuple[float, ...]]:
    """Per-bucket GEMM times, plus the line through the measured ones (for buckets no
    sample ran, and for loads beyond the largest bucket)."""
    xs = np.array(buckets, dtype=float)[seen]
    ys = np.asarray(times, dtype=float)[seen]
    if len(xs) >= 2:
        slope, intercept = np.polyfit(xs, ys, 1)
    else:
        slope, intercept = 0.0, float(ys[0]) if len(ys) else 0.0
    line = Affine(max(0.0, float(slope)), max(0.0, float(intercept)))
    table = tuple(float(t) if ok else line(b)
                  for b, t, ok in zip(buckets, times, seen, strict=True))
    return line, table
