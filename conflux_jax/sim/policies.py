"""Named serving policies of the paper's comparisons, built as (scheduler, executor) pairs.

| name              | mode       | order | mesh on G GPUs             |
|-------------------|------------|-------|----------------------------|
| ConfluxServe      | conflux    | slo   | SP min(G,4) x base TP rest |
| ConfluxServe-FCFS | conflux    | fcfs  | same                       |
| ConfluxServe++    | conflux    | srpt  | same (ablation)            |
| Chunked           | tp_chunked | fcfs  | one TP-G rank (Sarathi)    |
| Chunked++         | tp_chunked | srpt  | same                       |
| LoongServe        | isolated   | fcfs  | SP min(G,4) x base TP rest |
| LoongServe++      | isolated   | srpt  | same                       |
| MuxWise-FCFS      | mux        | fcfs  | one TP-G rank, SM shares   |
| MuxWise++         | mux        | srpt  | same                       |
| DistServe         | disagg     | fcfs  | TP-G/2 prefill + TP-G/2 decode |
| DistServe++       | disagg     | srpt  | same                       |

The first seven run on the real executor's plan modes; MuxWise and DistServe exist in
the simulator only (:mod:`conflux_jax.sim.baselines`).

**Truth apart from estimate** (:mod:`conflux_jax.sim.calibrate`). The simulated executor's
clock is the design's truth: the roofline (or ``--coeffs``) with prefill and decode
attention serialized as our step runs them (``attention="paper"``: the paper's 1.28x
SM-partitioned overlap, for the paper's own system only), plus ``noise``. Every
model-driven scheduler plans with an estimate fitted to profiles of that truth
(``estimate="oracle"`` gives it the truth itself, the old self-grading setting).

**Baselines at their best**: each baseline's free parameter is a field here, swept per
workload and SLO by the benchmarks (:data:`SWEEPS`): Chunked's token budget, MuxWise's
decode headroom, DistServe's prefill:decode split.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

from conflux_jax.latency import LatencyModel, attention_work
from conflux_jax.latency.roofline import MODELS, kv_tokens_per_rank, roofline_model
from conflux_jax.plan import KVSpec
from conflux_jax.scheduler.block_manager import BlockManager
from conflux_jax.scheduler.config import SchedulerConfig
from conflux_jax.scheduler.request import Request
from conflux_jax.scheduler.router import Router
from conflux_jax.scheduler.scheduler import Scheduler
from conflux_jax.sim.baselines import MuxLatency, simulate_disaggregated
from conflux_jax.sim.calibrate import Estimate, fitted_estimate, oracle_estimate, sim_space
from conflux_jax.sim.driver import SimReport, simulate, simulate_routed
from conflux_jax.sim.executor import SimExecutor

POLICIES: dict[str, tuple[str, str]] = {
    "ConfluxServe": ("conflux", "slo"),
    "ConfluxServe-FCFS": ("conflux", "fcfs"),
    "ConfluxServe++": ("conflux", "srpt"),
    "Chunked": ("tp_chunked", "fcfs"),
    "Chunked++": ("tp_chunked", "srpt"),
    "LoongServe": ("isolated", "fcfs"),
    "LoongServe++": ("isolated", "srpt"),
    "MuxWise-FCFS": ("mux", "fcfs"),
    "MuxWise++": ("mux", "srpt"),
    "DistServe": ("disagg", "fcfs"),
    "DistServe++": ("disagg", "srpt"),
}

# Paper §8.1 SLOs (TTFT s, TBT s).
SLOS: dict[str, tuple[float, float]] = {
    "llama3.1-8b": (1.0, 0.05), "qwen3-14b": (2.0, 0.1), "qwen3-32b": (2.0, 0.1),
}

PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class DisaggSplit:
    """DistServe's placement: ``prefill_replicas`` instances of TP ``prefill_tp`` and
    ``decode_replicas`` of TP ``decode_tp``."""

    prefill_tp: int
    prefill_replicas: int
    decode_tp: int
    decode_replicas: int

    def __str__(self) -> str:
        return (f"{self.prefill_replicas}xTP{self.prefill_tp} prefill + "
                f"{self.decode_replicas}xTP{self.decode_tp} decode")


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    policy: str
    model: str
    hardware: str
    gpus: int
    ttft_slo_s: float
    tbt_slo_s: float
    coeffs: Path | None = None  # fitted JSON for the conflux mesh as truth; roofline if None
    truth: LatencyModel | None = None  # the clock itself (a hand-made model in tests)
    # The paper's policies may starve a late request (SJF / SRPT backfill); the serving
    # engine's bounded-waiting rule (SchedulerConfig.overdue_grace_s) is opt-in here.
    bounded_wait: bool = False
    noise: float = 0.0  # the truth's relative per-iteration jitter (std)
    estimate: str = "fitted"  # "fitted" to profiles of the truth, or "oracle" (the truth)
    attention: str = "serial"  # Conflux's attention phases: "serial" (ours) or "paper"
    seed: int = 0
    token_budget: int | None = None  # Chunked; None: the largest TBT-safe per the estimate
    mux_headroom: float = 0.05  # MuxWise: decode's SM share sized for (1 - this) * TBT
    split: DisaggSplit | None = None  # DistServe; None: the paper's TP-G/2 + TP-G/2
    # The engine's prefix cache, bounded by the simulated KV pool (requests that name
    # their blocks hit it); DistServe's prefill instances get the same cache.
    prefix_caching: bool = True
    # A hit's short suffix may run on its owner rank alone (SchedulerConfig.local_prefill).
    local_prefill: bool = True
    # Several identical instances behind the global router (scheduler.router policy).
    instances: int = 1
    router: str = "conflux"

    @property
    def mode(self) -> str:
        return POLICIES[self.policy][0]


def mesh_for(mode: str, gpus: int) -> tuple[int, int]:
    """(sp, tp) of one instance: SP up to 4 over base TP (paper §8.1), or pure TP."""
    if mode in ("tp_chunked", "mux"):
        return 1, gpus
    if mode == "disagg":
        return 1, max(1, gpus // 2)
    sp = min(gpus, 4)
    return sp, gpus // sp


def chunked_budget(model: LatencyModel, tbt_slo_s: float, ref_decodes: int = 64,
                   ref_ctx: int = 4096) -> int:
    """The largest multiple of 256 whose iteration (``ref_decodes`` decodes at ``ref_ctx``
    plus a fresh prefill chunk) ``model`` prices within the TBT SLO."""
    best = 256
    for budget in range(256, 65536 + 1, 256):
        chunk = budget - ref_decodes
        t = model.iteration(budget, chunk, attention_work(chunk, 0),
                            model.decode_path(ref_decodes * (ref_ctx + 1)))
        if t > tbt_slo_s:
            break
        best = budget
    return best


def truth_model(spec: InstanceSpec) -> LatencyModel:
    """The clock of ``spec``'s design (for MuxWise: of its uniform-TP rank)."""
    sp, tp = mesh_for(spec.mode, spec.gpus)
    if spec.truth is not None:
        return spec.truth
    if spec.coeffs is not None and spec.mode in ("conflux", "isolated"):
        return LatencyModel.load(spec.coeffs)
    # Only Conflux co-schedules two attention phases that an SM split could overlap.
    attention = spec.attention if spec.mode == "conflux" else "serial"
    return roofline_model(spec.model, spec.hardware, sp=sp, tp=tp, attention=attention)


