"""Fixed-shape buckets: the JAX counterpart of CUDA graphs.

Every iteration is padded to one ``StepShape``; each distinct shape is one AOT-compiled
executable. The token buffer ``tokens`` follows the combined per-rank load
``max_r (n_p^r + n_d^r)`` that waterfill balances; the prefill slice (first ``prefill``
slots of the buffer, all-to-all'd) and the decode slice (``decode`` slots gathered by
index) have their own buckets inside it.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    tokens: int  # T: token-buffer slots per rank
    prefill: int  # P: prefill slots per rank (0 = no prefill this iteration)
    decode: int  # D: decode slots per rank
    decode_pages: int  # Wd: page-table width of decode sequences
    # X: page groups that completing prefills move to their decode ranks this step, padded
    # to a transfer bucket; 0 (no completion) compiles no transfer at all.
    transfer: int


@dataclasses.dataclass(frozen=True)
class BucketConfig:
    """Sorted bucket sets. The largest transfer and the prefill page-table width derive from
    the context (the planner caps ``transfer`` at one max-length request's page groups)."""

    # Small first buckets matter on CPU, where padded rows cost real FLOPs. A bucket of 1
    # serves decode-only steps of one sequence per rank: one row runs XLA's matrix-vector
    # path, ~1.4x faster than four rows on CPU. Prefill steps skip it (see shape_for).
    # 128 between 64 and 256: without it a lone 128-token prompt ran a 256-row step.
    # 512 on top: the CPU GEMM runs more FLOP/s at 512 rows than at 256 (and less at 1024,
    # where x leaves L2): 16 streams of 128-token prompts 1.13x faster (bench/RESULTS.md).
    tokens: tuple[int, ...] = (1, 4, 16, 64, 128, 256, 512)
    decode: tuple[int, ...] = (1, 4, 16, 64)
    # The attention ops' cost follows live KV lengths, not the table width, so one
    # width (the max context) is the default; more widths trade compiles for gathers.
    decode_pages: tuple[int, ...] = (1 << 30,)
    # Page groups moved to decode ranks. Coarse on purpose: each bucket multiplies the
    # prefill executables, and the transfer sends only the real groups (ragged all-to-all),
    # so padding here costs buffer memory, not link bytes.
    transfer: tuple[int, ...] = (1, 8, 64, 512)
    max_prefill_seqs: int = 8

    def __post_init__(self) -> None:
        for name in ("tokens", "decode", "decode_pages", "transfer"):
            values = getattr(self, name)
            if not values or list(values) != sorted(set(values)) or values[0] < 1:
                raise ValueError(f"bucket set {name} must be sorted, distinct and positive")
        if self.max_prefill_seqs < 1:
            raise ValueError("max_prefill_seqs must be positive")

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]


def _at_least(values: tuple[int, ...], n: int, what: str) -> int:
    i = bisect.bisect_left(values, n)
    if i == len(values):
        raise ValueError(f"{what} needs {n} but the largest bucket is {values[-1]}")
    return values[i]


@dataclasses.dataclass(frozen=True)
class ShapePlanner:
    """Chooses the step shape for an iteration and lists every shape the engine can emit."""

    buckets: BucketConfig
    max_pages_per_seq: int  # decode view, from the max model length
    transfer_groups: int  # the largest X: page groups of one max-length request

    def shape_for(self, prefill_max: int, decode_max: int, combined_max: int,
                  decode_pages_max: int, transfer_max: int = 0) -> StepShape:
        """The smallest shape holding the loads; ``transfer_max`` is the page groups the
        step's completing prefills move (0 when none completes)."""
        b = self.buckets
        # A prefill step asks for at least two slots, so single-row buckets only ever run
        # decode-only steps: one more executable instead of one per prefill shape.
        least = 2 if prefill_max else 1
        tokens = _at_least(b.tokens, max(combined_max, least), "the token buffer")
        prefill = 0 if prefill_max == 0 else tokens
        decode = _at_least(b.decode, max(decode_max, least), "decode slots")
        pages = min(_at_least(self.decode_page_buckets(), max(decode_pages_max, 1),
                              "decode pages per sequence"), self.max_pages_per_seq)
        if transfer_max and not prefill_max:
            raise ValueError("a step without prefill has no KV to transfer")
        transfer = _at_least(self.transfer_buckets(), transfer_max, "the KV transfer") \
            if transfer_max else 0
        return StepShape(tokens, prefill, decode, pages, transfer)

    def decode_page_buckets(self) -> tuple[int, ...]:
        return _capped(self.buckets.decode_pages, self.max_pages_per_seq)

    def transfer_buckets(self) -> tuple[int, ...]:
        return _capped(self.buckets.transfer, self.transfer_groups)

    def all_shapes(self) -> list[StepShape]:
        """Every shape ``shape_for`` can return: what warm-up compiles.

        ``shape_for`` is a step function of the loads, so evaluating it at the bucket
        boundaries (and one either side) reaches every shape it can produce.
        """
        b = self.buckets
        edges = {0, 1}
        for v in (*b.tokens, *b.decode):
            edges |= {v - 1, v, v + 1}
        max_t, max_d = b.tokens[-1], b.decode[-1]
        decodes = sorted(e for e in edges if 0 <= e <= min(max_d, max_t))
        combined = sorted(e for e in edges if 1 <= e <= max_t)
        pages = sorted({1, *self.decode_page_buckets()})
        transfers = (0, *self.transfer_buckets())
        shapes = set()
        for n_d, total, w, x in itertools.product(decodes, combined, pages, transfers):
            if total >= n_d and (x == 0 or total > n_d):
                shapes.add(self.shape_for(total - n_d, n_d, total, w if n_d else 1, x))
        return sorted(shapes)


def _capped(values: tuple[int, ...], cap: int) -> tuple[int, ...]:
    """``values`` capped at ``cap``, with ``cap`` itself always present (the largest need)."""
    capped = sorted({min(v, cap) for v in values})
    if capped[-1] < cap:
        capped.append(cap)
    return tuple(capped)


def pages_needed(tokens: int, page_size: int) -> int:
    return max(1, math.ceil(tokens / page_size))
