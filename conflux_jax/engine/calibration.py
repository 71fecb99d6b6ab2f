"""A latency model for a (model, device, mesh) that ships no fit: calibrated at warm-up.

Until a fit exists the scheduler prices iterations with the roofline of the detected
device (``latency/roofline.py``'s table), or the built-in CPU estimate. At warm-up the
profiler (``profiler.py``) times a few dozen random batches within the compiled buckets
on the real executor, :func:`conflux_jax.latency.fit` fits them, and the held-out error
goes to the log. The fit is saved beside the compile cache, keyed by everything that
changes what a step costs (model, device kind, mesh, dtype, buckets, pages), so a restart
loads it instead of profiling again; ``recalibrate`` forces a new one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

from conflux_jax.engine.profiler import ProfileSpace, profile
from conflux_jax.executor.compile_cache import calibration_dir
from conflux_jax.executor.jax_executor import JaxExecutor
from conflux_jax.latency import LatencyModel, fit, mape
from conflux_jax.scheduler.block_manager import BlockManager

log = logging.getLogger(__name__)

ENV_VAR = "CONFLUX_CALIBRATE"  # "1": calibrate on CPU too (where it is off by default)


@dataclasses.dataclass(frozen=True)
class Budget:
    """Random batches to time: ``num_train`` to fit, ``num_test`` held out for the error,
    each run ``repeats`` times (the fastest counts)."""

    num_train: int = 36
    num_test: int = 24
    repeats: int = 3
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class CalibrationKey:
    """What a saved fit is valid for: a change to any field changes what steps cost."""

    model: str
    device_kind: str
    sp: int
    tp: int
    dtype: str
    page_size: int
    num_pages: int
    max_model_len: int
    tokens: tuple[int, ...]
    decode: tuple[int, ...]
    decode_pages: tuple[int, ...]
    transfer: tuple[int, ...]
    max_prefill_seqs: int

    @classmethod
    def of(cls, ex: JaxExecutor, model: str) -> CalibrationKey:
        ec, b, mesh = ex.exec_config, ex.buckets, ex.mesh_spec
        return cls(model, ex.device_kind, mesh.sp, mesh.tp, ex.dtype.name, ec.page_size,
                   ex.kv.num_pages, ec.max_model_len, b.tokens, b.decode, b.decode_pages,
                   b.transfer, b.max_prefill_seqs)

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))  # tuples as lists

    def path(self, directory: Path) -> Path:
        digest = hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode())
        kind = re.sub(r"[^a-z0-9]+", "-", self.device_kind.lower()).strip("-")
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", self.model)
        return directory / f"{name}__{kind}__sp{self.sp}_tp{self.tp}__" \
            f"{digest.hexdigest()[:12]}.json"


def saved_path(ex: JaxExecutor, model: str, directory: str | Path | None = None) -> Path:
    """Where the calibration of ``ex`` running ``model`` is kept."""
    root = Path(directory) if directory is not None else calibration_dir(ex.compile_cache_dir)
    return CalibrationKey.of(ex, model).path(root)


def load_saved(ex: JaxExecutor, model: str, directory: str | Path | None = None
               ) -> LatencyModel | None:
    """The fit an earlier calibration saved for exactly this setup, if any."""
    path = saved_path(ex, model, directory)
    if not path.is_file():
        return None
    try:
        fitted = LatencyModel.load(path)
    except (ValueError, KeyError, TypeError) as exc:  # damaged or older: calibrate anew
        log.warning("ignoring latency fit %s: %s", path, exc)
        return None
    if fitted.meta.get("calibration_key") != CalibrationKey.of(ex, model).to_json():
        return None
    return fitted


def profile_space(ex: JaxExecutor) -> ProfileSpace:
    """Random batches the executor's buckets and KV pool hold: up to two prefill chunks
    (completing ones move their KV: the transfer must fit one step's largest), the
    resident decodes of a bucket, contexts the pool holds together."""
    n, ps = ex.num_ranks, ex.kv.page_size
    b, max_len = ex.buckets, ex.exec_config.max_model_len
    pages = ex.kv.num_pages - 4  # headroom
    context = max(2, max_len // 2 - ps * n)
    while True:
        per_seq = math.ceil(context / ps)
        prefills = 2 * (math.ceil(context / (ps * n)) + per_seq)
        decodes = min(b.decode[-1], b.tokens[-1] // 2, (pages - prefills) // per_seq)
        if decodes >= 1 or context <= 2:
            break
        context //= 2
    # A chunk and its history stay within ``context`` (random_plan bounds only the sum of
    # history and chunk by it, not a chunk alone).
    return ProfileSpace(max_context=context, max_chunk=min(b.tokens[-1] * n, context),
                        max_decodes=max(1, decodes), tokens_per_rank=b.tokens[-1],
                        vocab=ex.model_config.vocab_size)


def calibrate(ex: JaxExecutor, model: str, budget: Budget = Budget(),
              directory: str | Path | None = None) -> LatencyModel:
    """Profile ``ex`` on random batches, fit, log the held-out error, save the fit."""
    if ex.buckets.max_prefill_seqs < 2:
        raise ValueError("calibration batches hold two prefill chunks: max_prefill_seqs >= 2")
    start = time.perf_counter()
    blocks = BlockManager(ex.num_ranks, ex.kv.num_pages, ex.kv.page_size)
    space = profile_space(ex)
    train, test = profile(ex, space, budget.num_train, budget.num_test, budget.repeats,
                          budget.seed, blocks=blocks, progress=False)
    key = CalibrationKey.of(ex, model)
    shared = ex.platform == "cpu" and ex.num_ranks > 1  # simulated ranks share cores
    fitted = fit(train, ex.model_config.num_layers, ex.num_ranks,
                 token_buckets=ex.buckets.tokens, shared_cores=shared,
                 meta={"model": model, "hardware": ex.device_kind,
                       "mesh": f"sp={key.sp},tp={key.tp}"})
    # Rounded once, so the log and the saved meta state the same figure.
    err = round(mape(fitted, test), 3)
    fitted = dataclasses.replace(fitted, meta={
        **fitted.meta, "source": "calibration", "heldout_mape_pct": err,
        "num_test": len(test), "space": dataclasses.asdict(space),
        "calibration_key": key.to_json()})
    path = saved_path(ex, model, directory)
    fitted.save(path)
    log.info("latency model calibrated for %s on %s (sp=%d,tp=%d): %d batches in %.1f s, "
             "held-out MAPE %.1f%% over %d batches; saved to %s", model, ex.device_kind,
             key.sp, key.tp, len(train) + len(test), time.perf_counter() - start, err,
             len(test), path)
    return fitted