def estimate_for(spec: InstanceSpec, truth: LatencyModel, tokens_per_rank: int) -> Estimate:
    if spec.estimate == "oracle":
        return oracle_estimate(truth, spec.noise)
    if spec.estimate != "fitted":
        raise ValueError(f"estimate must be 'fitted' or 'oracle', got {spec.estimate!r}")
    space = sim_space(min(MODELS[spec.model].max_context, PROFILE_CONTEXT), tokens_per_rank)
    return fitted_estimate(truth, space, spec.noise, spec.seed)


PROFILE_CONTEXT = 65536  # the longest context the simulated warm-up profiles


def build_instance(spec: InstanceSpec, noise_seed: int | None = None,
                   **overrides) -> tuple[Scheduler, SimExecutor]:  # noqa: ANN003
    """Scheduler + simulated executor for a policy (not DistServe: see ``run_policy``).
    ``noise_seed`` (default ``spec.seed``) seeds only the truth's jitter, so identical
    instances share one fitted estimate and differ only in their clocks' noise."""
    mode, order = POLICIES[spec.policy]
    if mode == "disagg":
        raise ValueError("DistServe runs two instances: use run_policy()")
    sp, tp = mesh_for(mode, spec.gpus)
    pages = kv_tokens_per_rank(spec.model, spec.hardware, tp) // PAGE_SIZE
    kw: dict = dict(tbt_slo_s=spec.tbt_slo_s, ttft_slo_s=spec.ttft_slo_s, order=order,
                    mode=mode, overdue_grace_s=None if spec.bounded_wait else math.inf,
                    enable_prefix_caching=spec.prefix_caching,
                    local_prefill=spec.local_prefill)
    if mode == "mux":
        kw["mode"] = "conflux"  # one TP rank whose largest TBT-safe chunk waterfill finds
        kw["max_tokens_per_rank"] = tokens_per_rank(mode)
        kw["local_prefill"] = False  # prefill stays in MuxWise's prefill partition
    kw.update(overrides)
    cfg = SchedulerConfig(**kw)
    truth = truth_model(spec)
    est = estimate_for(spec, truth, cfg.max_tokens_per_rank)
    clock: LatencyModel | MuxLatency = truth
    plan_with: LatencyModel | MuxLatency = est.model
    if mode == "mux":
        # Separate prefill/decode kernels on SM shares, the same split rule in both.
        clock = MuxLatency(truth, spec.tbt_slo_s, headroom=spec.mux_headroom)
        plan_with = MuxLatency(est.model, spec.tbt_slo_s, headroom=spec.mux_headroom)
    if mode == "tp_chunked" and "token_budget" not in overrides:
        budget = spec.token_budget or chunked_budget(est.model, spec.tbt_slo_s)
        cfg = dataclasses.replace(cfg, token_budget=budget)
    sched = Scheduler(cfg, plan_with, BlockManager(sp, pages, PAGE_SIZE))  # type: ignore[arg-type]
    ex = SimExecutor(clock, KVSpec(sp, pages, PAGE_SIZE), noise=spec.noise,  # type: ignore[arg-type]
                     seed=spec.seed if noise_seed is None else noise_seed)
    return sched, ex


