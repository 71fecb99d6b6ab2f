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
the simulator only (:mod:`conflux_jax.sim.baselines`). The chunked token budget
is chosen offline as the largest multiple of 256 whose iteration (64 decodes at 4K
context plus a fresh prefill chunk) meets the TBT SLO; the paper sweeps it per workload
instead.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from conflux_jax.latency import LatencyModel, attention_work
from conflux_jax.latency.roofline import MODELS, kv_tokens_per_rank, roofline_model
from conflux_jax.plan import KVSpec
from conflux_jax.scheduler.block_manager import BlockManager
from conflux_jax.scheduler.config import SchedulerConfig
from conflux_jax.scheduler.request import Request
from conflux_jax.scheduler.scheduler import Scheduler
from conflux_jax.sim.baselines import MuxLatency, simulate_disaggregated
from conflux_jax.sim.driver import SimReport, simulate
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
class InstanceSpec:
    policy: str
    model: str
    hardware: str
    gpus: int
    ttft_slo_s: float
    tbt_slo_s: float
    coeffs: Path | None = None  # fitted JSON for the conflux mesh; roofline if None
    # The paper's policies may starve a late request (SJF / SRPT backfill); the serving
    # engine's bounded-waiting rule (SchedulerConfig.overdue_grace_s) is opt-in here.
    bounded_wait: bool = False


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
    best = 256
    for budget in range(256, 65536 + 1, 256):
        chunk = budget - ref_decodes
        t = model.iteration(budget, chunk, attention_work(chunk, 0),
                            model.decode_path(ref_decodes * (ref_ctx + 1)))
        if t > tbt_slo_s:
            break
        best = budget
    return best


def build_instance(spec: InstanceSpec, **overrides) -> tuple[Scheduler, SimExecutor]:  # noqa: ANN003
    """Scheduler + simulated executor for a policy (not DistServe: see ``run_policy``)."""
    mode, order = POLICIES[spec.policy]
    if mode == "disagg":
        raise ValueError("DistServe runs two instances: use run_policy()")
    sp, tp = mesh_for(mode, spec.gpus)
    model: LatencyModel | MuxLatency
    if spec.coeffs is not None and mode in ("conflux", "isolated"):
        model = LatencyModel.load(spec.coeffs)
    else:
        model = roofline_model(spec.model, spec.hardware, sp=sp, tp=tp)
    pages = kv_tokens_per_rank(spec.model, spec.hardware, tp) // PAGE_SIZE
    kw: dict = dict(tbt_slo_s=spec.tbt_slo_s, ttft_slo_s=spec.ttft_slo_s, order=order,
                    mode=mode, overdue_grace_s=None if spec.bounded_wait else math.inf)
    if mode == "tp_chunked":
        kw["token_budget"] = chunked_budget(model, spec.tbt_slo_s)
    if mode == "mux":
        # Separate prefill/decode kernels on SM shares; scheduled as one TP rank whose
        # largest TBT-safe chunk is found by the (one-rank) waterfill search.
        model = MuxLatency(model, spec.tbt_slo_s)
        kw["mode"] = "conflux"
        kw["max_tokens_per_rank"] = 16384
    kw.update(overrides)
    cfg = SchedulerConfig(**kw)
    blocks = BlockManager(sp, pages, PAGE_SIZE)
    sched = Scheduler(cfg, model, blocks)  # type: ignore[arg-type]
    return sched, SimExecutor(model, KVSpec(sp, pages, PAGE_SIZE))  # type: ignore[arg-type]


def run_policy(spec: InstanceSpec, requests: list[Request]) -> SimReport:
    """Simulate ``requests`` under ``spec.policy`` and return the report."""
    mode, order = POLICIES[spec.policy]
    if mode == "disagg":
        _, tp = mesh_for(mode, spec.gpus)
        model = roofline_model(spec.model, spec.hardware, sp=1, tp=tp)
        shape = MODELS[spec.model]
        return simulate_disaggregated(
            requests, model, model, kv_tokens_per_rank(spec.model, spec.hardware, tp),
            shape.kv_bytes_per_token_layer * shape.num_layers, spec.ttft_slo_s,
            spec.tbt_slo_s, order=order)
    sched, ex = build_instance(spec)
    return simulate(requests, sched, ex, spec.ttft_slo_s, spec.tbt_slo_s)
