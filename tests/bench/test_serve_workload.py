"""Serving workloads: shared hash ids -> shared prefixes, scaling, rate, toolagent shape."""

import numpy as np
from shared_data import needs_traces

from conflux_jax.bench.serve_workload import LengthScaling, Row, at_rate, load_rows, synthesize
from conflux_jax.bench.workloads import TOOLAGENT_OUTPUT, TOOLAGENT_PROMPT, toolagent_like


def test_shared_hash_ids_give_shared_prefixes() -> None:
    rows = [Row(0.0, 1024, 100, (1, 2)), Row(1.0, 1536, 100, (1, 2, 3)),
            Row(2.0, 700, 100, (9,)), Row(3.0, 40, 5)]
    sc = LengthScaling(prompt_scale=1 / 32, output_scale=1 / 10, max_output_len=8)
    a, b, c, d = synthesize(rows, sc, (100, 1000), seed=3)
    assert sc.block_len == 16
    assert [len(r.prompt_ids) for r in (a, b, c, d)] == [32, 48, 22, 1]
    assert b.prompt_ids[:32] == a.prompt_ids  # blocks 1, 2 shared
    assert c.prompt_ids[:16] != a.prompt_ids[:16]
    assert [r.max_tokens for r in (a, b, c, d)] == [8, 8, 8, 1]
    assert all(100 <= t < 1000 for r in (a, b, c, d) for t in r.prompt_ids)
    assert synthesize(rows, sc, (100, 1000), seed=3)[1] == b  # deterministic


def test_at_rate_scales_mean_rate_and_subsamples() -> None:
    rows = [Row(float(i) * 3.0, 10, 10) for i in range(101)]
    out = at_rate(rows, 4.0, 41, seed=0)
    assert len(out) == 41 and out[0].arrival_s == 0.0
    assert abs(40 / out[-1].arrival_s - 4.0) < 1e-9


@needs_traces
def test_conversation_trace_rows_have_hash_ids() -> None:
    rows = load_rows("conversation", 10)
    assert len(rows) > 10_000 and rows[0].hash_ids


@needs_traces
def test_toolagent_like_shapes_match_table3() -> None:
    for shape in ("mooncake", "lognormal"):
        base = toolagent_like(4000, seed=1, shape=shape)
        p = np.array([x[1] for x in base])
        o = np.array([x[2] for x in base])
        assert abs(np.percentile(p, 50) / TOOLAGENT_PROMPT[0] - 1) < 0.1
        assert abs(np.percentile(p, 95) / TOOLAGENT_PROMPT[1] - 1) < 0.15
        assert abs(np.percentile(o, 50) / TOOLAGENT_OUTPUT[0] - 1) < 0.15
        assert abs(np.percentile(o, 95) / TOOLAGENT_OUTPUT[1] - 1) < 0.2
    # The Mooncake-shaped tail is the lighter one (why it is the default).
    moon = np.array([x[1] for x in toolagent_like(4000, seed=1)])
    logn = np.array([x[1] for x in toolagent_like(4000, seed=1, shape="lognormal")])
    assert np.percentile(moon, 99) < np.percentile(logn, 99)
