"""One engine instance as the global router talks to it (``serving.routed_loop``).

``InstanceServer`` wraps an instance's running ``EngineLoop`` with the few calls the router
makes: a load report for a prompt, a generation as a stream of events, an abort by the
router's key, the loop's stats and what the ingress needs of the model (tokenizer, model
config, limits). Every value it returns pickles, so a Ray Serve replica forwards the same
calls unchanged (``serving.ray_app``), and in one process an ``InstanceServer`` is itself an
instance the router can use.

Expected outcomes (a refused prompt, a closed loop) are values (``Refused``), not
exceptions, so that they cross a process boundary as themselves; an exception from an
instance means the instance failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from conflux_jax.engine import EngineError, StepOutput
from conflux_jax.sampling import SamplingParams
from conflux_jax.scheduler.router import InstanceLoad
from serving.engine_loop import EngineLoop, EngineLoopClosed, RequestStream, Stats


@dataclasses.dataclass(frozen=True)
class Accepted:
    """The first event of a generation the instance took: its own request id."""

    request_id: int


@dataclasses.dataclass(frozen=True)
class Refused:
    """The instance did not take the request: ``closed`` when its loop takes no requests
    (try another instance), else the prompt is invalid (the client's error, anywhere)."""

    message: str
    param: str | None = None
    closed: bool = False


Event = Accepted | Refused | StepOutput


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the ingress needs of the served model: it tokenizes and validates there. The
    app reads ``tokenizer`` and ``model_config`` off ``loop.engine``; this stands in."""

    tokenizer: Any
    model_config: Any
    max_model_len: int
    max_logprobs: int


class InstanceServer:
    """The router-facing side of one instance's ``EngineLoop`` (see the module docstring).
    Call its methods on one asyncio event loop (the replica's, or the app's in-process)."""

    def __init__(self, name: str, loop: EngineLoop) -> None:
        self.name = name
        self.loop = loop
        self._streams: dict[str, RequestStream] = {}  # router key -> live generation

    async def load_report(self, prompt_ids: list[int], cache_salt: str,
                          max_new_tokens: int) -> InstanceLoad | Refused:
        try:
            return await asyncio.wrap_future(
                self.loop.load_report(prompt_ids, cache_salt, max_new_tokens))
        except EngineLoopClosed as exc:
            return Refused(str(exc), closed=True)
        except EngineError as exc:
            return Refused(str(exc), exc.param)

    async def generate(self, key: str, prompt_ids: list[int], sampling: SamplingParams,
                       kwargs: dict[str, Any]) -> AsyncIterator[Event]:
        """``Accepted`` then the request's ``StepOutput``s up to the finished one, or one
        ``Refused``. Closing the generator early aborts the request."""
        try:
            stream = self.loop.submit(prompt_ids, sampling, **kwargs)
        except EngineLoopClosed as exc:
            yield Refused(str(exc), closed=True)
            return
        self._streams[key] = stream
        try:
            try:
                rid = await stream.accepted
            except EngineLoopClosed as exc:
                yield Refused(str(exc), closed=True)
                return
            except (EngineError, ValueError) as exc:
                yield Refused(str(exc), getattr(exc, "param", "prompt"))
                return
            yield Accepted(rid)
            async for out in stream:
                yield out
        finally:
            self._streams.pop(key, None)
            self.loop.abort(stream)  # no-op once finished

    async def abort(self, key: str) -> None:
        stream = self._streams.get(key)
        if stream is not None:
            self.loop.abort(stream)

    async def stats(self) -> Stats:
        """The loop's latest stats; raises ``EngineLoopClosed`` once the loop has stopped
        (the router then counts this instance as down)."""
        if not self.loop.alive:
            raise EngineLoopClosed(f"the engine loop of {self.name} is not running")
        return self.loop.stats

    async def describe(self) -> ModelInfo:
        engine = self.loop.engine
        return ModelInfo(engine.tokenizer, engine.model_config, engine.max_model_len,
                         engine.config.executor.num_top_logprobs)
