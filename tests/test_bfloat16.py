"""bfloat16 on CPU: ``LLM(..., dtype="bfloat16")`` against the dense bf16 reference.

Oracles: the single-device dense forward of ``conflux_jax.reference`` run in bfloat16
(the same weights rounded the same way, no paging, sharding or sequence parallelism) for
tokens and log-probabilities, and the float32 reference for how far bf16 may drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "checkpoints"))

from ckpt_helpers import (  # noqa: E402
    random_hf_weights,
    tiny_llama,
    train_tiny_tokenizer,
    write_hf_folder,
)

from conflux_jax import LLM, SamplingParams, reference  # noqa: E402
from conflux_jax.checkpoints import load_checkpoint  # noqa: E402
from conflux_jax.engine import EngineConfig  # noqa: E402
from conflux_jax.executor.buckets import BucketConfig  # noqa: E402
from conflux_jax.executor.device import resolve_dtype  # noqa: E402
from conflux_jax.executor.jax_executor import ExecutorConfig  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")


def test_auto_dtype_is_bf16_on_accelerators_and_fp32_on_cpu() -> None:
    assert resolve_dtype("auto", "gpu") == resolve_dtype("auto", "tpu") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError):
        resolve_dtype("int8", "cpu")


def test_llm_bf16_on_cpu_matches_the_dense_bf16_reference(tmp_path: Path) -> None:
    cfg = tiny_llama()
    # Larger weights than the helper's: logits with clear margins, so greedy choices are
    # not near-ties that bf16 rounding could flip.
    weights = {k: v if "norm" in k else 4 * v for k, v in random_hf_weights(cfg, 3).items()}
    folder = write_hf_folder(tmp_path / "tiny", cfg, weights, train_tiny_tokenizer())
    # One token bucket: two step shapes (prefill + transfer, decode) compile on first use.
    ec = ExecutorConfig(mesh="sp=2,tp=1", page_size=8, max_model_len=64,
                        buckets=BucketConfig(tokens=(32,), decode=(4,), transfer=(4,),
                                             max_prefill_seqs=4))
    llm = LLM(str(folder), dtype="bfloat16", engine_config=EngineConfig(executor=ec))
    ex = llm.engine.executor
    assert ex.dtype == jnp.bfloat16 and ex.kv_pools[0].dtype == jnp.bfloat16
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(ex.params))

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 23, 40)]
    n_new = 8
    outs = llm.generate(prompts, SamplingParams(max_tokens=n_new, temperature=0, logprobs=5,
                                                ignore_eos=True))
    bf16 = load_checkpoint(str(folder), dtype="bfloat16")
    fp32 = load_checkpoint(str(folder), dtype="float32")
    for prompt, out in zip(prompts, outs, strict=True):
        got = out.outputs[0].token_ids
        # The reference's full-sequence forward over prompt + generated tokens, in bf16:
        # its greedy choice at every step, and its log-probabilities.
        # Padded to one length (causal: the padding changes no earlier logit), so the
        # reference compiles once per dtype.
        seq = (prompt + got + [0] * 64)[:64]
        rows = slice(len(prompt) - 1, len(prompt) + n_new - 1)
        ref = np.asarray(reference.forward(bf16.config, bf16.params, seq), np.float32)[rows]
        assert got == ref.argmax(-1).tolist()
        ref_lp = np.asarray(jax.nn.log_softmax(ref))
        f32 = np.asarray(reference.forward(fp32.config, fp32.params, seq), np.float32)[rows]
        f32_lp = np.asarray(jax.nn.log_softmax(f32))
        for i, top in enumerate(out.outputs[0].logprobs):
            ids = list(top)
            lp = np.array([top[t] for t in ids])
            # bf16 keeps 8 mantissa bits: the engine and the bf16 reference round in a
            # different order (paged, sharded sums), so they agree to bf16's resolution.
            np.testing.assert_allclose(lp, ref_lp[i, ids], atol=0.1)
            # And bf16 stays near the float32 model (looser: rounding of every weight).
            np.testing.assert_allclose(lp, f32_lp[i, ids], atol=0.3)
