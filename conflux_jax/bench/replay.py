"""Replaying a serving step: the host batches an executor builds, kept; the compiled
forward and sampler timed again on one of them, already on the devices.

Apart from ``host_time`` on purpose: that module makes four simulated CPU devices when it
is imported first, which a tool timing the one-device step must not inherit.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from conflux_jax.executor.batch import StepBatch


@contextlib.contextmanager
def captured_batches(executor: Any, want: Callable[[Any], bool] = lambda plan: True
                     ) -> Iterator[list[tuple[Any, StepBatch]]]:  # noqa: ANN401
    """Inside the block, every host batch ``executor`` builds for a plan ``want`` accepts
    is kept, as (shape, batch), in the list yielded; the executor is unchanged after."""
    kept: list[tuple[Any, StepBatch]] = []
    build = executor.build_batch

    def spy(plan: Any) -> Any:  # noqa: ANN401
        shape, batch, rows = build(plan)
        if want(plan):
            kept.append((shape, jax.tree.map(np.copy, batch)))
        return shape, batch, rows

    executor.build_batch = spy
    try:
        yield kept
    finally:
        executor.build_batch = build


def device_seconds(engine: Any, shape: Any, host: Any, repeats: int) -> float:  # noqa: ANN401
    """Median of ``repeats`` back-to-back runs of the compiled forward and sampler of
    ``shape`` on ``host``'s inputs, put on the devices once."""
    return statistics.median(device_times(engine, shape, host, repeats))


def device_times(engine: Any, shape: Any, host: Any, repeats: int) -> list[float]:  # noqa: ANN401
    """``repeats`` back-to-back runs (seconds) of the compiled forward and sampler of
    ``shape`` on ``host``'s inputs, put on the devices once (after one untimed run)."""
    ex = engine.executor
    forward, sampler = ex.compiled_step(shape)
    inputs = ex.device_inputs(host)
    times = []
    for i in range(repeats + 1):  # the first run warms up (and waits out a running step)
        start = time.perf_counter()
        out = forward(ex.params, ex.kv_pools, *inputs.forward)
        ex.kv_pools = out.kv_pools
        jax.device_get(sampler(out.logits, inputs.sample))
        if i:
            times.append(time.perf_counter() - start)
    return times
