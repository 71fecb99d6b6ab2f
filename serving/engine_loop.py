"""The one thread that owns the engine.

The engine is not thread-safe, so every call into it (add, abort, step, warm-up) happens
on this thread. HTTP handlers talk to it through a thread-safe intake queue and get their
``StepOutput``s back on per-request asyncio queues (``loop.call_soon_threadsafe``, one
call per step for all requests of that step). The loop steps while there is work and
blocks on the intake when idle, so an idle server burns no CPU. Woken from idle, it keeps
taking requests while they come less than ``burst_gap_s`` apart (at most
``burst_max_s``): clients that send together reach the HTTP handlers one by one, and
without the wait the first would start a step alone and the rest would wait it out (on a
CPU, a 256-token prefill step is most of a second).

Failure policy: the engine already turns an exception inside ``step()`` into "error"
finishes of that step's requests. Anything else that escapes (a bug in the scheduler, a
bad request that slipped through) fails every request the engine holds, frees their
pages, and the loop keeps serving. Only a lost executor (``ExecutorLost``: a process of a
multi-process instance died) stops the loop: no later step could run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import inspect
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from conflux_jax.engine import EngineError, StepOutput
from conflux_jax.plan import ExecutorLost
from conflux_jax.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineLoopClosed(RuntimeError):
    """The loop is stopped (shutting down) and takes no new requests."""


class GenerationFailed(RuntimeError):
    """A request that was accepted cannot go on (its engine instance failed); a
    ``RequestStream`` raises it in place of the outputs that will never come, and the
    message says what failed."""


@dataclasses.dataclass
class Stats:
    """A snapshot the loop publishes after each iteration and each intake of admissions or
    aborts (read by /metrics)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_pages_used: int = 0  # summed over ranks; 0 when idle, else pages leaked
    steps: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, ever
    prefix_hits: int = 0  # of which the cache served


