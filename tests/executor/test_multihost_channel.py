"""The step message a multi-process leader posts: its followers rebuild the very batch.

Oracle: the leader's own host batch, leaf by leaf (a follower that rebuilt anything else
would run a different step). The two-process instance itself runs in test_multihost.py.
"""

from __future__ import annotations

import dataclasses

import jax
import multihost_instance as instance
import numpy as np
import pytest

from conflux_jax.executor import multihost
from conflux_jax.sampling import SamplingParams

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")


@pytest.fixture(scope="module")
def planned():
    """An engine and the plan of its first iteration (prefill of three requests)."""
    engine = instance.make_engine()
    for prompt in instance.prompts():
        engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0))
    return engine.executor, engine.scheduler.schedule(engine.executor.now())


@pytest.mark.parametrize("own_rows", [False, True])
def test_a_follower_rebuilds_the_leaders_batch(planned, own_rows):
    ex, plan = planned
    if own_rows:  # rows with their own token masks, histories and bias travel too
        first = plan.prefill[0]
        rid = first.request_id
        words = ex.layout.mask_words
        biased = dataclasses.replace(first, sampling=dataclasses.replace(
            first.sampling, logit_bias=((3, 2.5), (9, -1.0))))
        plan = dataclasses.replace(
            plan, token_masks={rid: np.arange(words, dtype=np.int32)},
            histories={rid: ([5, 6, 7], [8])}, prefill=(biased, *plan.prefill[1:]))
    shape, host, _ = ex.build_batch(plan)
    msg = multihost.decode(multihost.encode(41, shape, host))
    assert (msg.kind, msg.seq, msg.shape) == (multihost.STEP, 41, shape)
    assert (msg.masked, msg.penalized, msg.biased) == (own_rows,) * 3
    rebuilt = multihost.unpack(msg.payload,
                               ex._padding(shape, msg.masked, msg.penalized, msg.biased))
    for mine, theirs in zip(jax.tree.leaves(host), jax.tree.leaves(rebuilt), strict=True):
        if isinstance(mine, np.ndarray):
            assert theirs.dtype == mine.dtype and np.array_equal(theirs, mine)
        else:  # device-resident padding: the follower's own, of the same value
            assert np.array_equal(np.asarray(theirs), np.asarray(mine))
    if own_rows:
        sample = rebuilt.sample
        assert isinstance(sample.bitmask, np.ndarray)
        assert (2.5, -1.0) in {tuple(v[v != 0]) for v in sample.bias.reshape(-1, 1024)}


def test_stop_and_foreign_or_truncated_messages(planned):
    ex, plan = planned
    assert multihost.decode(multihost.encode_stop(7)) == multihost.StepMessage(multihost.STOP, 7)
    with pytest.raises(ValueError, match="not a conflux step message"):
        multihost.decode(b"\0" * 64)
    shape, host, _ = ex.build_batch(plan)
    msg = multihost.decode(multihost.encode(0, shape, host))
    template = ex._padding(shape, msg.masked, msg.penalized, msg.biased)
    with pytest.raises(ValueError, match="shorter"):
        multihost.unpack(msg.payload[:-4], template)
    with pytest.raises(ValueError, match="past its batch"):
        multihost.unpack(msg.payload + b"\0" * 4, template)
