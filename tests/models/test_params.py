"""The per-layer and packed weight layouts: the same model as the stacked one."""

import jax
import numpy as np
import pytest
from tiny_models import TINY_LLAMA_D64, TINY_QWEN3, TINY_SMOL

from conflux_jax.executor.jax_executor import resolve_layer_weights
from conflux_jax.models.decoder import random_params
from conflux_jax.models.params import (
    layers_unstacked,
    linears_packed,
    pack_linears,
    unstack_layers,
)
from conflux_jax.reference import forward
from pallas_kernels.cpu_gemm import packed_gemm_available


def test_unstacked_layers_are_the_stacked_slices_and_run_the_same_model() -> None:
    params = random_params(TINY_QWEN3, seed=3, scale=0.2)
    per_layer = unstack_layers(params)
    assert layers_unstacked(per_layer) and not layers_unstacked(params)
    assert len(per_layer["layers"]) == TINY_QWEN3.num_layers
    for i, layer in enumerate(per_layer["layers"]):
        assert layer.keys() == params["layers"].keys()
        for name, w in layer.items():
            np.testing.assert_array_equal(w, params["layers"][name][i])
    tokens = np.random.default_rng(0).integers(3, TINY_QWEN3.vocab_size, 12)
    # The stacked weights run in a scan, the per-layer ones unrolled: same logits.
    np.testing.assert_allclose(forward(TINY_QWEN3, jax.device_put(per_layer), tokens),
                               forward(TINY_QWEN3, params, tokens), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="already unstacked"):
        unstack_layers(per_layer)


def test_layer_weights_choice() -> None:
    assert resolve_layer_weights("auto", "auto", "gpu") == "per_layer"
    assert resolve_layer_weights("auto", "auto", "tpu") == "per_layer"
    assert resolve_layer_weights("auto", "auto", "cpu") == "stacked"
    assert resolve_layer_weights("auto", "blas", "cpu") == "stacked"
    assert resolve_layer_weights("per_layer", "xla", "cpu") == "per_layer"
    with pytest.raises(ValueError, match="blas"):
        resolve_layer_weights("per_layer", "blas", "cpu")
    with pytest.raises(ValueError, match="layer_weights must be one of"):
        resolve_layer_weights("unrolled", "auto", "cpu")


@pytest.mark.skipif(not packed_gemm_available()[0], reason="the packed GEMM cannot build here")
@pytest.mark.parametrize("config", [TINY_QWEN3, TINY_SMOL, TINY_LLAMA_D64],
                         ids=["qwen3", "smol-tied", "llama-d64"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_packed_linears_run_the_same_model(config, per_layer) -> None:
    """Packed layer matrices and LM head (tied embeddings stored once, as the packed head)
    give the logits of the plain weights on XLA's dot (heads of 64: RoPE inside the QKV
    GEMM, against ``apply_rope``)."""
    params = random_params(config, seed=3, scale=0.2)
    packed = pack_linears(unstack_layers(params) if per_layer else params)
    assert linears_packed(packed) and not linears_packed(params)
    layer = packed["layers"][0] if per_layer else packed["layers"]
    assert "wqkv" in layer and not {"wq", "wk", "wv"} & set(layer)  # Q, K and V fused
    head = "embed" if config.tie_word_embeddings else "lm_head"
    assert "lm_head" in packed or config.tie_word_embeddings
    assert packed[head].shape == (-(-config.vocab_size // 32), config.hidden_size, 32)
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, 12)
    np.testing.assert_allclose(forward(config, jax.device_put(packed), tokens),
                               forward(config, params, tokens), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="already packed"):
        pack_linears(packed)
