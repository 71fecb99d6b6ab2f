"""Roofline coefficients for GPUs we do not have (notes/SIMULATOR.md, "A roofline model").

Produces a :class:`LatencyModel` of the same form the profiler fits, so one estimator
drives the scheduler and the simulator either way. Assumptions (all from SIMULATOR.md):

* bf16 everywhere; H100 SXM5: 989 TFLOP/s dense, 3.35 TB/s HBM, 80 GB; H200: same
  compute, 4.8 TB/s, 141 GB; NVLink4 450 GB/s per direction.
* Linears: ``max(T * 2 P_L / (0.75 peak), 2 P_L bytes / (0.8 HBM))`` per layer (compute
  vs weight-read floor; no GEMM knee below ~256 tokens; no unfused-op inflation, mu=0).
* Decode attention: KV read at 0.8 of HBM, no per-request cost (tau_req = 0).
* Prefill attention: 4 n_q d FLOPs per (query, key) pair at 0.6 of peak (FA3), shared
  evenly over the N SP ranks (Ulysses).
* Ulysses all-to-all: Q,K,V in + O out, (2 n_q + 2 n_kv) d * 2 bytes per token, a
  (N-1)/N share leaves the rank, at 370 GB/s effective, plus a 30 us floor per
  collective (two per layer). Requires N <= n_kv (no KV-head replication).
* Prefill -> decode KV transfer: a completing request's KV (all heads) goes to its decode
  rank, which already holds a 1/N head shard; the rest crosses links at the all-to-all's
  370 GB/s with its 30 us floor, per layer (it is priced, not assumed hidden behind later
  layers). Zero on one rank.
* Base TP of degree tp divides weights, FLOPs and KV per GPU by tp and adds two ring
  all-reduces per layer (busbw 300 GB/s, 37.5 us floor each).
* Attention phases: ``attention="serial"`` (default) runs prefill then decode attention,
  T_P + T_D, as our step does; ``attention="paper"`` is the paper's SM-partitioned overlap,
  1.28 * max(T_P, T_D) (§8.3: 28.0 ms overlapped vs a 21.8 ms contention-free bound).
* Other devices (``HARDWARE``; ``hardware_for_device_kind`` maps jax's device kind to an
  entry): the same efficiencies, and collectives at the H100's effective bandwidths
  scaled by the device's link bandwidth relative to NVLink4's 450 GB/s.
* Per-iteration overhead: reading the LM head once (h * V * 2 bytes at 0.8 HBM).
* KV capacity: 90% of HBM minus the weights, per logical rank of tp GPUs.
"""

from __future__ import annotations

import dataclasses
import re

from conflux_jax.config import ModelConfig
from conflux_jax.latency.model import Affine, LatencyModel


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # bf16 dense FLOP/s
    hbm_bw: float  # bytes/s
    hbm_bytes: float
    nvlink_bw: float  # bytes/s per direction


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_context: int

    @classmethod
    def from_config(cls, name: str, c: ModelConfig, max_context: int | None = None
                    ) -> ModelShape:
        """The shape of a loaded model (a checkpoint's config)."""
        return cls(name, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
                   c.head_dim, c.intermediate_size, c.vocab_size,
                   max_context or c.max_position_embeddings)

    @property
    def params_per_layer(self) -> int:
        h, d = self.hidden, self.head_dim
        return (h * d * (self.num_q_heads + 2 * self.num_kv_heads)
                + self.num_q_heads * d * h + 3 * h * self.intermediate)

    @property
    def total_params(self) -> int:
        # untied embeddings: input embedding + LM head
        return self.num_layers * self.params_per_layer + 2 * self.vocab * self.hidden

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * 2


# Datasheet figures: bf16 dense FLOP/s, HBM bytes/s and bytes, link bytes/s per direction
# (NVLink per GPU; a TPU's ICI per chip; PCIe 4.0 x16 for the L4, which has no NVLink).
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", 989e12, 3.35e12, 80e9, 450e9),
    "h100-pcie": Hardware("h100-pcie", 756e12, 2.0e12, 80e9, 300e9),
    "h200": Hardware("h200", 989e12, 4.8e12, 141e9, 450e9),
    "b200": Hardware("b200", 2250e12, 8.0e12, 180e9, 900e9),
    "a100": Hardware("a100", 312e12, 2.04e12, 80e9, 300e9),
    "a100-40gb": Hardware("a100-40gb", 312e12, 1.555e12, 40e9, 300e9),
    "l4": Hardware("l4", 121e12, 300e9, 24e9, 32e9),
    "l40s": Hardware("l40s", 362e12, 864e9, 48e9, 32e9),
    "mi300x": Hardware("mi300x", 1307e12, 5.3e12, 192e9, 448e9),
    "tpu-v4": Hardware("tpu-v4", 275e12, 1.2e12, 32e9, 150e9),
    "tpu-v5e": Hardware("tpu-v5e", 197e12, 819e9, 16e9, 100e9),
    "tpu-v5p": Hardware("tpu-v5p", 459e12, 2.765e12, 95e9, 300e9),
    "tpu-v6e": Hardware("tpu-v6e", 918e12, 1.64e12, 32e9, 224e9),
}

