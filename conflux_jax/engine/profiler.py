"""The latency profiler: random heterogeneous batches timed on an executor, the samples the
latency model is fitted to (:func:`conflux_jax.latency.fit`).

One profiler serves the real engine (``bench estimator --profile`` times the JAX executor on
the wall clock) and the simulator (each policy's scheduler gets an estimate fitted to
profiles of the simulated truth, with the same batches and the same sample budget).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from conflux_jax.latency import BatchShape, ProfileSample
from conflux_jax.plan import DecodeSlot, Executor, IterationPlan, PrefillPiece

if TYPE_CHECKING:
    from conflux_jax.scheduler.block_manager import BlockManager

KINDS = ("decode", "prefill", "mixed")
# The sample budget of ``bench estimator --profile``, which the simulator's estimates share.
PROFILE_BUDGET = {"num_train": 150, "num_test": 200, "repeats": 5, "statistic": "min"}


@dataclasses.dataclass(frozen=True)
class ProfileSpace:
    """What the random batches range over."""

    max_context: int  # KV length of a decode / history of a prefill chunk
    max_chunk: int  # prefill tokens of one chunk
    max_decodes: int  # resident decodes per rank
    tokens_per_rank: int  # the executor's token buffer per rank (its largest bucket)
    vocab: int = 0  # token ids drawn below it; 0 = none (an executor that prices lengths)


def random_plan(rng: np.random.Generator, kind: str, num_ranks: int, space: ProfileSpace,
                blocks: BlockManager | None = None) -> IterationPlan:
    """A random plan over new requests. ``blocks`` allocates their pages (free them with
    :func:`release`); without it the plan has no pages, for an executor that reads only
    lengths. KV contents do not matter for timing, only the lengths."""
    n, vocab = num_ranks, space.vocab

    def ids(count: int) -> list[int]:
        return rng.integers(3, vocab, count).tolist() if vocab else []

    slots, pieces = [], []
    rid = 0
    if kind in ("decode", "mixed"):
        for r in range(n):
            for _ in range(int(rng.integers(0 if kind == "mixed" else 1,
                                            space.max_decodes + 1))):
                ctx = int(rng.integers(1, space.max_context))
                tokens = ids(ctx + 1)
                pages: tuple[int, ...] = ()
                if blocks is not None:
                    blocks.transition(rid, r, ctx + 1)
                    pages = blocks.decode_pages(rid)
                slots.append(DecodeSlot(rid, r, position=ctx,
                                        token_id=tokens[-1] if tokens else 0, pages=pages))
                rid += 1
    if kind in ("prefill", "mixed"):
        room = space.tokens_per_rank
        load = [0] * n
        for s in slots:
            load[s.rank] += 1
        for _ in range(int(rng.integers(1, 3))):
            free = [room - x for x in load]
            length = int(rng.integers(1, min(space.max_chunk, sum(free)) + 1))
            max_ctx = space.max_context
            history = int(rng.integers(0, max_ctx - length)) if max_ctx > length + 1 else 0
            weights = rng.dirichlet(np.ones(n))
            counts = np.minimum(np.floor(weights * length).astype(int), free)
            while counts.sum() < length:  # top up the ranks that still have room
                r = int(rng.choice([i for i in range(n) if counts[i] < free[i]]))
                counts[r] += 1
            tokens = ids(history + length)
            # Half the chunks finish their prompt: sampled, and (N > 1) their KV moves to a
            # decode rank in the same step, a cost the fit must see.
            completes = bool(rng.random() < 0.5)
            rank = int(rng.integers(0, n)) if completes else None
            views: tuple[tuple[int, ...], ...] = ()
            decode_view: tuple[int, ...] = ()
            if blocks is not None:
                blocks.allocate_prefill(rid, history + length)
                views = blocks.prefill_pages(rid)
                if rank is not None:
                    blocks.transition(rid, rank, history + length, keep_prefill=True)
                    decode_view = blocks.decode_pages(rid)
            pieces.append(PrefillPiece(rid, history, tuple(int(c) for c in counts),
                                       completes, rank, token_ids=tuple(tokens[history:]),
                                       pages=views, decode_pages=decode_view))
            load = [a + int(c) for a, c in zip(load, counts, strict=True)]
            rid += 1
    return IterationPlan(tuple(pieces), tuple(slots), 0.0)


def release(blocks: BlockManager | None, plan: IterationPlan) -> None:
    if blocks is not None:
        for rid in set(plan.request_ids):
            blocks.free(rid)


def wall_time(ex: Executor, plan: IterationPlan) -> float:
    """Seconds of one run of ``plan`` on the wall clock."""
    gc.collect()  # a collection inside a timed run is the interpreter's, not the step's
    gc.disable()
    try:
        t = time.perf_counter()
        ex.execute(plan)
        return time.perf_counter() - t
    finally:
        gc.enable()


def reported_time(ex: Executor, plan: IterationPlan) -> float:
    """The latency the executor reports for ``plan`` (a simulated executor's clock)."""
    return ex.execute(plan).latency_s


def _reduce(times: list[float], statistic: str) -> float:
    return min(times) if statistic == "min" else statistics.median(times)


def profile(ex: Executor, space: ProfileSpace, num_train: int, num_test: int, repeats: int,
            seed: int, *, blocks: BlockManager | None = None,
            timer: Callable[[Executor, IterationPlan], float] = wall_time,
            statistic: str = "min", progress: bool = True
            ) -> tuple[list[ProfileSample], list[ProfileSample]]:
    """Time ``num_train + num_test`` random batches, ``repeats`` times each, in rounds.

    Batches are timed in random order (a machine whose speed drifts would otherwise time
    every held-out batch after every training batch and bias the MAPE), and a batch's
    repeats are spread over the run, one per round (back-to-back repeats all fall into
    the same slow phase of a shared machine; across rounds the fastest escapes it). Each
    batch is drawn from its own seed, so every round re-creates it exactly. ``blocks``
    (a :class:`BlockManager` for the executor's KV pool) allocates the batches' pages.
    """
    from tqdm.auto import tqdm

    jobs = [("train", KINDS[i % 3]) for i in range(num_train)] + \
        [("test", "mixed" if i % 2 else KINDS[i % 3]) for i in range(num_test)]
    jobs = [jobs[i] for i in np.random.default_rng(seed).permutation(len(jobs))]
    times: list[list[float]] = [[] for _ in jobs]
    shapes: list[BatchShape | None] = [None] * len(jobs)
    bar = tqdm(total=repeats * len(jobs), desc="profiling", disable=not progress)
    for rnd in range(repeats):
        for j, (_, kind) in enumerate(jobs):
            plan = random_plan(np.random.default_rng([seed, j]), kind, ex.num_ranks, space,
                               blocks)
            if rnd == 0:
                ex.execute(plan)  # first run may compile
                shapes[j] = BatchShape.from_plan(plan, ex.num_ranks)
            times[j].append(timer(ex, plan))
            release(blocks, plan)
            bar.update()
    bar.close()
    samples: dict[str, list[ProfileSample]] = {"train": [], "test": []}
    for (split, _), shape, ts in zip(jobs, shapes, times, strict=True):
        assert shape is not None
        samples[split].append(ProfileSample(shape, _reduce(ts, statistic)))
    return samples["train"], samples["test"]