class RequestStream:
    """The HTTP side of one request: an asyncio queue fed by the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self.accepted: asyncio.Future[int] = loop.create_future()
        self.request_id: int | None = None
        self.finished = False
        # The engine instance serving it, where several serve behind a router.
        self.served_by: str | None = None

    def refuse(self, exc: BaseException) -> None:
        """The request was not taken: ``accepted`` raises ``exc`` and no output follows."""
        if not self.accepted.done():
            self.accepted.set_exception(exc)
        self.finished = True

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self.finished = True
            yield item


@dataclasses.dataclass
class _Add:
    prompt: str | list[int]
    sampling: SamplingParams
    kwargs: dict[str, Any]
    stream: RequestStream


@dataclasses.dataclass
class _Abort:
    stream: RequestStream


@dataclasses.dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future[Any]


_WAKE = object()
SWITCH_INTERVAL_S = 0.0005


# The running loop of each engine (by id): one thread steps an engine, never two.
_OWNERS: dict[int, EngineLoop] = {}
_OWNERS_LOCK = threading.Lock()


class EngineLoop:
    """Runs ``engine.step()`` on a background thread; see the module docstring."""

    def __init__(self, engine: Any, *, idle_wait_s: float = 0.5, burst_gap_s: float = 0.003,
                 burst_max_s: float = 0.05) -> None:
        self.engine = engine
        self._intake: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}
        self._stop = threading.Event()
        self._drain = True
        self._thread: threading.Thread | None = None
        self._idle_wait_s = idle_wait_s
        self._burst_gap_s, self._burst_max_s = burst_gap_s, burst_max_s
        self.ready = threading.Event()
        self.stats = Stats()
        self.warmup_s: float | None = None
        self.on_ready: Callable[[], None] | None = None
        # Warm-up failed or the executor is lost: the server cannot serve.
        self.on_fatal: Callable[[], None] | None = None
        self._accepts_slo = _accepts_slo(engine)

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, warmup: bool = False) -> None:
        """Start the thread; with ``warmup`` it compiles every bucket first (not ready
        until that is done), then forbids any later compilation.

        Raises:
          RuntimeError: another running loop already drives this engine (two threads
            stepping one engine would interleave its plans).
        """
        with _OWNERS_LOCK:
            owner = _OWNERS.get(id(self.engine))
            if owner is not None and owner is not self and owner.alive:
                raise RuntimeError("this engine is already driven by a running EngineLoop; "
                                   "share that loop or stop it first")
            _OWNERS[id(self.engine)] = self
        # The engine thread drops the GIL for every device call; getting it back from the
        # HTTP thread takes up to the switch interval (5 ms by default), a few times a step.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, args=(warmup,),
                                        name="conflux-engine", daemon=True)
        self._thread.start()

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the thread. ``drain`` lets in-flight requests finish first; without it
        they are aborted (their streams end with finish_reason "abort")."""
        self._drain = drain
        self._stop.set()
        self._intake.put(_WAKE)
        if self._thread is not None:
            self._thread.join(timeout)
        with _OWNERS_LOCK:
            if _OWNERS.get(id(self.engine)) is self and not self.alive:
                del _OWNERS[id(self.engine)]

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ HTTP side
    def submit(self, prompt: str | list[int], sampling: SamplingParams,
               **kwargs: Any) -> RequestStream:
        """Queue a request (call from the event loop); await ``stream.accepted`` for its
        id or the ``EngineError`` that refused it."""
        if self._stop.is_set():
            raise EngineLoopClosed("the server is shutting down")
        if not self._accepts_slo:
            kwargs = {k: v for k, v in kwargs.items() if k not in ("ttft_slo_s", "tbt_slo_s")}
        stream = RequestStream(asyncio.get_running_loop())
        self._intake.put(_Add(prompt, sampling, kwargs, stream))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Abort a request (client went away); frees its KV pages on the engine thread."""
        if not stream.finished:
            self._intake.put(_Abort(stream))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn(engine)`` on the engine thread between two steps (the engine is not
        thread-safe) and resolve the future with its result or exception; from any thread.
        A loop that is not running fails the future with ``EngineLoopClosed``."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self._stop.is_set() or not self.alive:
            future.set_exception(EngineLoopClosed("the engine loop is not running"))
            return future
        self._intake.put(_Call(fn, future))
        if not self.alive:  # stopped between the check and the put: nobody may take it
            self._refuse_queued()
        return future

    def load_report(self, prompt_ids: list[int], cache_salt: str = "",
                    max_new_tokens: int = 1) -> concurrent.futures.Future[Any]:
        """The engine's ``load_report`` for a prompt (what the global router compares)."""
        return self.call(lambda engine: engine.load_report(prompt_ids, cache_salt,
                                                           max_new_tokens))

    # ------------------------------------------------------------------ engine thread
    def _run(self, warmup: bool) -> None:
        if warmup:
            try:
                self.warmup_s = self.engine.warmup(progress=True)  # compile, calibrate
                self.engine.executor.guard.serving = True
            except Exception:
                log.exception("warm-up failed; the server cannot serve")
                self._stop.set()
                if self.on_fatal is not None:
                    self.on_fatal()
                return
        self.ready.set()
        if self.on_ready is not None:
            self.on_ready()
        while True:
            busy = self.engine.has_unfinished
            if self._stop.is_set() and (not busy or not self._drain):
                break
            try:
                self._take_intake(block=not busy)
                if self.engine.has_unfinished:
                    self._iterate()
            except Exception:  # a bug on our side: fail what is in flight, keep serving
                log.exception("engine loop error; failing every in-flight request")
                self._abort_everything("engine loop error", reason="error")
        self._abort_everything("the server is shutting down")
        self._refuse_queued()
        self.ready.clear()

    def _take_intake(self, block: bool) -> None:
        try:
            item = self._intake.get(timeout=self._idle_wait_s) if block \
                else self._intake.get_nowait()
        except queue.Empty:
            return
        # Idle until now: the rest of a burst is probably on its way (module docstring).
        until = time.monotonic() + self._burst_max_s if block else 0.0
        while True:
            self._handle(item)
            try:
                wait = min(self._burst_gap_s, until - time.monotonic())
                item = self._intake.get(timeout=wait) if wait > 0 else self._intake.get_nowait()
            except queue.Empty:
                break
        # Admissions and aborts change the gauges now, not at the next step (which, after
        # the last client disconnects, may never come).
        self._publish_stats(stepped=False)

    def _handle(self, item: Any) -> None:
        if isinstance(item, _Add):
            stream = item.stream
            if self._stop.is_set():
                _post(stream, lambda: stream.refuse(EngineLoopClosed(
                    "the server is shutting down")))
                return
            try:
                rid = self.engine.add_request(item.prompt, item.sampling, **item.kwargs)
            except (EngineError, ValueError) as exc:
                _post(stream, lambda e=exc: stream.refuse(e))
                return
            except Exception as exc:  # never let one request take the loop down
                log.exception("add_request failed")
                _post(stream, lambda e=exc: stream.refuse(e))
                return
            stream.request_id = rid
            self._streams[rid] = stream
            _post(stream, lambda: _accept(stream, rid))
        elif isinstance(item, _Abort):
            rid = item.stream.request_id
            if rid is not None and self._streams.pop(rid, None) is not None:
                self._safe_abort(rid)
        elif isinstance(item, _Call):
            if not item.future.set_running_or_notify_cancel():
                return
            try:
                item.future.set_result(item.fn(self.engine))
            except Exception as exc:  # the caller's to handle; the loop goes on
                item.future.set_exception(exc)

    def _iterate(self) -> None:
        try:
            outputs = self.engine.step()
        except ExecutorLost as exc:
            log.error("the instance cannot run any further step: %s", exc)
            self._abort_everything(f"the instance failed: {exc}", reason="error")
            self._stop.set()  # the loop ends: it holds no request now
            if self.on_fatal is not None:
                self.on_fatal()
            return
        except Exception as exc:
            log.exception("engine step raised; failing every in-flight request")
            self._abort_everything(f"internal error while generating: {exc!r}", reason="error")
            return
        self._publish_stats(stepped=True)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StepOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is listening
                for _, out in items:
                    if not out.finished:
                        self._streams.pop(out.request_id, None)
                        self._safe_abort(out.request_id)

    def _abort_everything(self, message: str, reason: str = "abort") -> None:
        now = time.perf_counter()
        for rid, stream in list(self._streams.items()):
            self._safe_abort(rid)
            out = StepOutput(rid, [], "", True, reason, now)
            _post(stream, lambda s=stream, o=out: _deliver([(s, o)]))
        self._streams.clear()
        self._publish_stats(stepped=False)
        if message:
            log.debug("aborted all requests: %s", message)

    def _refuse_queued(self) -> None:
        while True:
            try:
                item = self._intake.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Add):
                s = item.stream
                _post(s, lambda s=s: s.refuse(EngineLoopClosed(
                    "the server is shutting down")))
            elif isinstance(item, _Call) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(EngineLoopClosed("the engine loop stopped"))

    def _safe_abort(self, rid: int) -> None:
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("abort of request %d failed", rid)

    def _publish_stats(self, stepped: bool) -> None:
        eng = self.engine
        try:
            bm = eng.scheduler.blocks
            used = sum(bm.used_pages(r) for r in range(bm.num_ranks))
            waiting = eng.scheduler.num_pending
            self.stats = Stats(running=max(0, eng.num_unfinished - waiting), waiting=waiting,
                               kv_usage=used / (bm.num_pages * bm.num_ranks),
                               kv_pages_used=used, steps=self.stats.steps + int(stepped),
                               prefix_queries=eng.scheduler.prefix_queries,
                               prefix_hits=eng.scheduler.prefix_hits)
        except Exception:  # stats are best effort; never stop serving for them
            log.debug("could not read engine stats", exc_info=True)


def _accepts_slo(engine: Any) -> bool:
    try:
        params = inspect.signature(engine.add_request).parameters
    except (TypeError, ValueError):
        return False
    return "ttft_slo_s" in params and "tbt_slo_s" in params


def _post(stream: RequestStream, fn: Callable[[], None]) -> None:
    with contextlib.suppress(RuntimeError):  # event loop closed: nobody is listening
        stream.loop.call_soon_threadsafe(fn)


def _accept(stream: RequestStream, rid: int) -> None:
    if not stream.accepted.done():
        stream.accepted.set_result(rid)


def _deliver(items: list[tuple[RequestStream, StepOutput]]) -> None:
    for stream, out in items:
        if not stream.accepted.done():  # accepted before any output; keep order anyway
            stream.accepted.set_result(out.request_id)
        stream.queue.put_nowait(out)
