"""Tiny model configs shared by the tests (fast to compile and run on 2 CPU cores)."""

import dataclasses

from conflux_jax.config import ModelConfig, RopeScaling
from conflux_jax.executor.buckets import BucketConfig

TINY_LLAMA = ModelConfig(
    architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64),
    max_position_embeddings=512, tie_word_embeddings=False, eos_token_ids=(2,))

TINY_QWEN3 = ModelConfig(
    architecture="qwen3", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=6, num_kv_heads=2, head_dim=16, rope_theta=1e6, qk_norm=True,
    max_position_embeddings=512, tie_word_embeddings=False, eos_token_ids=(2,))

# SmolLM2's head layout (9 query / 3 KV heads) at toy width: exercises head padding.
TINY_SMOL = ModelConfig(
    architecture="llama", vocab_size=256, hidden_size=72, intermediate_size=96, num_layers=2,
    num_heads=9, num_kv_heads=3, head_dim=8, rope_theta=1e5, tie_word_embeddings=True,
    max_position_embeddings=512, eos_token_ids=(2,))

# Heads of 64 (SmolLM2's; Llama 3's are 128): whole 32-column panels per half head, so the
# packed QKV GEMM applies RoPE itself.
TINY_LLAMA_D64 = dataclasses.replace(TINY_LLAMA, hidden_size=96, num_heads=3, num_kv_heads=1,
                                     head_dim=64)

# An executor with three step shapes (decode only, prefill, prefill + KV transfer) for
# tests that compile the real step; tests that share it share compiled executables.
SMALL_STEP = dict(mesh="sp=2,tp=1", page_size=4, max_model_len=32,
                  buckets=BucketConfig(tokens=(32,), decode=(4,), transfer=(4,),
                                       max_prefill_seqs=4))