def instance_report(spec: InstanceSpec) -> dict:
    """What ``spec``'s scheduler planned with and the settings it ran at (for the JSON)."""
    mode = spec.mode
    out: dict = {"attention": spec.attention if mode == "conflux" else "serial",
                 "truth_noise": spec.noise}
    if spec.instances > 1:
        out["instances"], out["router"] = spec.instances, spec.router
    if mode == "disagg":
        out["estimate"] = {"source": "none (batches by token count, not by a model)"}
        out["split"] = str(spec.split or default_split(spec.gpus))
        return out
    est = estimate_for(spec, truth_model(spec), tokens_per_rank(mode))
    # A copy: the fitted estimate (and its report) is cached and shared.
    out["estimate"] = {**est.report, "alpha": est.model.alpha, "beta": est.model.beta}
    if mode == "tp_chunked":
        out["token_budget"] = resolved(spec).token_budget
    if mode == "mux":
        out["mux_headroom"] = spec.mux_headroom
    return out


def tokens_per_rank(mode: str) -> int:
    """The scheduler's largest per-rank token load for a policy mode (MuxWise's one TP
    rank runs whole prefill chunks of up to 16K tokens)."""
    return 16384 if mode == "mux" else SchedulerConfig.max_tokens_per_rank


def default_split(gpus: int) -> DisaggSplit:
    half = max(1, gpus // 2)
    return DisaggSplit(half, 1, half, 1)


def disagg_splits(model: str, hardware: str, gpus: int) -> list[DisaggSplit]:
    """Every uniform-TP placement of ``gpus`` into prefill and decode instances whose TP
    degree divides the KV heads and whose weights fit (DistServe's placement search)."""
    shape = MODELS[model]
    out = []
    for tp in (1, 2, 4, 8):
        if tp > gpus // 2 or shape.num_kv_heads % tp:
            continue
        try:
            kv_tokens_per_rank(model, hardware, tp)
        except ValueError:  # the weights do not fit on tp GPUs
            continue
        replicas = gpus // tp
        out += [DisaggSplit(tp, k, tp, replicas - k) for k in range(1, replicas)]
    return out


def run_policy(spec: InstanceSpec, requests: list[Request]) -> SimReport:
    """Simulate ``requests`` under ``spec.policy`` and return the report."""
    mode, order = POLICIES[spec.policy]
    if mode == "disagg":
        if spec.instances > 1:
            raise ValueError("DistServe routes between its own prefill and decode replicas; "
                             "it does not run behind the global router")
        split = spec.split or default_split(spec.gpus)
        pre = roofline_model(spec.model, spec.hardware, sp=1, tp=split.prefill_tp)
        dec = roofline_model(spec.model, spec.hardware, sp=1, tp=split.decode_tp)
        shape = MODELS[spec.model]
        return simulate_disaggregated(
            requests, pre, dec, kv_tokens_per_rank(spec.model, spec.hardware, split.decode_tp),
            shape.kv_bytes_per_token_layer * shape.num_layers, spec.ttft_slo_s,
            spec.tbt_slo_s, order=order, prefill_replicas=split.prefill_replicas,
            decode_replicas=split.decode_replicas, noise=spec.noise, seed=spec.seed,
            prefill_kv_tokens=kv_tokens_per_rank(spec.model, spec.hardware, split.prefill_tp)
            if spec.prefix_caching else 0, page_size=PAGE_SIZE)
    if spec.instances > 1:
        # One estimate for all (the same model on the same hardware ships one fit: the
        # router compares their predictions), each truth with its own jitter.
        runs = [build_instance(spec, noise_seed=spec.seed + k) for k in range(spec.instances)]
        return simulate_routed(requests, runs, Router(spec.router), spec.ttft_slo_s,
                               spec.tbt_slo_s)
    sched, ex = build_instance(spec)
    return simulate(requests, sched, ex, spec.ttft_slo_s, spec.tbt_slo_s)


def resolved(spec: InstanceSpec) -> InstanceSpec:
    """``spec`` with its baseline's default setting made explicit: Chunked's budget derived
    from its estimate, DistServe's paper split."""
    if spec.mode == "tp_chunked" and spec.token_budget is None:
        est = estimate_for(spec, truth_model(spec), tokens_per_rank(spec.mode)).model
        return dataclasses.replace(spec, token_budget=chunked_budget(est, spec.tbt_slo_s))
    if spec.mode == "disagg" and spec.split is None:
        return dataclasses.replace(spec, split=default_split(spec.gpus))
    return spec


def sweep(spec: InstanceSpec) -> list[InstanceSpec]:
    """The settings a benchmark tries for ``spec``'s baseline."""
    mode = spec.mode
    if mode == "tp_chunked":
        budgets = sorted({resolved(spec).token_budget, *CHUNK_BUDGETS})
        return [dataclasses.replace(spec, token_budget=b) for b in budgets]
    if mode == "mux":
        return [dataclasses.replace(spec, mux_headroom=h) for h in MUX_HEADROOMS]
    if mode == "disagg":
        first = default_split(spec.gpus)
        splits = [s for s in disagg_splits(spec.model, spec.hardware, spec.gpus) if s != first]
        return [dataclasses.replace(spec, split=s) for s in [first, *splits]]
    return [spec]


def best_setting(spec: InstanceSpec, score: Callable[[InstanceSpec], tuple[float, ...]],
                 candidates: list[InstanceSpec] | None = None
                 ) -> tuple[InstanceSpec, list[dict]]:
    """The setting (of :func:`sweep` unless ``candidates`` are given) with the highest
    ``score`` (ties: the earlier one) and every setting's score, for the record."""
    tried = [(cand, score(cand)) for cand in (candidates or sweep(spec))]
    best = max(tried, key=lambda t: t[1])[0]  # max keeps the first of equal scores
    return best, [{"value": swept_value(c), "score": list(sc)} for c, sc in tried]


CHUNK_BUDGETS = (512, 1024, 2048, 4096, 8192)
MUX_HEADROOMS = (0.02, 0.05, 0.1, 0.2)


def swept_value(spec: InstanceSpec) -> str | int | float | None:
    """The value of the parameter :func:`sweep` varies (None for an untuned policy)."""
    return {"tp_chunked": spec.token_budget, "mux": spec.mux_headroom,
            "disagg": str(spec.split) if spec.split else None}.get(spec.mode)
