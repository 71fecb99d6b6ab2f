"""The engine loop takes a burst of requests into one step (clients that send together reach
the HTTP handlers one by one, a few milliseconds apart), and gets the GIL back promptly."""

from __future__ import annotations

import asyncio
import sys

import pytest

from conflux_jax.sampling import SamplingParams
from serving.engine_loop import SWITCH_INTERVAL_S, EngineLoop


def test_requests_arriving_ms_apart_share_the_first_step(tiny_engine):
    executor = tiny_engine.executor
    real_launch = executor.launch  # how the engine starts each plan
    steps: list[set[int]] = []

    def spy(plan, prepare=None, after=None):
        steps.append(set(plan.request_ids))
        return real_launch(plan, prepare, after)

    # idle: blocked on its intake. A wider gap than the default 3 ms, so a busy host's
    # scheduling jitter between the submits cannot split the burst.
    loop = EngineLoop(tiny_engine, burst_gap_s=0.05, burst_max_s=0.5)
    executor.launch = spy
    try:
        loop.start(warmup=False)

        async def burst() -> list[list]:
            streams = []
            for i in range(4):  # as the HTTP handlers hand them over, ~1 ms apart
                # ignore_eos: random tiny weights may sample EOS first
                streams.append(loop.submit([5 + i, 6, 7],
                                           SamplingParams(max_tokens=2, ignore_eos=True)))
                await asyncio.sleep(0.001)
            ids = [await s.accepted for s in streams]

            async def drain(s) -> list:
                return [out async for out in s]

            outs = await asyncio.gather(*(drain(s) for s in streams))
            return ids, outs

        ids, outs = asyncio.run(asyncio.wait_for(burst(), 60))
        loop.stop(timeout=10)
    finally:
        executor.launch = real_launch
    assert steps[0] == set(ids)  # all four prefilled together, none waited out a step
    # After each device call the engine thread waits at most this long for the GIL.
    assert sys.getswitchinterval() <= SWITCH_INTERVAL_S
    for o in outs:  # and each got its two tokens
        assert o[-1].finished and sum(len(x.new_token_ids) for x in o) == 2


def test_a_second_running_loop_on_one_engine_is_refused(tiny_engine):
    """Two threads stepping one engine would interleave its plans (the scheduler then
    refuses every step): the second loop's start says so instead; once the first stops,
    a new one may take over."""
    first, second = EngineLoop(tiny_engine), EngineLoop(tiny_engine)
    first.start(warmup=False)
    try:
        with pytest.raises(RuntimeError, match="already driven by a running EngineLoop"):
            second.start(warmup=False)
        assert not second.alive
    finally:
        first.stop(timeout=10)
    second.start(warmup=False)
    try:
        assert second.alive
    finally:
        second.stop(timeout=10)
