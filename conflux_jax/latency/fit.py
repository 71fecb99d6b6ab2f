"""Fitting the latency model from measured iterations (Appendix D) and its MAPE."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from conflux_jax.latency.model import Affine, BatchShape, LatencyModel


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
_PARAMS = ("g_a", "g_b", "d_a", "d_b", "p_a", "p_b", "c_a", "c_b", "x_a", "x_b")
_ATTN = 6  # d_a .. c_b
_XFER = 2  # x_a, x_b: the KV moved to a decode rank (T_X), additive to the layer


def _features(samples: Sequence[ProfileSample], shape_of: LatencyModel) -> np.ndarray:
    """Per sample: [G, has_G, W, has_D, A/N, has_P, C (N>1), has_comm, X (N>1), has_X],
    with G, C and W as ``shape_of`` (its rank count, buckets and core sharing) sees them."""
    num_ranks = shape_of.num_ranks
    f = np.zeros((len(samples), 10))
    for k, s in enumerate(samples):
        sh = s.shape
        load = max(p + d for p, d in zip(sh.n_p, sh.n_d, strict=True))
        g = shape_of.padded(load)
        c = max(sh.n_p)
        if c and shape_of.token_buckets:
            c = shape_of.padded(load)
        w = shape_of.decode_work(sh.w_d)
        x = sh.x_kv if num_ranks > 1 else 0
        f[k] = (g, g > 0, w, w > 0, sh.a_p / num_ranks, c > 0,
                c if num_ranks > 1 else 0, c > 0 and num_ranks > 1, x, x > 0)
    return f


def _gemm_columns(f: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
    """The GEMM part of the design matrix: [G, has_G] (affine), or with token buckets one
    indicator per bucket (each bucket is one executable with its own measured time)."""
    if not buckets:
        return f[:, :2]
    return np.column_stack([f[:, 0] == b for b in buckets]).astype(float)


def _solve(f: np.ndarray, g: np.ndarray, y: np.ndarray, L: int, alpha: float, beta: float,
           dom_p: np.ndarray) -> np.ndarray:
    """Linear least squares in the GEMM columns ``g``, the 6 attention coefficients and the
    2 transfer ones, given which attention path dominates each mixed sample.

    Rows are scaled by 1/y so the fit minimises relative error (the MAPE target).
    """
    mixed = (f[:, 3] > 0) & (f[:, 5] > 0)
    wd = np.where(mixed, np.where(dom_p, 0.0, alpha), 1.0)
    wp = np.where(mixed, np.where(dom_p, beta, 0.0), 1.0)
    x = L * np.column_stack([g, wd * f[:, 2], wd * f[:, 3],
                             wp * f[:, 4], wp * f[:, 5], wp * f[:, 6], wp * f[:, 7],
                             f[:, 8], f[:, 9]])
    x = x / y[:, None]
    theta = np.linalg.lstsq(x, np.ones_like(y), rcond=None)[0]
    return np.clip(theta, 0.0, None)


def _paths(f: np.ndarray, th: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = th[-_ATTN - _XFER:-_XFER]  # attention coefficients: d_a, d_b, p_a, p_b, c_a, c_b
    t_d = a[0] * f[:, 2] + a[1] * f[:, 3]
    t_p = (a[2] * f[:, 4] + a[3] * f[:, 5] + a[4] * f[:, 6] + a[5] * f[:, 7]) * (f[:, 5] > 0)
    return t_p, t_d


def _predict(f: np.ndarray, g: np.ndarray, th: np.ndarray, L: int, alpha: float,
             beta: float) -> np.ndarray:
    t_p, t_d = _paths(f, th)
    mixed = (t_p > 0) & (t_d > 0)
    attn = np.where(mixed, np.maximum(beta * t_p, alpha * t_d), t_p + t_d)
    t_x = th[-2] * f[:, 8] + th[-1] * f[:, 9]
    return L * (g @ th[:-_ATTN - _XFER] + attn + t_x)


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
    a = [float(x) for x in th[-_ATTN - _XFER:]]
    gemm, per_bucket = Affine(float(th[0]), float(th[1])), ()
    if shape_of.token_buckets:
        gemm, per_bucket = _bucket_table(shape_of.token_buckets, th[:-_ATTN - _XFER],
                                         g.any(axis=0))
    return LatencyModel(
        num_layers=L, num_ranks=num_ranks, gemm=gemm, dec=Affine(a[0], a[1]),
        pre=Affine(a[2], a[3]), comm=Affine(a[4], a[5]), transfer=Affine(a[6], a[7]),
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