# jax's ``device_kind`` (lower-cased) -> HARDWARE key; the first pattern found wins, so
# the more specific names come first ("h100 pcie" before "h100", "l40s" before "l4").
_DEVICE_KINDS: tuple[tuple[str, str], ...] = (
    (r"h200", "h200"), (r"gh200", "h200"), (r"h100.*pcie", "h100-pcie"), (r"h100", "h100"),
    (r"b200", "b200"), (r"a100.*40gb", "a100-40gb"), (r"a100", "a100"), (r"l40s", "l40s"),
    (r"\bl4\b", "l4"), (r"mi300x", "mi300x"), (r"v6 ?(lite|e)", "tpu-v6e"),
    (r"v5 ?(lite|e)", "tpu-v5e"), (r"v5p?\b", "tpu-v5p"), (r"tpu v4", "tpu-v4"),
)


def hardware_for_device_kind(kind: str) -> Hardware | None:
    """The table entry for a jax device kind ("NVIDIA H100 80GB HBM3", "TPU v5 lite"),
    or None for a device the table does not know (a CPU among them)."""
    text = kind.lower()
    for pattern, name in _DEVICE_KINDS:
        if re.search(pattern, text):
            return HARDWARE[name]
    return None

MODELS: dict[str, ModelShape] = {
    "llama3.1-8b": ModelShape("llama3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, 131072),
    "qwen3-14b": ModelShape("qwen3-14b", 40, 5120, 40, 8, 128, 17408, 151936, 131072),
    "qwen3-32b": ModelShape("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936, 131072),
}

ETA_GEMM = 0.75
ETA_WEIGHTS = 0.8
ETA_KV = 0.8
ETA_FA = 0.6
A2A_BW = 370e9
A2A_FLOOR_S = 30e-6
AR_BUSBW = 300e9
AR_FLOOR_S = 37.5e-6
PAPER_OVERLAP = 28.0 / 21.8  # ~1.28, §8.3
ATTENTION_MODES = ("serial", "paper")
KV_MEM_FRACTION = 0.9


def roofline_model(model: str | ModelShape, hardware: str | Hardware, sp: int, tp: int = 1,
                   attention: str = "serial") -> LatencyModel:
    """Latency coefficients for ``model`` on ``sp`` logical ranks of ``tp`` GPUs each.

    Links other than the H100's NVLink4 scale the collectives' effective bandwidths by
    their bandwidth relative to it."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    m = MODELS[model] if isinstance(model, str) else model
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    link = hw.nvlink_bw / HARDWARE["h100"].nvlink_bw
    a2a_bw, ar_busbw = A2A_BW * link, AR_BUSBW * link
    if sp > m.num_kv_heads:
        raise ValueError(f"sp={sp} > {m.num_kv_heads} KV heads (replication not modelled)")
    p_l = m.params_per_layer
    h, d = m.hidden, m.head_dim
    ar_per_token = 2 * (h * 2) * 2 * (tp - 1) / tp / ar_busbw if tp > 1 else 0.0
    gemm = Affine(a=2 * p_l / tp / (ETA_GEMM * hw.peak_flops) + ar_per_token,
                  b=2 * AR_FLOOR_S if tp > 1 else 0.0,
                  floor=2 * p_l / tp / (ETA_WEIGHTS * hw.hbm_bw))
    dec = Affine(a=m.kv_bytes_per_token_layer / tp / (ETA_KV * hw.hbm_bw))
    pre = Affine(a=4 * m.num_q_heads * d / tp / (ETA_FA * hw.peak_flops))
    a2a_bytes = (2 * m.num_q_heads + 2 * m.num_kv_heads) * d * 2 / tp * (sp - 1) / sp
    comm = Affine(a=a2a_bytes / a2a_bw, b=2 * A2A_FLOOR_S) if sp > 1 else Affine()
    x_bytes = m.kv_bytes_per_token_layer / tp * (sp - 1) / sp
    transfer = Affine(a=x_bytes / a2a_bw, b=A2A_FLOOR_S) if sp > 1 else Affine()
    head = h * m.vocab * 2 / tp / (ETA_WEIGHTS * hw.hbm_bw)
    overlap = PAPER_OVERLAP if attention == "paper" else 1.0
    return LatencyModel(
        num_layers=m.num_layers, num_ranks=sp, gemm=gemm, dec=dec, pre=pre, comm=comm,
        alpha=overlap, beta=overlap, overhead_s=head, serial_attention=attention == "serial",
        transfer=transfer,
        meta={"model": m.name, "hardware": hw.name, "sp": sp, "tp": tp, "source": "roofline",
              "attention": attention})


def kv_tokens_per_rank(model: str, hardware: str, tp: int = 1) -> int:
    """Full-head KV tokens one logical rank (tp GPUs) can hold after the weights."""
    m, hw = MODELS[model], HARDWARE[hardware]
    free = tp * hw.hbm_bytes * KV_MEM_FRACTION - m.total_params * 2
    if free <= 0:
        raise ValueError(f"{model} does not fit on {tp} x {hardware}")
    return int(free // (m.kv_bytes_per_token_layer * m.num_layers))
