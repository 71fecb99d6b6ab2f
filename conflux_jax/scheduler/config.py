"""Scheduler configuration and the named policies used in comparisons."""

from __future__ import annotations

import dataclasses
from typing import Literal

Order = Literal["slo", "fcfs", "srpt"]
Mode = Literal["conflux", "tp_chunked", "isolated"]


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """How one instance schedules.

    ``order``: "slo" = Moore–Hodgson admission, EDF then SJF backfill (ConfluxServe);
    "fcfs" = arrival order (the "-FCFS" variants); "srpt" = fewest remaining prefill
    tokens first (the "++" variants).
    ``mode``: "conflux" = co-batched XP with waterfill dispatch; "tp_chunked" = Sarathi /
    vLLM chunked prefill on one uniform-TP rank with a fixed ``token_budget``;
    "isolated" = phase-isolated elastic SP (LoongServe-like): an iteration runs either
    prefill chunks over all ranks or the resident decodes, prefill first.
    """

    tbt_slo_s: float
    ttft_slo_s: float
    order: Order = "slo"
    mode: Mode = "conflux"
    quantum: int = 16
    max_tokens_per_rank: int = 8192  # largest per-rank token bucket
    eta: float = 0.9  # KV utilisation threshold of dual-mode placement
    headroom_pages: int = 4  # KV headroom kept on a rank when placing a decode
    token_budget: int = 2048  # tp_chunked: tokens per iteration incl. decodes
    # Executor shape limits (the real executor's buckets); None = unlimited.
    max_prefill_pieces: int | None = None  # prefill chunks per plan
    max_decodes_per_rank: int | None = None  # resident decodes a rank may host
    # KV page groups (prefill-view pages per rank) one iteration may move to decode ranks.
    max_transfer_groups: int | None = None
    # Bounded waiting: a request still waiting ``overdue_grace_s`` past its TTFT deadline
    # (None = the instance's TTFT SLO; math.inf = never, the paper's policy) is served
    # first, oldest first; the oldest gets at least ``overdue_min_chunk`` tokens every
    # iteration and no younger request takes the KV pages it waits for.
    overdue_grace_s: float | None = None
    overdue_min_chunk: int = 16
    # Liveness of prefill: while prompts wait, every iteration runs at least this many
    # prefill tokens (of its first candidate), even when the resident decodes already fill
    # the TBT budget; 0 = none (the paper's policy: prefill waits for budget). An idle
    # instance always runs one ``quantum``.
    min_prefill_chunk: int = 0
    # Automatic prefix caching (vLLM's default): prompts reuse cached KV of full pages.
    enable_prefix_caching: bool = True
    # A hit whose uncached suffix the owner rank can take whole this iteration prefills it
    # there alone (decode-slice rows over the cached pages: no load, no transfer) when the
    # latency model prices that at most the load + Ulysses path (``LocalPrefill``).
    local_prefill: bool = True

    def __post_init__(self) -> None:
        if self.order not in ("slo", "fcfs", "srpt"):
            raise ValueError(f"unknown order {self.order!r}")
        if self.mode not in ("conflux", "tp_chunked", "isolated"):
            raise ValueError(f"unknown mode {self.mode!r}")
        if self.tbt_slo_s <= 0 or self.ttft_slo_s <= 0:
            raise ValueError("SLOs must be positive")
        if self.overdue_grace_s is not None and not self.overdue_grace_s >= 0:
            raise ValueError("overdue_grace_s must be non-negative")
        if self.overdue_min_chunk < 1:
            raise ValueError("overdue_min_chunk must be positive")
        if self.min_prefill_chunk < 0:
            raise ValueError("min_prefill_chunk must be non-negative")
