"""Tests for the XLA path's own options (pallas_kernels.ragged_paged_attention.xla)."""

from __future__ import annotations

import numpy as np
import pytest
from rpa_cases import ARG_NAMES, check, make_case

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_xla


def test_xla_blocks_and_chunks_are_only_speed_knobs() -> None:
    rng = np.random.default_rng(5)
    case = make_case(
        rng,
        q_lens=[30, 2, 0, 9],
        histories=[10, 50, 3, 0],
        max_seqs=4,
        num_tokens=48,
        head_dim=64,
        page_size=16,
        num_kv_heads=1,
        ratio=3,
        pages_per_seq=5,
    )
    args = [case[k] for k in ARG_NAMES]
    for block_q, groups, chunk in ((1, 1, 16), (7, 3, 40), (64, 8, 512), (32, 2, 8)):
        for split_kv in (False, True):
            out = ragged_paged_attention_xla(*args, block_q=block_q, group_blocks=groups,
                                             kv_chunk=chunk, split_kv=split_kv)
            check(case, np.asarray(out))
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        ragged_paged_attention_xla(*args, block_q=0)
