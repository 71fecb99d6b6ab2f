"""The contract between the host scheduler and an executor (real JAX or simulated).

One XP instance has N logical ranks (the mesh's ``sp`` axis). Every iteration the
scheduler emits one :class:`IterationPlan`; the executor runs it and returns a
:class:`StepResult`. The scheduler owns every decision (which tokens, which rank, which
KV pages); the executor only executes, and reads nothing but the plan: token ids, page
ids and sampling parameters all travel in it (as vLLM's scheduler output does).

Plan semantics
--------------
* A :class:`PrefillPiece` is one chunk of one request's prompt. ``counts[r]`` tokens of
  the chunk run on rank r, in rank order: rank 0 holds the first ``counts[0]`` tokens of
  the chunk, rank 1 the next ``counts[1]``, and so on. ``start`` is the number of prompt
  tokens already prefilled (and resident in KV) before this chunk, so the chunk covers
  prompt positions ``[start, start + sum(counts))``; ``token_ids`` are those tokens. Its
  KV is written head-sharded on every rank (the prefill view of the pages, DESIGN.md §3)
  into ``pages[r]``.
* ``completes`` means this chunk finishes the prompt: the executor samples the first
  output token from the chunk's last position and moves the request's KV (all heads,
  positions ``[resident_tokens, start + length)``, one page group per entry of
  ``pages[r]``) into ``decode_pages`` on rank ``decode_rank``.
* A chunk with ``load_pages`` starts after a prefix-cache hit: before its attention the
  executor copies each rank's head shard of the cached KV (positions ``[0, start)``,
  full-head decode pages on ``load_rank``) into that rank's prefill pages.
* A :class:`LocalPrefill` is the whole uncached suffix of a prompt whose cached prefix
  (``start`` tokens, already in the head of ``pages``: full-head decode pages on
  ``rank``) is on the rank that will decode it. It runs on that rank alone, in the decode
  slice: each suffix token is one decode row over the same pages (attention over the
  prefix plus the suffix up to itself), with no load and no transfer; the last position
  samples the first output token and the request then decodes on ``rank``.
* A :class:`DecodeSlot` advances one resident decode on its rank by one token: the
  request's last sampled token ``token_id`` is written to KV at ``position`` (the current
  KV length) in ``pages`` and the next token is sampled.
* ``released`` lists requests whose executor-side state (if an executor keeps any) is
  dropped *before* running the plan (finished, aborted or preempted requests; their pages
  are already back in the free lists). A preempted request later reappears as a prefill
  piece with ``start == 0`` over its prompt plus the tokens it had generated (recompute).
* ``mode`` says which execution path the plan needs:
  - ``"conflux"``: co-batched prefill (Ulysses-SP) + rank-local decode (the default);
  - ``"tp_chunked"``: uniform-TP chunked prefill; the instance is built with ``N == 1``
    logical rank spanning all GPUs as one TP group (so counts have length 1 and every
    decode lives on rank 0);
  - ``"isolated_prefill"`` / ``"isolated_decode"``: phase-isolated SP iterations
    (LoongServe-like): a plan holds only prefill pieces or only decode slots.
* ``token_masks`` holds the allowed-token bitmask of each grammar-constrained request
  that samples this iteration (computed on the host from the request's committed
  tokens); ``histories`` the prompt and output token ids of each penalized one.
* In simulation requests have no token ids: ``token_ids`` is empty and ``token_id`` 0, and
  the simulated executor reads only the lengths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np

PlanMode = Literal["conflux", "tp_chunked", "isolated_prefill", "isolated_decode"]


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingSpec:
    """How the device samples a request's next token (the sampler's per-row inputs).

    ``temperature == 0`` is greedy; ``top_k <= 0`` and ``top_p == 1`` disable those
    filters; ``seed`` keys the request's random stream (with the output index). The
    penalties are vLLM's (neutral: 0, 0, 1); a penalized request's tokens travel in
    ``IterationPlan.histories``. ``min_p`` 0 is off; ``logit_bias`` holds the (token,
    value) pairs added to the logits (the +-100 ones travel as the token mask).
    ``top_logprobs`` > 0: the request wants that many alternatives' logprobs per token (a
    step computes the top alternatives only when one of its rows does).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int = 0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


