"""Tests for pallas_kernels.ragged_paged_attention: every impl against the package's dense
float64 reference ``ref_ragged_paged_attention``; argument validation and dispatch."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rpa_cases import (
    ARG_NAMES,
    IMPLS,
    check,
    make_case,
    pallas_safe,
    run,
    valid_case,
    with_changes,
)

from pallas_kernels import _common
from pallas_kernels.ragged_paged_attention import (
    default_block_sizes,
    ragged_paged_attention,
    ragged_paged_attention_xla,
    ref_ragged_paged_attention,
)
from pallas_kernels.ragged_paged_attention import pallas as pallas_mod
from pallas_kernels.ragged_paged_attention import xla as xla_mod

SETTINGS = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------------------------
# Randomised cases
# --------------------------------------------------------------------------------------------

MAX_SEQS = 4
NUM_TOKENS = 64
# Kernel tilings drawn per example besides the defaults: tiny blocks exercise many query
# blocks per sequence, many KV tiles per block and uneven KV splits.
SMALL_BLOCKS = dict(block_q=2, block_kv=16, kv_splits=3)


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    """Static shapes: drawn from a small set so that compiled programs get reused."""
    ratio = draw(st.sampled_from([1, 3, 8]))
    page_size = draw(st.sampled_from([16, 64]))
    return dict(
        head_dim=draw(st.sampled_from([64, 128])),
        page_size=page_size,
        ratio=ratio,
        num_kv_heads=1 if ratio == 8 else 2,
        pages_per_seq=320 // page_size,  # room for long histories
        kw=draw(st.sampled_from([{}, SMALL_BLOCKS])),
    )


@st.composite
def batches(draw: st.DrawFn, cfg: dict[str, Any]) -> tuple[list[int], list[int]]:
    """Query lengths and histories of the live sequences of one step."""
    page_size = cfg["page_size"]
    capacity = cfg["pages_per_seq"] * page_size
    # sampled_from lists start with what the first (simplest) examples should contain.
    n = draw(st.sampled_from([MAX_SEQS, 3, 2, 1, 0]))
    q_lens = [draw(st.sampled_from([1, 7, 0, 2]) | st.integers(0, 16)) for _ in range(n)]
    if n and draw(st.booleans()):
        q_lens[-1] += NUM_TOKENS - sum(q_lens)  # no padding: the last chunk fills the axis
    histories = []
    for q_len in q_lens:
        kind = draw(st.sampled_from(["page_edge", "long", "short", "none"]))
        if kind == "none":
            hist = 0
        elif kind == "short":
            hist = draw(st.integers(0, 40))
        elif kind == "long":
            hist = draw(st.integers(min(100, capacity - q_len), capacity - q_len))
        else:  # kv_len on, or one off, a page boundary
            kv_len = draw(st.integers(1, cfg["pages_per_seq"] - 1)) * page_size
            kv_len += draw(st.sampled_from([-1, 0, 1]))
            hist = max(0, kv_len - q_len)
        histories.append(min(hist, capacity - q_len))
    return q_lens, histories


@st.composite
def scenarios(draw: st.DrawFn, dtype: Any) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """One static config and two steps (metadata and data) that share its compiled code."""
    cfg = draw(configs())
    out = []
    for _ in range(2):
        q_lens, histories = draw(batches(cfg))
        rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
        out.append(
            make_case(
                rng,
                q_lens=q_lens,
                histories=histories,
                max_seqs=MAX_SEQS,
                num_tokens=NUM_TOKENS,
                head_dim=cfg["head_dim"],
                page_size=cfg["page_size"],
                num_kv_heads=cfg["num_kv_heads"],
                ratio=cfg["ratio"],
                pages_per_seq=cfg["pages_per_seq"],
                dtype=dtype,
            )
        )
    return out, cfg["kw"]


def check_all_impls(drawn: tuple[list[dict[str, Any]], dict[str, int]], dtype: Any) -> None:
    steps, kw = drawn
    for case in steps:
        for impl in IMPLS:
            impl_kw = {} if impl == "xla" else kw
            if impl == "pallas":
                impl_kw = pallas_safe(kw, case)
            check(case, run(case, impl, **impl_kw), dtype)


@settings(SETTINGS, max_examples=16)
@given(scenarios(jnp.float32))
def test_matches_oracle_f32(drawn: tuple[list[dict[str, Any]], dict[str, int]]) -> None:
    check_all_impls(drawn, jnp.float32)


@settings(SETTINGS, max_examples=6)
@given(scenarios(jnp.bfloat16))
def test_matches_oracle_bf16(drawn: tuple[list[dict[str, Any]], dict[str, int]]) -> None:
    check_all_impls(drawn, jnp.bfloat16)


# --------------------------------------------------------------------------------------------
# Hand-picked cases
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_batch(impl: str) -> None:
    """One query per sequence (default decode tiling: KV splits), long ragged histories."""
    rng = np.random.default_rng(1)
    histories = [0, 15, 16, 17, 63, 200, 255, 130]
    case = make_case(
        rng,
        q_lens=[1] * 8,
        histories=histories,
        max_seqs=8,
        num_tokens=8,
        head_dim=128,
        page_size=16,
        num_kv_heads=1,
        ratio=8,
        pages_per_seq=16,
    )
    assert default_block_sizes(8, 8, 8, 1, 128).kv_splits > 1
    check(case, run(case, impl))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("query_len", ["short", "long"])
def test_query_len_picks_the_tiling_not_the_result(impl: str, query_len: str) -> None:
    """A few long sequences in as many slots as tokens (the Conflux decode slice's local
    prefills) look decode-shaped; either tiling, chosen by the caller, gives the oracle."""
    rng = np.random.default_rng(7)
    case = make_case(
        rng,
        q_lens=[13, 3],
        histories=[200, 40],
        max_seqs=16,
        num_tokens=16,
        head_dim=64,
        page_size=16,
        num_kv_heads=2,
        ratio=3,
        pages_per_seq=16,
    )
    assert default_block_sizes(16, 16, 6, 2, 64).kv_splits > 1  # the guess: decode
    assert default_block_sizes(16, 16, 6, 2, 64, "long").block_q > 16
    out = ragged_paged_attention(*(case[k] for k in ARG_NAMES), impl=impl, query_len=query_len)
    check(case, np.asarray(out))


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_num_seqs_one_compile(impl: str) -> None:
    """num_seqs is traced: one compiled program serves any number of live sequences."""
    rng = np.random.default_rng(2)
    case = make_case(
        rng,
        q_lens=[3, 0, 1, 9],
        histories=[20, 5, 70, 0],
        max_seqs=4,
        num_tokens=16,
        head_dim=64,
        page_size=16,
        num_kv_heads=2,
        ratio=3,
        pages_per_seq=8,
    )
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, impl=impl))
    for n in (0, 1, 2, 4):
        sub = dict(case, num_seqs=np.int32(n))
        out = fn(
            *(sub[k] for k in ("q", "k_pages", "v_pages", "kv_lens", "page_indices")),
            sub["cu_q_lens"],
            jnp.asarray([n], jnp.int32),
        )
        check(sub, np.asarray(out))
    assert fn._cache_size() == 1


def test_kv_past_kv_len_never_read() -> None:
    """NaN everywhere a sequence has no valid KV: the kernel must not touch it."""
    rng = np.random.default_rng(3)
    case = make_case(
        rng,
        q_lens=[5, 1, 20],
        histories=[27, 40, 44],
        max_seqs=3,
        num_tokens=32,
        head_dim=64,
        page_size=16,
        num_kv_heads=2,
        ratio=1,
        pages_per_seq=6,
    )
    valid = np.zeros(case["k_pages"].shape[:2], bool)
    for s in range(3):
        for pos in range(int(case["kv_lens"][s])):
            valid[case["page_indices"][s, pos // 16], pos % 16] = True
    for name in ("k_pages", "v_pages"):
        case[name] = jnp.where(valid[:, :, None, None], case[name], jnp.nan)
    for impl in (i for i in IMPLS if i != "xla"):  # the XLA path gathers whole pages
        for kw in ({}, SMALL_BLOCKS):
            check(case, run(case, impl, **(pallas_safe(kw, case) if impl == "pallas" else kw)))


@pytest.mark.parametrize("impl", IMPLS)
def test_sm_scale_and_single_token_axis(impl: str) -> None:
    rng = np.random.default_rng(4)
    case = make_case(
        rng,
        q_lens=[1],
        histories=[33],
        max_seqs=1,
        num_tokens=1,
        head_dim=64,
        page_size=64,
        num_kv_heads=1,
        ratio=1,
        pages_per_seq=1,
    )
    case["sm_scale"] = 0.3
    check(case, run(case, impl))


# --------------------------------------------------------------------------------------------
# Validation: ValueError before anything is traced
# --------------------------------------------------------------------------------------------

_with = with_changes  # short: the table below is one case a line

BAD_CASES = {
    "q rank": (_with(q=lambda q: q[0]), "q must have rank 3"),
    "int q": (_with(q=lambda q: q.astype(jnp.int32)), "q must have a floating dtype"),
    "k/v shapes": (_with(v_pages=lambda v: v[:-1]), "same shape"),
    "dtypes": (_with(k_pages=lambda k: k.astype(jnp.bfloat16)), "share one dtype"),
    "head dim": (_with(q=lambda q: q[..., :32]), "head dim mismatch"),
    "gqa": (_with(q=lambda q: q[:, :3]), "not a multiple of Hkv"),
    "float kv_lens": (_with(kv_lens=lambda x: x.astype(np.float32)), "integer dtype"),
    "page rows": (_with(page_indices=lambda x: x[:2]), "page_indices has 2 rows"),
    "cu length": (_with(cu_q_lens=lambda x: x[:3]), "cu_q_lens must have S\\+1=4"),
    "num_seqs shape": (_with(num_seqs=lambda x: np.array([1, 2], np.int32)), "num_seqs must"),
    "num_seqs > S": (_with(num_seqs=lambda x: np.int32(4)), "outside \\[0, S=3\\]"),
    "cu start": (_with(cu_q_lens=lambda x: x + 1), "cu_q_lens\\[0\\] must be 0"),
    "cu order": (_with(cu_q_lens=lambda x: np.array([0, 3, 2, 9], np.int32)), "non-decreasing"),
    "cu past T": (_with(cu_q_lens=lambda x: np.array([0, 2, 9, 9], np.int32)), "exceeds"),
    "kv < q": (_with(kv_lens=lambda x: np.array([1, 3, 0], np.int32)), "smaller than its query"),
    "kv capacity": (_with(kv_lens=lambda x: np.array([33, 3, 0], np.int32)), "exceeds pages"),
    "page range": (
        _with(page_indices=lambda x: np.array([[-1, 0], [1, 2], [0, 0]], np.int32)),
        "outside \\[0, 9\\)",
    ),
}


@pytest.mark.parametrize("name", list(BAD_CASES))
@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_invalid_inputs_raise_before_tracing(
    name: str, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("traced despite invalid inputs")

    monkeypatch.setattr(xla_mod, "rpa_xla", never)
    monkeypatch.setattr(pallas_mod, "rpa_pallas", never)
    case, match = BAD_CASES[name]
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*(case[k] for k in ARG_NAMES), impl=impl)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention_xla(*(case[k] for k in ARG_NAMES))
    with pytest.raises(ValueError, match=match):
        ref_ragged_paged_attention(*(case[k] for k in ARG_NAMES))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(block_q=3), "powers of two"),
        (dict(block_kv=0), "positive int"),
        (dict(kv_splits=1.5), "positive int"),
        (dict(blok_q=4), "unknown block size option"),
        (dict(impl="triton"), "is not one of"),
        (dict(impl="reference"), "'reference' is now called 'xla'"),
        (dict(query_len="decode"), "query_len must be"),
    ],
)
def test_invalid_options(kw: dict[str, Any], match: str) -> None:
    case = valid_case()
    kw = {"impl": "interpret", **kw}
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*(case[k] for k in ARG_NAMES), **kw)


def test_pallas_needs_pow2_head_dim() -> None:
    case = _with(
        q=lambda q: q[..., :48], k_pages=lambda k: k[..., :48], v_pages=lambda v: v[..., :48]
    )
    with pytest.raises(ValueError, match="power-of-two head dim"):
        ragged_paged_attention(*(case[k] for k in ARG_NAMES), impl="interpret")
    check(case, run(case, "xla"))  # the XLA path takes any head dim


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def _record_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(xla_mod, "rpa_xla", lambda *a, **k: calls.append("xla"))
    monkeypatch.setattr(
        pallas_mod,
        "rpa_pallas",
        lambda *a, interpret, **k: calls.append("interpret" if interpret else "pallas"),
    )
    return calls


def test_dispatch_auto_env_and_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record_calls(monkeypatch)
    args = [valid_case()[k] for k in ARG_NAMES]
    monkeypatch.delenv(_common.IMPL_ENV_VAR, raising=False)
    ragged_paged_attention(*args)
    assert calls[-1] == ("pallas" if _common.on_gpu() else "xla")
    monkeypatch.setenv(_common.IMPL_ENV_VAR, "interpret")
    ragged_paged_attention(*args)
    assert calls[-1] == "interpret"
    ragged_paged_attention(*args, impl="xla")  # the argument beats the env var
    assert calls[-1] == "xla"
    monkeypatch.setenv(_common.IMPL_ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="CONFLUX_ATTENTION_IMPL"):
        ragged_paged_attention(*args)


@pytest.mark.skipif(_common.on_gpu(), reason="compiled Pallas is available on GPU")
def test_compiled_pallas_refused_off_gpu() -> None:
    with pytest.raises(ValueError, match="needs a GPU|compiles the kernel for a GPU"):
        ragged_paged_attention(*(valid_case()[k] for k in ARG_NAMES), impl="pallas")
