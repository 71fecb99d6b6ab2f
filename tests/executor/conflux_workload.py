"""Random Conflux iterations against the dense single-device reference (test driver).

Requests go through random chunked prefills (random chunk sizes, random per-rank token
splits, several at once), a prefill->decode transition onto a random rank, and greedy
decode, mixed in the same iterations. Every sampled row's logits are checked against
``reference.forward`` over the request's final token list.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from conflux_jax import reference
from conflux_jax.executor.jax_executor import JaxExecutor
from conflux_jax.plan import DecodeSlot, IterationPlan, PrefillPiece
from conflux_jax.scheduler.block_manager import BlockManager


@dataclasses.dataclass
class _Req:
    rid: int
    prompt_len: int
    out_budget: int
    prefilled: int = 0
    rank: int | None = None


def run_random_workload(ex: JaxExecutor, params, rng: np.random.Generator, num_requests: int,
                        max_prompt: int, max_output: int, mode: str = "conflux",
                        atol: float = 1e-4, verify: bool = True) -> dict[str, int]:
    """Drive ``ex`` with random plans until every request finishes; assert logits match.

    The plans carry their tokens and pages (from a block manager of our own), as the
    scheduler's do."""
    cfg = ex.model_config
    n = ex.num_ranks
    t_max = ex.buckets.max_tokens
    d_max = ex.buckets.decode[-1]
    s_max = ex.buckets.max_prefill_seqs
    bm = BlockManager(n, ex.kv.num_pages, ex.kv.page_size)
    tokens: dict[int, list[int]] = {}  # prompt + sampled tokens of each request
    pending = []
    for rid in range(num_requests):
        prompt = rng.integers(3, cfg.vocab_size, int(rng.integers(1, max_prompt + 1))).tolist()
        tokens[rid] = prompt
        pending.append(_Req(rid, len(prompt), int(rng.integers(1, max_output + 1))))
    prefilling: list[_Req] = []
    decoding: list[_Req] = []
    sampled_at: dict[int, list[tuple[int, np.ndarray]]] = {r.rid: [] for r in pending}
    iterations = 0
    while pending or prefilling or decoding:
        iterations += 1
        while pending and len(prefilling) < s_max and rng.random() < 0.7:
            prefilling.append(pending.pop(0))
        phase = mode
        if mode == "isolated":  # phase-isolated: an iteration runs one phase only
            phase = "prefill" if prefilling and (not decoding or rng.random() < 0.5) else "decode"
        load = [0] * n
        decode_slots = []
        if phase != "prefill":
            for r in decoding:
                if load[r.rank] < d_max:
                    load[r.rank] += 1
                    decode_slots.append(r)
        pieces, completing, moved = [], [], 0
        if phase != "decode":
            for r in list(prefilling):
                room = [t_max - x for x in load]
                if sum(room) == 0:
                    break
                remaining = r.prompt_len - r.prefilled
                length = int(rng.integers(1, min(remaining, sum(room)) + 1))
                counts = _random_split(rng, length, room)
                completes = r.prefilled + length == r.prompt_len
                groups = -(-r.prompt_len // (ex.kv.page_size * n))
                if completes and moved + groups > ex.planner.transfer_groups:
                    continue  # the step's transfer bound (several completions may fit)
                bm.allocate_prefill(r.rid, r.prefilled + length)
                rank = None
                if completes:
                    rank = int(rng.integers(0, n))
                    bm.transition(r.rid, rank, r.prompt_len + 1, keep_prefill=True)
                    completing.append(r)
                    moved += groups
                start = r.prefilled
                pieces.append(PrefillPiece(
                    r.rid, start, tuple(counts), completes, rank,
                    token_ids=tuple(tokens[r.rid][start:start + length]),
                    pages=bm.prefill_pages(r.rid),
                    decode_pages=bm.decode_pages(r.rid) if completes else ()))
                load = [a + b for a, b in zip(load, counts, strict=True)]
                r.prefilled += length
                r.rank = rank
        slots = []
        for r in decode_slots:
            seq = tokens[r.rid]
            bm.append_decode(r.rid, len(seq))
            slots.append(DecodeSlot(r.rid, r.rank, position=len(seq) - 1, token_id=seq[-1],
                                    pages=bm.decode_pages(r.rid),
                                    sample_step=len(seq) - r.prompt_len))
        plan = IterationPlan(tuple(pieces), tuple(slots), estimated_latency_s=0.0,
                             mode="conflux")
        if plan.empty:
            continue
        out = ex.execute(plan)
        for rid, tok in out.sampled.items():
            sampled_at[rid].append((len(tokens[rid]) - 1, ex.last_logits[rid]))
            tokens[rid].append(tok.token)
        for r in completing:
            bm.release_prefill(r.rid)
            prefilling.remove(r)
            decoding.append(r)
        for r in list(decoding):
            if len(tokens[r.rid]) - r.prompt_len >= r.out_budget:
                decoding.remove(r)
                bm.free(r.rid)
    bm.check_consistency()
    assert all(bm.free_pages(r) == bm.num_pages for r in range(n)), "pages leaked"
    checked = 0
    for rid, samples in sampled_at.items() if verify else ():
        seq = tokens[rid]
        ref = np.asarray(reference.forward(cfg, params, seq))
        for pos, logits in samples:
            np.testing.assert_allclose(logits, ref[pos], atol=atol, rtol=atol,
                                       err_msg=f"request {rid}, position {pos}")
            assert int(np.argmax(logits)) == seq[pos + 1] or np.isclose(
                np.sort(logits)[-1], np.sort(logits)[-2], atol=atol)
            checked += 1
    return {"iterations": iterations, "checked": checked}


def _random_split(rng: np.random.Generator, length: int, room: list[int]) -> list[int]:
    """Spread ``length`` tokens over ranks at random without exceeding each rank's room."""
    counts = [0] * len(room)
    for _ in range(length):
        open_ranks = [i for i, r in enumerate(room) if counts[i] < r]
        counts[int(rng.choice(open_ranks))] += 1
    return counts
