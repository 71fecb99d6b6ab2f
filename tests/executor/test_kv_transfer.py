"""The prefill -> decode KV transfer is sized by what moves: no transfer in a step where no
prefill completes, and exactly the completing requests' page groups otherwise (sent to
their decode ranks only), with the tokens still equal to the dense reference."""

import dataclasses

import jax
import numpy as np
import pytest
from tiny_models import TINY_LLAMA

from conflux_jax import reference
from conflux_jax.executor.buckets import BucketConfig
from conflux_jax.executor.jax_executor import ExecutorConfig, JaxExecutor
from conflux_jax.models.decoder import random_params
from conflux_jax.plan import DecodeSlot, IterationPlan, PrefillPiece
from conflux_jax.scheduler.block_manager import BlockManager

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")

N, PAGE = 4, 4
GROUP = N * PAGE  # tokens per page group (one prefill-view page per rank)


@pytest.fixture(scope="module")
def setup():
    params = random_params(TINY_LLAMA, seed=4, scale=0.2)
    ec = ExecutorConfig(mesh="sp=4,tp=1", page_size=PAGE, num_pages=64, max_model_len=128,
                        buckets=BucketConfig(tokens=(8, 32), decode=(8,), decode_pages=(32,),
                                             transfer=(1, 4), max_prefill_seqs=4),
                        return_logits=True)
    return JaxExecutor(TINY_LLAMA, params, ec), params


def _split(length: int) -> tuple[int, ...]:
    base, extra = divmod(length, N)
    return tuple(base + (r < extra) for r in range(N))


def test_transfer_moves_only_what_completes(setup) -> None:
    ex, params = setup
    cfg = ex.model_config
    rng = np.random.default_rng(0)
    prompts = {0: rng.integers(3, 256, 37).tolist(), 1: rng.integers(3, 256, 10).tolist()}
    decode_rank = {0: 2, 1: 0}
    bm = BlockManager(N, ex.kv.num_pages, PAGE)
    seqs = {rid: list(p) for rid, p in prompts.items()}
    checked: list[tuple[int, int, np.ndarray]] = []  # (request, position, logits)

    def run(plan: IterationPlan) -> None:
        out = ex.execute(plan)
        for rid, tok in out.sampled.items():
            checked.append((rid, len(seqs[rid]) - 1, ex.last_logits[rid]))
            seqs[rid].append(tok.token)

    # Step 1: a prefill chunk that does not complete: no transfer bucket, no bytes moved.
    bm.allocate_prefill(0, 20)
    first = PrefillPiece(0, 0, _split(20), token_ids=tuple(prompts[0][:20]),
                         pages=bm.prefill_pages(0))
    plan = IterationPlan((first,), (), estimated_latency_s=0.0)
    assert ex.build_batch(plan)[0].transfer == 0
    run(plan)
    assert ex.last_transfer_bytes == 0

    # Step 2: both requests complete, onto different decode ranks (two destinations).
    pieces = []
    for rid, start in ((0, 20), (1, 0)):
        total = len(prompts[rid])
        bm.allocate_prefill(rid, total)
        bm.transition(rid, decode_rank[rid], total + 1, keep_prefill=True)
        pieces.append(PrefillPiece(
            rid, start, _split(total - start), True, decode_rank[rid],
            token_ids=tuple(prompts[rid][start:]), pages=bm.prefill_pages(rid),
            decode_pages=bm.decode_pages(rid)))
    plan = IterationPlan(tuple(pieces), (), estimated_latency_s=0.0)
    need_groups = sum(-(-len(p) // GROUP) for p in prompts.values())  # 3 + 1
    shape, batch, _ = ex.build_batch(plan)
    assert shape.transfer == need_groups == 4  # an exact bucket: no padding groups
    # what each rank sends to each rank: request 1's group to rank 0, request 0's three to
    # rank 2, nothing to the ranks that decode neither
    assert batch.shared.transfer_count.tolist() == [1, 0, 3, 0]
    assert batch.shared.transfer_start.tolist()[::2] == [0, 1]
    run(plan)
    # What the completing requests need: all heads of their KV, rounded up to page groups,
    # less the head shard the decode rank holds already (K and V, every layer).
    m = ex.step_config.model
    token_bytes = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4  # f32
    need = sum(-(-len(p) // GROUP) * GROUP for p in prompts.values()) * token_bytes \
        * (N - 1) // N
    assert ex.last_transfer_bytes == need
    for rid in prompts:
        bm.release_prefill(rid)

    # Steps 3-4: decode on the destination ranks reads the moved KV.
    for _ in range(2):
        slots = []
        for rid, seq in seqs.items():
            bm.append_decode(rid, len(seq))
            slots.append(DecodeSlot(rid, decode_rank[rid], position=len(seq) - 1,
                                    token_id=seq[-1], pages=bm.decode_pages(rid),
                                    sample_step=len(seq) - len(prompts[rid])))
        plan = IterationPlan((), tuple(slots), estimated_latency_s=0.0)
        assert ex.build_batch(plan)[0].transfer == 0
        run(plan)
        assert ex.last_transfer_bytes == 0

    assert len(checked) == 6
    for rid, pos, logits in checked:
        ref = np.asarray(reference.forward(cfg, params, seqs[rid]))
        np.testing.assert_allclose(logits, ref[pos], atol=1e-4, rtol=1e-4,
                                   err_msg=f"request {rid}, position {pos}")
        assert int(np.argmax(logits)) == seqs[rid][pos + 1]  # greedy token


def test_no_transfer_is_compiled_when_nothing_completes(setup) -> None:
    """The zero bucket compiles no transfer collective; a nonzero one adds, in the layer
    loop's body, one exchange of K and one of V to decode ranks and the same pair for
    prefix-cache loads (which share the bucket), and no all-gather."""
    ex, _ = setup
    base = ex.planner.shape_for(prefill_max=8, decode_max=1, combined_max=8,
                                decode_pages_max=1)
    texts = {}
    for x in (0, 1):
        shape = dataclasses.replace(base, transfer=x)
        texts[x] = ex._step.forward.lower(*ex._abstract_args(shape)).compile().as_text()
    a2a = {x: t.count(" all-to-all(") for x, t in texts.items()}
    assert a2a[1] - a2a[0] == 4
    assert all("all-gather" not in t for t in texts.values())


def test_a_decode_only_step_has_no_collective(setup) -> None:
    """What ``JaxExecutor.feeds_ahead`` relies on to launch a step on the running one's
    outputs across devices: a decode-only step on an ``sp`` mesh (no prefill, no transfer,
    no tensor parallelism) compiles no collective, so a device whose inputs failed cannot
    leave the others waiting in one; a prefill step has its all-to-alls."""
    ex, _ = setup
    collectives = ("all-to-all(", "all-gather(", "all-reduce(", "collective-permute(",
                   "reduce-scatter(")

    def count(shape) -> int:
        text = ex._step.forward.lower(*ex._abstract_args(shape)).compile().as_text()
        return sum(text.count(f" {c}") for c in collectives)

    decode = ex.planner.shape_for(prefill_max=0, decode_max=3, combined_max=3,
                                  decode_pages_max=2)
    prefill = ex.planner.shape_for(prefill_max=8, decode_max=1, combined_max=8,
                                   decode_pages_max=1)
    assert count(decode) == 0
    assert count(prefill) > 0