GREEDY = SamplingSpec()


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillPiece:
    """One prefill chunk of one request, split over ranks (see the module docstring)."""

    request_id: int
    start: int
    counts: tuple[int, ...]
    completes: bool = False
    decode_rank: int | None = None
    token_ids: tuple[int, ...] = ()  # i32[length]: positions [start, start + length)
    pages: tuple[tuple[int, ...], ...] = ()  # i32[N, pages]: prefill-view page ids per rank
    decode_pages: tuple[int, ...] = ()  # i32[pages] on decode_rank (completing chunks)
    sampling: SamplingSpec = GREEDY
    sample_step: int = 0  # index of the output token a completing chunk samples
    # Prefix cache. The first chunk after a hit loads the cached KV of positions
    # [0, start) from decode-view pages ``load_pages`` on ``load_rank`` into ``pages``;
    # a completing chunk's first ``resident_tokens`` positions are already in its
    # decode pages (the cached prefix on its decode rank) and are not moved.
    load_rank: int | None = None
    load_pages: tuple[int, ...] = ()  # i32[start / page_size] on load_rank
    resident_tokens: int = 0

    @property
    def length(self) -> int:
        return sum(self.counts)


@dataclasses.dataclass(frozen=True, slots=True)
class LocalPrefill:
    """A prompt's uncached suffix prefilled on its decode rank (see the module docstring)."""

    request_id: int
    rank: int
    start: int  # cached prefix tokens, resident in the head of ``pages``
    token_ids: tuple[int, ...] = ()  # i32[length]: positions [start, start + length)
    pages: tuple[int, ...] = ()  # i32[pages]: decode-view page ids on ``rank``
    sampling: SamplingSpec = GREEDY
    sample_step: int = 0  # index of the output token it samples
    length: int = 0  # suffix tokens (== len(token_ids) when the plan carries token ids)


class DecodeSlot(NamedTuple):
    """Advance resident decode ``request_id`` on ``rank`` by one token.

    A NamedTuple, not a frozen dataclass: every resident decode gets a new slot every
    iteration, and a frozen dataclass costs 6x more to build on that hot path.
    """

    request_id: int
    rank: int
    position: int = 0  # KV length before this token = the position ``token_id`` is fed at
    token_id: int = 0  # the request's last sampled token
    pages: tuple[int, ...] = ()  # i32[pages]: decode-view page ids on ``rank``
    sampling: SamplingSpec = GREEDY
    sample_step: int = 0  # index of the output token this slot samples


@dataclasses.dataclass(frozen=True, slots=True)
class IterationPlan:
    """Everything one iteration runs. Built by the scheduler, consumed by an executor."""

    prefill: tuple[PrefillPiece, ...]
    decode: tuple[DecodeSlot, ...]
    estimated_latency_s: float
    mode: PlanMode = "conflux"
    local_prefill: tuple[LocalPrefill, ...] = ()
    released: tuple[int, ...] = ()
    preempted: tuple[int, ...] = ()  # subset of ``released``: these will be recomputed
    fits_slo: bool = True  # the scheduler's claim: estimated latency <= TBT SLO
    # request id -> i32[ceil(V/32)] packed allowed-token bitmask (grammar-constrained rows)
    token_masks: Mapping[int, np.ndarray] = dataclasses.field(default_factory=dict)
    # request id -> (prompt ids i32[Lp], output ids i32[Lo]) of penalized requests
    histories: Mapping[int, tuple[Sequence[int], Sequence[int]]] = \
        dataclasses.field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode and not self.local_prefill

    @property
    def request_ids(self) -> list[int]:
        """Every request this plan runs (prefill pieces first)."""
        return [p.request_id for p in self.prefill] + \
            [p.request_id for p in self.local_prefill] + [d.request_id for d in self.decode]

    @property
    def sampling_ids(self) -> list[int]:
        """The requests that sample a token this iteration: completing prefill pieces,
        local prefills and decode slots."""
        return [p.request_id for p in self.prefill if p.completes] + \
            [p.request_id for p in self.local_prefill] + [d.request_id for d in self.decode]

    def prefill_per_rank(self, num_ranks: int) -> list[int]:
        """Prefill tokens n_p^r per rank."""
        load = [0] * num_ranks
        for p in self.prefill:
            if len(p.counts) != num_ranks:
                raise ValueError(f"prefill piece of request {p.request_id} has "
                                 f"{len(p.counts)} rank counts for {num_ranks} ranks")
            for r, c in enumerate(p.counts):
                load[r] += c
        return load

    def decode_per_rank(self, num_ranks: int) -> list[int]:
        """Decode-slice tokens n_d^r per rank (decode slots and local prefill tokens)."""
        load = [0] * num_ranks
        for d in self.decode:
            load[d.rank] += 1
        for p in self.local_prefill:
            load[p.rank] += p.length
        return load


