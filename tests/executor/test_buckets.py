"""Bucket choice: the smallest covering shape, and warm-up covers every reachable shape."""

import itertools

import pytest

from conflux_jax.executor.buckets import BucketConfig, ShapePlanner
from conflux_jax.executor.device import default_buckets


def _planner():
    return ShapePlanner(BucketConfig(tokens=(8, 32, 128), decode=(4, 16), decode_pages=(2, 8),
                                     transfer=(1, 2)), max_pages_per_seq=16, transfer_groups=5)


def test_smallest_covering_buckets():
    pl = _planner()
    s = pl.shape_for(prefill_max=0, decode_max=3, combined_max=3, decode_pages_max=2)
    assert (s.tokens, s.prefill, s.decode, s.decode_pages, s.transfer) == (8, 0, 4, 2, 0)
    s = pl.shape_for(prefill_max=20, decode_max=5, combined_max=25, decode_pages_max=9)
    assert (s.tokens, s.prefill, s.decode, s.decode_pages, s.transfer) == (32, 32, 16, 16, 0)
    # the transfer follows the groups that move: bucketed, capped at one max-length request
    assert pl.transfer_buckets() == (1, 2, 5)
    moved = {g: pl.shape_for(20, 5, 25, 9, transfer_max=g).transfer for g in range(6)}
    assert moved == {0: 0, 1: 1, 2: 2, 3: 5, 4: 5, 5: 5}


def test_transfer_needs_prefill_and_fits_the_largest_request():
    pl = _planner()
    with pytest.raises(ValueError, match="no KV to transfer"):
        pl.shape_for(0, 3, 3, 2, transfer_max=1)
    with pytest.raises(ValueError, match="KV transfer"):
        pl.shape_for(20, 0, 20, 1, transfer_max=6)


def test_every_reachable_shape_is_compiled_at_warmup():
    pl = _planner()
    warm = set(pl.all_shapes())
    seen = set()
    # Brute force over every per-rank load the executor can face.
    for n_p, n_d, pages, x in itertools.product(range(0, 129, 3), range(0, 17), range(1, 17),
                                                range(6)):
        if n_p + n_d > 128 or n_p + n_d == 0 or (x and not n_p):
            continue
        seen.add(pl.shape_for(n_p, n_d, n_p + n_d, pages, x))
    assert seen <= warm
    assert len(warm) == len(seen)  # and warm-up compiles nothing unreachable


def test_oversized_load_is_a_clear_error():
    with pytest.raises(ValueError, match="largest bucket"):
        _planner().shape_for(0, 1, 129, 1)


def test_single_row_buckets_serve_only_decode_only_steps():
    pl = ShapePlanner(BucketConfig(), max_pages_per_seq=32, transfer_groups=8)
    assert pl.buckets.tokens[0] == 1 and pl.buckets.decode[0] == 1  # the defaults have them
    one = pl.shape_for(prefill_max=0, decode_max=1, combined_max=1, decode_pages_max=3)
    assert (one.tokens, one.prefill, one.decode) == (1, 0, 1)
    # a one-token prefill, alone or beside one decode, takes the next buckets
    for n_d in (0, 1):
        s = pl.shape_for(prefill_max=1, decode_max=n_d, combined_max=1 + n_d,
                         decode_pages_max=3)
        assert (s.tokens, s.prefill, s.decode) == (4, 4, 4)
    seen = {pl.shape_for(n_p, n_d, n_p + n_d, 32)
            for n_p, n_d in itertools.product(range(257), range(65)) if 0 < n_p + n_d <= 256}
    warm = set(pl.all_shapes())
    assert seen <= warm
    assert {(s.tokens, s.prefill, s.decode) for s in warm if 1 in (s.tokens, s.decode)} \
        == {(1, 0, 1)}  # one extra executable


def test_accelerator_page_tables_follow_the_context():
    """On a GPU/TPU a decode step's page table is as wide as its longest context needs
    (steps of 8x), not the max model length's: at 128K tokens of 16-token pages a short
    step sends 128 pages per sequence, not 8192; the widths stop at the max length's."""
    long = ShapePlanner(default_buckets("gpu"), max_pages_per_seq=8192, transfer_groups=2048)
    assert long.decode_page_buckets() == (128, 1024, 8192)
    widths = [long.shape_for(0, 16, 16, n).decode_pages for n in (3, 128, 129, 5000, 8192)]
    assert widths == [128, 128, 1024, 8192, 8192]
    short = ShapePlanner(default_buckets("gpu"), max_pages_per_seq=128, transfer_groups=32)
    assert short.decode_page_buckets() == (128,)  # 2K tokens: one width, no more compiles
    assert default_buckets("cpu").decode_pages == (1 << 30,)  # CPU: one width
