"""The contract between the host scheduler and an executor (real JAX or simulated).

One XP instance has N logical ranks (the mesh's ``sp`` axis). Every iteration the
scheduler emits one :class:`IterationPlan`; the executor runs it and returns a
:class:`StepResult`. The scheduler owns every decision (which tokens, which rank, which
KV pages); the executor only executes.

Plan semantics
--------------
* A :class:`PrefillPiece` is one chunk of one request's prompt. ``counts[r]`` tokens of
  the chunk run on rank r, in rank order: rank 0 holds the first ``counts[0]`` tokens of
  the chunk, rank 1 the next ``counts[1]``, and so on. ``start`` is the number of prompt
  tokens already prefilled (and resident in KV) before this chunk, so the chunk covers
  prompt positions ``[start, start + sum(counts))``. Its KV is written head-sharded on
  every rank (the prefill view of the pages, DESIGN.md §3).
* ``completes`` means this chunk finishes the prompt: the executor samples the first
  output token from the chunk's last position and moves the request's KV (all heads,
  positions ``[0, start + length)``) to rank ``decode_rank``, whose decode pages the
  block manager has already allocated before the plan is emitted.
* A :class:`DecodeSlot` advances one resident decode on its rank by one token: the
  request's last sampled token is written to KV at position ``kv_len`` (the current KV
  length) and the next token is sampled.
* ``released`` lists requests whose device-side state the executor must drop *before*
  running the plan (finished, aborted or preempted requests; their pages are already
  back in the free lists). A preempted request later reappears as a prefill piece with
  ``start == 0`` over its prompt plus the tokens it had generated (recompute).
* ``mode`` says which execution path the plan needs:
  - ``"conflux"``: co-batched prefill (Ulysses-SP) + rank-local decode (the default);
  - ``"tp_chunked"``: uniform-TP chunked prefill; the instance is built with ``N == 1``
    logical rank spanning all GPUs as one TP group (so counts have length 1 and every
    decode lives on rank 0);
  - ``"isolated_prefill"`` / ``"isolated_decode"``: phase-isolated SP iterations
    (LoongServe-like): a plan holds only prefill pieces or only decode slots.
* KV page tables are not in the plan: the executor reads them from the shared
  :class:`~conflux_jax.executor.block_manager.BlockManager` (``page_table(request_id)``),
  which the scheduler has updated for this plan. Token ids and sampling parameters live
  with the engine's request objects, keyed by ``request_id``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal, Protocol, runtime_checkable

PlanMode = Literal["conflux", "tp_chunked", "isolated_prefill", "isolated_decode"]
PLAN_MODES: tuple[str, ...] = ("conflux", "tp_chunked", "isolated_prefill", "isolated_decode")


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillPiece:
    """One prefill chunk of one request, split over ranks (see the module docstring)."""

    request_id: int
    start: int
    counts: tuple[int, ...]
    completes: bool = False
    decode_rank: int | None = None

    @property
    def length(self) -> int:
        return sum(self.counts)

    def attention_work(self) -> float:
        """Causal attention workload l*(c + (l+1)/2) of this chunk (Appendix D, Eq. 9)."""
        n = self.length
        return n * (self.start + (n + 1) / 2)


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeSlot:
    """Advance resident decode ``request_id`` on ``rank`` by one token."""

    request_id: int
    rank: int


@dataclasses.dataclass(frozen=True, slots=True)
class IterationPlan:
    """Everything one iteration runs. Built by the scheduler, consumed by an executor."""

    prefill: tuple[PrefillPiece, ...]
    decode: tuple[DecodeSlot, ...]
    estimated_latency_s: float
    mode: PlanMode = "conflux"
    released: tuple[int, ...] = ()
    preempted: tuple[int, ...] = ()  # subset of ``released``: these will be recomputed
    fits_slo: bool = True  # the scheduler's claim: estimated latency <= TBT SLO

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    def tokens_per_rank(self, num_ranks: int) -> list[int]:
        """Combined load n_p^r + n_d^r per rank (the bucket the executor pads to)."""
        load = [0] * num_ranks
        for p in self.prefill:
            for r, c in enumerate(p.counts):
                load[r] += c
        for d in self.decode:
            load[d.rank] += 1
        return load


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """What one executed iteration produced.

    ``tokens`` maps every request that sampled this iteration (completing prefills and
    all decode slots) to its new token id. ``latency_s`` is the iteration's wall (or
    virtual) duration and ``end_s`` the executor clock when it finished.
    """

    tokens: Mapping[int, int]
    latency_s: float
    end_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class KVSpec:
    """KV capacity of one XP instance: ``num_pages`` pages of ``page_size`` tokens per rank."""

    num_ranks: int
    num_pages: int
    page_size: int

    @property
    def tokens_per_rank(self) -> int:
        return self.num_pages * self.page_size


@runtime_checkable
class Executor(Protocol):
    """Runs iteration plans. Implemented by ``SimExecutor`` and the real JAX executor."""

    @property
    def num_ranks(self) -> int: ...

    @property
    def kv(self) -> KVSpec: ...

    def execute(self, plan: IterationPlan) -> StepResult: ...
