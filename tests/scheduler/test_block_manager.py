"""Block manager: aliasing page counts, transitions, growth, errors and leak freedom."""

import random

import pytest

from conflux_jax.scheduler.block_manager import BlockManager, BlockManagerError, OutOfPagesError


def test_prefill_pages_are_head_sharded_on_every_rank() -> None:
    bm = BlockManager(num_ranks=4, num_pages=10, page_size=16)
    tables = bm.allocate_prefill(1, total_tokens=65)  # 65 / (16*4) -> 2 pages per rank
    assert [len(t) for t in tables] == [2, 2, 2, 2]
    assert all(bm.free_pages(r) == 8 for r in range(4))
    bm.allocate_prefill(1, total_tokens=128)  # still 2 pages
    assert bm.free_pages(0) == 8
    bm.allocate_prefill(1, total_tokens=129)  # grows to 3
    assert bm.page_table(1).prefill is not None and len(bm.page_table(1).prefill[3]) == 3


def test_transition_moves_to_one_rank_and_frees_prefill() -> None:
    bm = BlockManager(num_ranks=2, num_pages=20, page_size=8)
    bm.allocate_prefill(7, 40)  # ceil(40/16) = 3 per rank
    pages = bm.transition(7, rank=1, tokens=41, keep_prefill=True)  # ceil(41/8) = 6
    assert len(pages) == 6
    assert (bm.free_pages(0), bm.free_pages(1)) == (17, 11)
    bm.release_prefill(7)
    assert (bm.free_pages(0), bm.free_pages(1)) == (20, 14)
    pt = bm.page_table(7)
    assert pt.prefill is None and pt.decode_rank == 1 and pt.decode == tuple(pages)


def test_decode_growth_allocates_when_page_fills() -> None:
    bm = BlockManager(num_ranks=1, num_pages=4, page_size=4)
    bm.transition(1, 0, tokens=4)
    assert bm.append_decode(1, 4) == []
    assert len(bm.append_decode(1, 5)) == 1
    assert bm.can_append_decode(1, 16) and not bm.can_append_decode(1, 17)
    with pytest.raises(OutOfPagesError):
        bm.append_decode(1, 17)


def test_errors() -> None:
    bm = BlockManager(num_ranks=2, num_pages=2, page_size=4)
    with pytest.raises(OutOfPagesError):
        bm.allocate_prefill(1, 17)  # 3 pages per rank > 2
    assert 1 not in bm  # a failed first allocation leaves nothing behind
    bm.allocate_prefill(1, 8)
    with pytest.raises(OutOfPagesError):
        bm.transition(1, 0, tokens=9)  # needs 3 pages, 1 free
    bm.free(1)
    with pytest.raises(BlockManagerError):
        bm.free(1)
    with pytest.raises(BlockManagerError):
        bm.append_decode(5, 3)
    with pytest.raises(BlockManagerError):
        bm.page_table(1)


def test_page_ids_are_per_rank_and_unique() -> None:
    bm = BlockManager(num_ranks=2, num_pages=6, page_size=2)
    a = bm.allocate_prefill(1, 8)  # 2 per rank
    b = bm.allocate_prefill(2, 8)
    for r in range(2):
        assert set(a[r]).isdisjoint(b[r])
        assert set(a[r]) | set(b[r]) <= set(range(6))
    bm.check_consistency()


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_never_leak(seed: int) -> None:
    rng = random.Random(seed)
    n, pages, ps = rng.randint(1, 4), 40, 4
    bm = BlockManager(n, pages, ps)
    lens: dict[int, int] = {}
    decoding: set[int] = set()
    for step in range(400):
        op = rng.random()
        if op < 0.3:
            tokens = rng.randint(1, 60)
            if bm.can_allocate_prefill(step, tokens):
                bm.allocate_prefill(step, tokens)
                lens[step] = tokens
        elif op < 0.5 and (cands := [r for r in lens if r not in decoding]):
            rid = rng.choice(cands)
            rank = rng.randrange(n)
            if bm.can_transition(rank, lens[rid] + 1):
                bm.transition(rid, rank, lens[rid] + 1)
                lens[rid] += 1
                decoding.add(rid)
        elif op < 0.8 and decoding:
            rid = rng.choice(sorted(decoding))
            if bm.can_append_decode(rid, lens[rid] + 1):
                bm.append_decode(rid, lens[rid] + 1)
                lens[rid] += 1
        elif lens:
            rid = rng.choice(sorted(lens))
            bm.free(rid)
            del lens[rid]
            decoding.discard(rid)
        bm.check_consistency()
    for rid in list(lens):
        bm.free(rid)
    assert all(bm.free_pages(r) == pages for r in range(n))
    assert all(bm.utilization(r) == 0.0 for r in range(n))
