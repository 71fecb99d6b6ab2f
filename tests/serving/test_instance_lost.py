"""A lost executor (a process of a multi-process instance died) stops the server's engine
loop: the open requests fail, the loop calls ``on_fatal`` and takes no new request.

Fault injection at the executor boundary, as in test_serving_errors.py; the real loss
(a killed follower process) is in tests/test_multihost.py.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from conflux_jax.plan import ExecutorLost
from conflux_jax.sampling import SamplingParams
from serving.engine_loop import EngineLoop, EngineLoopClosed


def test_a_lost_executor_fails_the_open_requests_and_stops_the_loop(tiny_engine):
    executor = tiny_engine.executor
    real_launch = executor.launch  # how the engine starts each plan
    steps = 0

    def lost_after_two_steps(plan, prepare=None, after=None):
        nonlocal steps
        steps += 1
        if steps > 2:
            raise ExecutorLost("process 1 of 2 died")
        return real_launch(plan, prepare, after)

    fatal = threading.Event()
    loop = EngineLoop(tiny_engine)
    loop.on_fatal = fatal.set
    executor.launch = lost_after_two_steps
    try:
        loop.start(warmup=False)

        async def stream() -> list:
            s = loop.submit([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
            return [out async for out in s]

        outs = asyncio.run(asyncio.wait_for(stream(), 60))
        assert fatal.wait(10)
        loop.stop(timeout=10)
        assert not loop.alive
    finally:
        executor.launch = real_launch
    assert len(outs) == 3 and outs[-1].finished and outs[-1].finish_reason == "error"
    assert not tiny_engine.has_unfinished
    bm = tiny_engine.scheduler.blocks
    assert all(bm.free_pages(r) == bm.num_pages for r in range(bm.num_ranks))

    async def submit_again() -> None:
        loop.submit([5], SamplingParams(max_tokens=1))

    with pytest.raises(EngineLoopClosed):
        asyncio.run(submit_again())
