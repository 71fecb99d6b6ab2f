"""Request descriptions (immutable) and the scheduler's per-request state (mutable)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from conflux_jax.plan import GREEDY, SamplingSpec

Phase = Literal["waiting", "prefill", "decode", "done"]


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """What the scheduler needs to know about a request: id, arrival and lengths.

    ``ttft_slo_s``/``tbt_slo_s`` override the instance's SLOs for this request (the
    server's per-request SLO extension); None = the instance default.
    ``cached_prefix``: leading prompt tokens assumed already cached by an *unbounded*
    free cache (the simulator's labelled upper bound only; the real prefix cache is the
    block manager's). ``prompt_token_ids`` and ``sampling`` travel into the plans (the
    executor reads nothing else); simulated requests have no token ids, and may name
    their prompt's content by ``block_ids`` instead (a trace's hash ids, one per
    ``block_tokens`` tokens) so the prefix cache can still match them.
    ``cache_salt`` isolates tenants: prompts share cached KV only with the same salt.
    """

    id: int
    arrival_s: float
    prompt_len: int
    max_new_tokens: int
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    cached_prefix: int = 0
    prompt_token_ids: tuple[int, ...] = ()
    sampling: SamplingSpec = GREEDY
    cache_salt: str = ""
    block_ids: tuple[int, ...] = ()
    block_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.max_new_tokens < 1:
            raise ValueError(f"request {self.id}: prompt_len and max_new_tokens must be >= 1")
        if not 0 <= self.cached_prefix < self.prompt_len:
            raise ValueError(f"request {self.id}: cached_prefix must be in [0, prompt_len)")
        if self.prompt_token_ids and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(f"request {self.id}: {len(self.prompt_token_ids)} prompt token ids "
                             f"for prompt_len {self.prompt_len}")


@dataclasses.dataclass(slots=True, eq=False)
class RequestState:
    """Scheduling state. ``target`` is what must be prefilled: the prompt, plus the
    generated tokens after a recompute preemption."""

    req: Request
    deadline_s: float  # TTFT deadline: arrival + TTFT SLO
    target: int
    prefilled: int = 0
    generated: int = 0
    kv_len: int = 0  # tokens in decode KV (excludes the last sampled token)
    kv_cap: int = 0  # tokens the decode pages can hold
    rank: int = -1
    phase: Phase = "waiting"
    preemptions: int = 0
    pages: tuple[int, ...] = ()  # decode-view page ids (the block manager's snapshot)
    output_ids: list[int] = dataclasses.field(default_factory=list)  # sampled so far
    # Prefix cache: hashes of the full pages whose content is known so far, the cached
    # prefix this prefill found (``cache_pages`` on ``cache_rank``, loaded by its first
    # chunk) and how many prompt tokens the first prefill took from the cache.
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)
    cache_rank: int = -1
    cache_pages: tuple[int, ...] = ()
    cached: int = 0  # prefix tokens of the current prefill served by the cache
    cached_tokens: int = 0  # the same, of the first prefill (the usage statistic)

    @property
    def id(self) -> int:
        return self.req.id

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """Prompt-plus-output tokens ``[start, end)`` (recompute prefills cover outputs
        too); empty for simulated requests, which carry no token ids."""
        prompt = self.req.prompt_token_ids
        if not prompt:
            return ()
        if end <= len(prompt):
            return prompt[start:end]
        return (*prompt, *self.output_ids)[start:end]

    @property
    def remaining(self) -> int:
        return self.target - self.prefilled
