"""Many engine instances behind the global router, as one ``EngineLoop`` to the app.

``RoutedLoop`` has the interface ``serving.app.create_app`` and ``serving.request_flow`` use
(``ready``, ``alive``, ``submit``, ``abort``, ``stats``, ``engine.tokenizer``,
``engine.model_config``, ``stop``), so the OpenAI layer is the single server's. ``submit``
asks every live instance for its load report on the prompt, lets
``conflux_jax.scheduler.router.Router`` pick one, and forwards the request there, feeding
the instance's outputs into the request's ``RequestStream``.

Failures, with a timeout on every call to an instance:

- an instance that fails a load report, a stats poll or the start of a generation is down:
  it gets no requests until a stats poll (every ``poll_interval_s``) answers again;
- a request not yet accepted when its instance fails goes to the next live instance;
  none left is a 503 naming why each instance is down;
- a request its instance fails mid-way ends with ``GenerationFailed`` naming the instance
  (an error event in the stream, a 502 otherwise); the others keep serving.

``stats`` (what /metrics shows) sums the instances' latest polled stats; the cumulative
counters only go up, across an instance's restart too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, Protocol

from conflux_jax.engine import EngineError, StepOutput
from conflux_jax.sampling import SamplingParams
from conflux_jax.scheduler.router import InstanceLoad, Router
from serving.engine_loop import EngineLoopClosed, GenerationFailed, RequestStream, Stats
from serving.instance import Accepted, Event, ModelInfo, Refused

log = logging.getLogger(__name__)


class Instance(Protocol):
    """An engine instance as the router calls it (``serving.instance.InstanceServer`` in
    one process, ``serving.ray_app.RayInstance`` over Ray Serve)."""

    name: str

    async def load_report(self, prompt_ids: list[int], cache_salt: str,
                          max_new_tokens: int) -> InstanceLoad | Refused: ...

    def generate(self, key: str, prompt_ids: list[int], sampling: SamplingParams,
                 kwargs: dict[str, Any]) -> AsyncIterator[Event]: ...

    async def abort(self, key: str) -> None: ...

    async def stats(self) -> Stats: ...

    async def describe(self) -> ModelInfo: ...


@dataclasses.dataclass(frozen=True)
class Timeouts:
    report_s: float = 2.0  # a load report or a stats poll
    start_s: float = 30.0  # a generation's acceptance
    output_s: float = 120.0  # between two outputs of a generation (a long queue waits)
    poll_interval_s: float = 1.0  # stats polls, which also bring down instances back

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"the router's {f.name} must be positive")


_END = object()


async def describe_any(instances: Sequence[Instance], timeout_s: float) -> ModelInfo:
    """The model of the first instance that answers (all serve the same model)."""
    errors = []
    for inst in instances:
        try:
            return await asyncio.wait_for(inst.describe(), timeout_s)
        except Exception as exc:
            errors.append(f"{inst.name}: {_reason(exc)}")
    raise RuntimeError("no engine instance answered: " + "; ".join(errors))


class RoutedLoop:
    """See the module docstring. Use it on one asyncio event loop; ``start`` it there."""

    def __init__(self, instances: Sequence[Instance], info: ModelInfo, *,
                 policy: str = "conflux", timeouts: Timeouts = Timeouts()) -> None:
        if not instances:
            raise ValueError("the router needs at least one engine instance")
        names = [inst.name for inst in instances]
        if len(set(names)) != len(names):
            raise ValueError(f"engine instance names must differ: {names}")
        self.instances = list(instances)
        self.router = Router(policy)
        self.timeouts = timeouts
        self.engine = info  # what the app reads off loop.engine
        self.ready = threading.Event()
        self.stats = Stats()
        self.down: dict[int, str] = {}  # instance index -> why it is down
        self._totals = _Totals(len(self.instances))
        self._routes: dict[RequestStream, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._ids = itertools.count()
        self._aio: asyncio.AbstractEventLoop | None = None
        self._poller: asyncio.Task[None] | None = None
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Poll every instance once (so /health and /metrics know them), then keep
        polling in the background."""
        self._aio = asyncio.get_running_loop()
        await self.poll()
        self._poller = self._aio.create_task(self._poll_forever())
        self.ready.set()

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop polling and routing (from any thread). Without ``drain`` the requests in
        flight are aborted on their instances; with it they run on (the HTTP server has
        drained them by the time it stops the loop). The instances run on: they are
        deployments of their own."""
        self._stopped = True
        self.ready.clear()
        aio = self._aio
        if aio is None or aio.is_closed():
            return

        def cancel() -> None:
            if self._poller is not None:
                self._poller.cancel()
            if not drain:
                for task in list(self._routes.values()):
                    task.cancel()

        if _running_loop() is aio:
            cancel()
        else:
            aio.call_soon_threadsafe(cancel)

    @property
    def alive(self) -> bool:
        return not self._stopped and len(self.down) < len(self.instances)

    # ------------------------------------------------------------------ HTTP side
    def submit(self, prompt: str | list[int], sampling: SamplingParams,
               **kwargs: Any) -> RequestStream:
        """Route and forward a request (call from the event loop); await
        ``stream.accepted`` for its id, or the error that refused it."""
        if self._stopped:
            raise EngineLoopClosed("the server is shutting down")
        if isinstance(prompt, str):  # the app tokenizes; the instances get token ids
            raise ValueError("the router forwards token ids; tokenize the prompt first")
        stream = RequestStream(asyncio.get_running_loop())
        task = stream.loop.create_task(
            self._route(stream, uuid.uuid4().hex, [int(t) for t in prompt], sampling, kwargs))
        self._routes[stream] = task
        task.add_done_callback(lambda _: self._routes.pop(stream, None))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Abort a request (client went away): its instance frees its KV pages."""
        task = self._routes.get(stream)
        if task is not None and not task.done():
            task.cancel()

    # ------------------------------------------------------------------ routing
    async def _route(self, stream: RequestStream, key: str, ids: list[int],
                     sampling: SamplingParams, kwargs: dict[str, Any]) -> None:
        tried: set[int] = set()
        while True:  # until an instance takes it (or refuses it as invalid)
            try:
                idx = await self._pick(ids, kwargs.get("cache_salt") or "",
                                       sampling.max_tokens or 1, tried)
            except (EngineError, EngineLoopClosed) as exc:
                stream.refuse(exc)
                return
            inst = self.instances[idx]
            events = inst.generate(key, ids, sampling, kwargs)
            try:
                first = await asyncio.wait_for(_next(events), self.timeouts.start_s)
            except asyncio.CancelledError:
                await self._abandon(inst, key, events)
                raise
            except Exception as exc:  # the instance failed before taking the request
                await self._abandon(inst, key, events)
                self._mark_down(idx, _reason(exc))
                tried.add(idx)
                continue
            if first is _END or (isinstance(first, Refused) and first.closed):
                await _close(events)
                self._mark_down(idx, first.message if isinstance(first, Refused)
                                else "it ended a generation before accepting it")
                tried.add(idx)
                continue
            break
        if isinstance(first, Refused):
            await _close(events)
            stream.refuse(EngineError(first.message, first.param or "prompt"))
            return
        assert isinstance(first, Accepted)
        rid = next(self._ids)
        stream.request_id, stream.served_by = rid, inst.name
        if not stream.accepted.done():
            stream.accepted.set_result(rid)
        await self._forward(stream, rid, idx, key, events)

    async def _forward(self, stream: RequestStream, rid: int, idx: int, key: str,
                       events: AsyncIterator[Event]) -> None:
        """The accepted request's outputs into its stream, until the finished one."""
        inst = self.instances[idx]
        try:
            while True:
                try:
                    item = await asyncio.wait_for(_next(events), self.timeouts.output_s)
                except TimeoutError:  # slow or stuck, maybe not dead: fail only this one
                    raise _Stalled(f"it sent nothing for {self.timeouts.output_s:g} s") from None
                if item is _END:
                    raise _Stalled("it ended the stream before the request finished")
                if not isinstance(item, StepOutput):
                    raise _Stalled(f"it sent {type(item).__name__} mid-stream")
                stream.queue.put_nowait(dataclasses.replace(item, request_id=rid))
                if item.finished:
                    await _close(events)
                    return
        except asyncio.CancelledError:
            await self._abandon(inst, key, events)
            raise
        except Exception as exc:
            await self._abandon(inst, key, events)
            if not isinstance(exc, _Stalled):
                self._mark_down(idx, _reason(exc))
            stream.queue.put_nowait(GenerationFailed(
                f"engine instance {inst.name} failed while generating this request "
                f"({_reason(exc)}); the request was aborted, the other instances keep "
                "serving"))

    async def _pick(self, ids: list[int], cache_salt: str, max_new_tokens: int,
                    tried: set[int]) -> int:
        candidates = [i for i in range(len(self.instances))
                      if i not in self.down and i not in tried]
        reports = await asyncio.gather(*(self._report(i, ids, cache_salt, max_new_tokens)
                                         for i in candidates))
        loads: list[InstanceLoad | None] = [None] * len(self.instances)
        for i, report in zip(candidates, reports, strict=True):
            if isinstance(report, Refused):
                raise EngineError(report.message, report.param or "prompt")
            loads[i] = report
        if all(load is None for load in loads):
            raise EngineLoopClosed(self._no_instance())
        return self.router.pick(loads)

    async def _report(self, idx: int, ids: list[int], cache_salt: str,
                      max_new_tokens: int) -> InstanceLoad | Refused | None:
        inst = self.instances[idx]
        try:
            report = await asyncio.wait_for(
                inst.load_report(ids, cache_salt, max_new_tokens), self.timeouts.report_s)
        except Exception as exc:
            self._mark_down(idx, f"no load report: {_reason(exc)}")
            return None
        if isinstance(report, Refused) and report.closed:
            self._mark_down(idx, report.message)
            return None
        return report

    # ------------------------------------------------------------------ health, stats
    async def poll(self) -> None:
        """Ask every instance for its stats: those answering are up, the rest down."""
        results = await asyncio.gather(*(self._stats_of(i)
                                         for i in range(len(self.instances))))
        for i, result in enumerate(results):
            if isinstance(result, Stats):
                if self.down.pop(i, None) is not None:
                    log.info("engine instance %s is back", self.instances[i].name)
            else:
                self._mark_down(i, result)
        self.stats = self._totals.add([r if isinstance(r, Stats) else None for r in results])

    async def _stats_of(self, idx: int) -> Stats | str:
        try:
            result = await asyncio.wait_for(self.instances[idx].stats(),
                                            self.timeouts.report_s)
        except Exception as exc:
            return f"no stats: {_reason(exc)}"
        return result if isinstance(result, Stats) else f"bad stats {type(result).__name__}"

    async def _poll_forever(self) -> None:
        while not self._stopped:
            await asyncio.sleep(self.timeouts.poll_interval_s)
            try:
                await self.poll()
            except Exception:  # polling is best effort; the next one tries again
                log.exception("polling the engine instances failed")

    def _mark_down(self, idx: int, why: str) -> None:
        if idx not in self.down:
            log.warning("engine instance %s is down: %s", self.instances[idx].name, why)
        self.down[idx] = why

    def _no_instance(self) -> str:
        why = "; ".join(f"{self.instances[i].name}: {w}" for i, w in sorted(self.down.items()))
        return f"no engine instance is available ({why or 'none answered'}); retry shortly"

    async def _abandon(self, inst: Instance, key: str, events: AsyncIterator[Event]) -> None:
        """Stop a generation we no longer follow: close our end, and tell the instance
        (in the background, bounded: it may be the one that failed)."""
        await _close(events)
        self._spawn(asyncio.wait_for(inst.abort(key), self.timeouts.report_s))

    def _spawn(self, work: Awaitable[Any]) -> None:
        async def run() -> None:
            try:
                await work
            except Exception as exc:
                log.debug("background call to an instance failed: %s", _reason(exc))

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _Totals:
    """The instances' stats summed: gauges over the instances answering now, counters
    (steps, prefix queries and hits) as running totals that survive an instance's
    restart (its own totals start again from zero)."""

    COUNTERS = ("steps", "prefix_queries", "prefix_hits")

    def __init__(self, n: int) -> None:
        self._last: list[Stats | None] = [None] * n
        self._sum = dict.fromkeys(self.COUNTERS, 0)

    def add(self, stats: list[Stats | None]) -> Stats:
        live = [s for s in stats if s is not None]
        for i, s in enumerate(stats):
            if s is None:
                continue
            last = self._last[i]
            for name in self.COUNTERS:
                now, before = getattr(s, name), 0 if last is None else getattr(last, name)
                self._sum[name] += now - before if now >= before else now
            self._last[i] = s
        return Stats(running=sum(s.running for s in live), waiting=sum(s.waiting for s in live),
                     kv_usage=sum(s.kv_usage for s in live) / len(live) if live else 0.0,
                     kv_pages_used=sum(s.kv_pages_used for s in live), **self._sum)


class _Stalled(Exception):
    """An instance that answers but does not carry the request on."""


async def _next(events: AsyncIterator[Event]) -> Any:
    # StopAsyncIteration must not escape a task that wait_for runs.
    try:
        return await anext(events)
    except StopAsyncIteration:
        return _END


async def _close(events: AsyncIterator[Event]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception as exc:  # closing a failed instance's stream can fail too
            log.debug("closing an instance's stream failed: %s", _reason(exc))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _reason(exc: BaseException) -> str:
    """One line for an instance's failure (a remote error's first line, not its trace)."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