class SampledToken(NamedTuple):
    """One sampled token: its id, log-probability and the top alternatives (best first).

    A NamedTuple, as ``DecodeSlot``: one is built per sampling row every iteration. ``top``
    is read-only (rows that asked for no alternatives share one empty mapping).
    """

    token: int
    logprob: float = 0.0
    top: Mapping[int, float] = MappingProxyType({})


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """What one executed iteration produced.

    ``sampled`` maps every request that sampled this iteration (``plan.sampling_ids``)
    to its new token. ``latency_s`` is the iteration's wall (or virtual)
    duration and ``end_s`` the executor clock when it finished.
    """

    sampled: Mapping[int, SampledToken]
    latency_s: float
    end_s: float

    @property
    def tokens(self) -> dict[int, int]:
        return {rid: s.token for rid, s in self.sampled.items()}


@dataclasses.dataclass(frozen=True, slots=True)
class KVSpec:
    """KV capacity of one XP instance: ``num_pages`` pages of ``page_size`` tokens per rank."""

    num_ranks: int
    num_pages: int
    page_size: int

    @property
    def tokens_per_rank(self) -> int:
        return self.num_pages * self.page_size


class KVLost(RuntimeError):
    """A step failed after the executor had handed its KV state to the device (the JAX
    executor donates its pools to the compiled call, so a failure there deletes them).
    The executor has rebuilt that state empty and can run the next plan, but every
    request that held KV has lost it and must be recomputed."""


class ExecutorLost(RuntimeError):
    """The executor can run no more steps: a process of a multi-process instance died or
    left, so the mesh the steps run on is gone. Unlike a failed step (which fails only its
    own requests), this fails the instance; the caller stops serving."""


# Completes a plan with what only the caller knows (grammar masks: ``token_masks``),
# called by the executor once the device is busy with the plan's forward.
Preparer = Callable[[IterationPlan], IterationPlan]


@runtime_checkable
class Executor(Protocol):
    """Runs iteration plans on its own clock: the JAX executor on the wall clock, the
    simulated one on a virtual clock. The engine's driver loop takes either."""

    @property
    def num_ranks(self) -> int: ...

    @property
    def kv(self) -> KVSpec: ...

    def now(self) -> float:
        """The executor's clock (seconds): when the next plan would start."""
        ...

    def execute(self, plan: IterationPlan, prepare: Preparer | None = None) -> StepResult:
        """Run ``plan``, completed by ``prepare`` (when given) before it samples. Raises
        :class:`KVLost` when a failure cost the executor its KV, :class:`ExecutorLost`
        when the executor cannot run any further plan."""
        ...


class RunningStep(Protocol):
    """A plan an executor has set running (``launch``): the device computes it while the
    host goes on; ``result()`` waits for it."""

    def result(self) -> StepResult:
        """The plan's result, once the device has it. Raises as ``Executor.execute``."""
        ...


class LaunchingExecutor(Executor, Protocol):
    """An executor that can return before its device has finished a plan, so that the
    host works on the previous plan's outputs meanwhile (the engine's async scheduling)."""

    def launch(self, plan: IterationPlan, prepare: Preparer | None = None) -> RunningStep:
        """Start ``plan`` (as ``execute`` runs it) without waiting for its result. Raises
        as ``execute`` for failures found before the device has it."""
        ...


class BuildingExecutor(LaunchingExecutor, Protocol):
    """A launching executor that can also make a plan's step ahead, before the previous
    plan's tokens are known (the engine's planning ahead, part of async scheduling)."""

    def build(self, plan: IterationPlan, tokens: Callable[[], Sequence[int]]) -> None:
        """Make ``plan``'s step (its fixed-shape inputs) now, while the device still runs
        the previous plan, whose samples the decode slots of ``plan`` take: the next
        ``launch(plan)`` feeds them ``tokens()`` (one per slot, ``plan.decode`` order)
        and starts it. Only for plans that need no ``Preparer`` and carry no penalty
        histories. Raises as ``launch``."""
        ...

    def feeds_ahead(self, plan: IterationPlan, after: RunningStep) -> bool:
        """Can ``launch(plan, after=after)`` start ``plan``, made by ``build``, while
        ``after`` (the plan launched last) still runs, its decode slots taking ``after``'s
        samples on the device rather than through the host?"""
        ...

    def launch(self, plan: IterationPlan, prepare: Preparer | None = None,
               after: RunningStep | None = None) -> RunningStep:
        """As ``LaunchingExecutor.launch``; with ``after`` (where ``feeds_ahead``), the
        decode slots of the built ``plan`` take ``after``'s samples on the device."""
        ...
