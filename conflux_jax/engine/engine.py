"""The engine: requests in, streamed tokens out, over the one driver loop.

``Engine.step()`` runs one iteration of :class:`~conflux_jax.engine.core.EngineCore`: the
scheduler plans (which prefill chunks on which ranks, which decodes, which KV pages), the
JAX executor runs the plan on the device mesh, and every sampled token goes through the
request's ``OutputTracker`` (detokenize, stop strings, EOS, max_tokens) before the
scheduler commits the iteration. Finished requests leave the scheduler, which frees their
KV pages.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from conflux_jax.engine.calibration import ENV_VAR as CALIBRATE_ENV
from conflux_jax.engine.calibration import Budget, calibrate, load_saved
from conflux_jax.engine.core import EngineCore, InFlight, Observer, StepFailed
from conflux_jax.executor.device import is_accelerator
from conflux_jax.executor.jax_executor import ExecutorConfig, JaxExecutor
from conflux_jax.grammar import GrammarCompiler, GrammarError, Matcher
from conflux_jax.latency import Affine, LatencyModel, load_fitted, profile_name, roofline_model
from conflux_jax.latency.roofline import ModelShape, hardware_for_device_kind
from conflux_jax.outputs import OutputTracker, RequestOutput
from conflux_jax.plan import (
    ExecutorLost,
    IterationPlan,
    Preparer,
    SampledToken,
    SamplingSpec,
    StepResult,
)
from conflux_jax.sampling import SamplingParams
from conflux_jax.scheduler.block_manager import BlockManager
from conflux_jax.scheduler.config import SchedulerConfig
from conflux_jax.scheduler.request import Request
from conflux_jax.scheduler.router import InstanceLoad
from conflux_jax.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

POLICIES = {  # --policy name: (scheduling order, execution mode)
    "conflux": ("slo", "conflux"),
    "fcfs": ("fcfs", "conflux"),
    "srpt": ("srpt", "conflux"),
    "chunked": ("fcfs", "tp_chunked"),
    "isolated": ("fcfs", "isolated"),
}


class EngineError(ValueError):
    """A request the engine cannot accept (the message says why; ``param`` names the
    request field at fault)."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    executor: ExecutorConfig = ExecutorConfig()
    policy: str = "conflux"
    ttft_slo_s: float = 10.0
    tbt_slo_s: float = 1.0
    # None = the fitted coefficients shipped for ``profile`` on this hardware and mesh
    # (``latency/coeffs/``), else a conservative built-in estimate.
    latency_model: LatencyModel | None = None
    profile: str | None = None  # model name for the fitted coefficients ("default", a path)
    # Bounded waiting (SchedulerConfig.overdue_grace_s): a request still waiting this long
    # past its TTFT deadline is served first. None = ``ttft_slo_s``; math.inf = never.
    overdue_grace_s: float | None = None
    # Calibration (calibration.py) for a setup with no shipped fit: None = on a GPU/TPU
    # (or with $CONFLUX_CALIBRATE=1), True/False = always/never. A fit saved by an earlier
    # calibration is loaded at start-up; otherwise ``warmup`` profiles and fits.
    calibrate: bool | None = None
    recalibrate: bool = False  # ignore a saved fit: profile and fit anew at warm-up
    calibration_budget: Budget = Budget()
    calibration_dir: str | None = None  # None = beside the compile cache
    # Prefill tokens every iteration runs while prompts wait, even past the TBT budget
    # (SchedulerConfig.min_prefill_chunk): prefill never starves behind decodes that a
    # pessimistic latency model says fill the budget.
    min_prefill_chunk: int = 16
    # Automatic prefix caching (on by default, as in vLLM): prompts reuse the KV of full
    # pages an earlier request computed (SchedulerConfig.enable_prefix_caching).
    enable_prefix_caching: bool = True
    # A prefix hit's short suffix prefills on its owner rank alone when the latency model
    # says it is cheaper (SchedulerConfig.local_prefill); False = always load + Ulysses.
    local_prefill: bool = True
    # Async scheduling (vLLM's --async-scheduling): the next iteration is planned and
    # set running before the last one's tokens become outputs, which the host builds
    # while the device computes. False = one iteration at a time.
    async_scheduling: bool = True
    # With async scheduling, the iteration after the running one is also planned, its
    # host batch built and itself launched while the device computes, its decode rows
    # reading the running one's tokens on the device (on several devices only steps
    # without a collective; the others from the host, once they are in). Steps with
    # grammar masks or penalties are planned when the tokens are in (their masks and
    # histories follow them). False = plan once the tokens are in, always.
    plan_ahead: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {sorted(POLICIES)}")


@dataclasses.dataclass(slots=True)
class StepOutput:
    """What one iteration produced for one request (a streaming delta)."""

    request_id: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    time_s: float  # perf_counter() when the token became available
    logprobs: list[dict[int, float]] | None = None
    # On a request's first output: prompt tokens served from the prefix cache.
    num_cached_tokens: int | None = None


@dataclasses.dataclass
class _Live:
    prompt: str | None
    prompt_ids: list[int]
    tracker: OutputTracker
    arrival_s: float
    first_token_s: float | None = None
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    token_times: list[float] = dataclasses.field(default_factory=list)


class Engine:
    def __init__(self, model_config: Any, params: Any, tokenizer: Any,
                 config: EngineConfig = EngineConfig()):
        self.config = config
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.executor = JaxExecutor(model_config, params, config.executor)
        order, mode = POLICIES[config.policy]
        ec = config.executor
        buckets = self.executor.buckets  # the device's defaults unless given
        if mode == "tp_chunked" and self.executor.num_ranks != 1:
            raise ValueError("the chunked baseline runs uniform TP: use a mesh with sp=1")
        self.model_name = profile_name(config.profile) if config.profile else (
            f"{model_config.architecture}-L{model_config.num_layers}"
            f"-h{model_config.hidden_size}-v{model_config.vocab_size}")
        self._needs_calibration = False
        self.latency_model = config.latency_model or self._fitted_latency_model() or \
            self._calibrated_or_estimate()
        self.scheduler = Scheduler(
            SchedulerConfig(tbt_slo_s=config.tbt_slo_s, ttft_slo_s=config.ttft_slo_s,
                            order=order, mode=mode, quantum=1,
                            max_tokens_per_rank=buckets.max_tokens,
                            token_budget=buckets.max_tokens,
                            max_prefill_pieces=buckets.max_prefill_seqs,
                            max_decodes_per_rank=buckets.decode[-1],
                            max_transfer_groups=self.executor.planner.transfer_groups,
                            overdue_grace_s=config.overdue_grace_s,
                            min_prefill_chunk=config.min_prefill_chunk,
                            enable_prefix_caching=config.enable_prefix_caching,
                            local_prefill=config.local_prefill),
            self.latency_model, BlockManager(self.executor.num_ranks, self.executor.kv.num_pages,
                                             ec.page_size))
        self.core = EngineCore(self.scheduler, self.executor)
        self.max_model_len = min(ec.max_model_len, model_config.max_position_embeddings)
        self._live: dict[int, _Live] = {}
        self._grammars = GrammarCompiler(tokenizer, model_config.vocab_size)
        self._matchers: dict[int, Matcher] = {}  # live grammar-constrained requests
        # Live requests with a fixed mask (logit_bias, allowed_token_ids), and those whose
        # stop tokens are masked until min_tokens: (min_tokens, stop token ids).
        self._fixed_masks: dict[int, np.ndarray] = {}
        self._min_tokens: dict[int, tuple[int, list[int]]] = {}
        self._failed_now: list[StepOutput] = []  # failed while preparing this step's plan
        self._flight: InFlight | None = None  # the iteration running (async scheduling)
        # The one after it, planned and built; launched already (an InFlight) when its
        # decode slots take the running one's samples on the device.
        self._ahead: IterationPlan | InFlight | None = None
        self._lost: ExecutorLost | None = None  # raised by the next step()
        self._next_id = 0
        self._rng = random.Random()

    def _fitted_latency_model(self) -> LatencyModel | None:
        if self.config.profile is None:
            return None
        mesh = self.executor.mesh_spec
        return load_fitted(self.config.profile, self.executor.mesh.devices.flat[0].platform,
                           mesh.sp, mesh.tp, self.executor.buckets.tokens)

    def _calibrated_or_estimate(self) -> LatencyModel:
        """A saved calibration of this setup, else the device's roofline (or the CPU
        estimate), marking the engine for calibration at warm-up when it wants one."""
        cfg, ex = self.config, self.executor
        wanted = cfg.calibrate
        if wanted is None:
            wanted = is_accelerator(ex.platform) or os.environ.get(CALIBRATE_ENV) == "1"
        if wanted and not cfg.recalibrate:
            saved = load_saved(ex, self.model_name, cfg.calibration_dir)
            if saved is not None:
                log.info("latency model: the calibration saved for %s on %s (held-out MAPE "
                         "%s%%)", self.model_name, ex.device_kind,
                         saved.meta.get("heldout_mape_pct"))
                return saved
        self._needs_calibration = bool(wanted)
        return self.device_estimate()

    def device_estimate(self) -> LatencyModel:
        """The roofline of the detected device when the hardware table knows it, else the
        conservative CPU-scale estimate."""
        ex, m = self.executor, self.model_config
        hw = hardware_for_device_kind(ex.device_kind)
        if hw is not None:
            shape = ModelShape.from_config(self.model_name, m, ex.exec_config.max_model_len)
            try:
                return roofline_model(shape, hw, ex.mesh_spec.sp, ex.mesh_spec.tp
                                      ).for_buckets(ex.buckets.tokens)
            except ValueError as exc:  # e.g. more sp ranks than KV heads
                log.warning("no roofline for this mesh (%s); using the built-in estimate", exc)
        # Priced on the executor's token buckets: a step's linears run the padded shape.
        return default_latency_model(m.num_layers, ex.num_ranks).for_buckets(ex.buckets.tokens)

    def set_latency_model(self, model: LatencyModel) -> None:
        """Price iterations with ``model`` from the next one on."""
        self.latency_model = model
        self.scheduler.model = model

    def warmup(self, progress: bool = True) -> float:
        """Compile every step shape, then calibrate the latency model if this setup has
        no fit yet; returns the seconds spent."""
        start = time.perf_counter()
        self.executor.warmup(progress=progress)
        if self._needs_calibration:
            cfg = self.config
            log.info("calibrating the latency model for %s on %s: timing %d random batches",
                     self.model_name, self.executor.device_kind,
                     cfg.calibration_budget.num_train + cfg.calibration_budget.num_test)
            self.set_latency_model(calibrate(self.executor, self.model_name,
                                             cfg.calibration_budget, cfg.calibration_dir))
            self._needs_calibration = False
        return time.perf_counter() - start

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | Sequence[int], sampling: SamplingParams,
                    arrival_s: float | None = None, ttft_slo_s: float | None = None,
                    tbt_slo_s: float | None = None, cache_salt: str | None = None) -> int:
        """Queue a request; returns its id. Raises ``EngineError`` for invalid input.

        ``ttft_slo_s``/``tbt_slo_s`` override the engine's SLOs for this request;
        ``cache_salt`` keeps its prompt's cached KV apart from other salts' (tenants).
        """
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise EngineError("cache_salt must be a non-empty string", "cache_salt")
        for name, slo in (("ttft_slo_s", ttft_slo_s), ("tbt_slo_s", tbt_slo_s)):
            if slo is not None and not slo > 0:
                raise EngineError(f"{name} must be positive")
        if sampling.n != 1:  # generate() and the server split n choices into requests
            raise EngineError("an engine request is one sequence: add n requests", "n")
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            text, ids = None, [int(t) for t in prompt]
        self._check_prompt_ids(ids)
        vocab = self.model_config.vocab_size
        if len(ids) >= self.max_model_len:
            raise EngineError(f"the prompt has {len(ids)} tokens; this server's context is "
                              f"{self.max_model_len} tokens and generation needs at least one")
        max_new = min(sampling.max_tokens or self.max_model_len, self.max_model_len - len(ids))
        rid = self._next_id
        self._next_id += 1
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(31)
        now = time.perf_counter() if arrival_s is None else arrival_s
        spec = SamplingSpec(sampling.temperature, sampling.top_k, sampling.top_p, seed % 2**32,
                            sampling.presence_penalty, sampling.frequency_penalty,
                            sampling.repetition_penalty, sampling.min_p,
                            sampling.additive_bias, sampling.logprobs or 0)
        for name, token_ids in (("logit_bias", list(sampling.logit_bias or ())),
                                ("allowed_token_ids", list(sampling.allowed_token_ids or ()))):
            if any(not 0 <= t < vocab for t in token_ids):
                raise EngineError(f"{name} token ids must be in [0, {vocab})", name)
        try:
            fixed_mask = sampling.token_mask(vocab)
        except ValueError as exc:
            raise EngineError(str(exc), "logit_bias") from None
        matcher = None
        if sampling.structured_outputs is not None:
            try:
                matcher = self._grammars.matcher(sampling.structured_outputs)
            except GrammarError as exc:
                raise EngineError(str(exc), param="structured_outputs") from None
        request = Request(id=rid, arrival_s=now, prompt_len=len(ids), max_new_tokens=max_new,
                          ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s,
                          prompt_token_ids=tuple(ids), sampling=spec,
                          cache_salt=cache_salt or "")
        if not self.core.add(request):
            raise EngineError(f"the request needs more KV cache ({len(ids)} + {max_new} "
                              "tokens) than one rank holds")
        self._live[rid] = _Live(text, list(ids), OutputTracker(self.tokenizer, sampling, max_new),
                                now)
        if matcher is not None:
            self._matchers[rid] = matcher
        if fixed_mask is not None:
            self._fixed_masks[rid] = fixed_mask
        if sampling.min_tokens > 0:
            stops = set(sampling.stop_token_ids or ())
            if not sampling.ignore_eos:
                stops |= set(self.tokenizer.eos_token_ids)
            self._min_tokens[rid] = (sampling.min_tokens, sorted(stops))
        return rid

    def _check_prompt_ids(self, ids: Sequence[int]) -> None:
        if not ids:
            raise EngineError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise EngineError(f"prompt token ids must be in [0, {vocab})")

    def load_report(self, prompt_ids: Sequence[int], cache_salt: str = "",
                    max_new_tokens: int = 1) -> InstanceLoad:
        """What the global router sees of this instance for a prompt about to arrive (its
        queue, decodes, cached prefix of the prompt, predicted TTFT); looks only.

        Raises ``EngineError`` for a prompt no request could have (empty, out of the
        vocabulary); one too long for the context is still reported (``add_request``
        refuses it wherever it goes).
        """
        ids = tuple(int(t) for t in prompt_ids)
        self._check_prompt_ids(ids)
        # A probe, never added: its id only has to be one no live request has.
        probe = Request(id=-1, arrival_s=time.perf_counter(), prompt_len=len(ids),
                        max_new_tokens=max(1, max_new_tokens), prompt_token_ids=ids,
                        cache_salt=cache_salt or "")
        return self.scheduler.load_report(probe)

    def abort(self, request_id: int) -> None:
        """Stop a request and free its KV pages (no-op if it already finished)."""
        live = self._forget(request_id)
        if live is not None:
            live.tracker.abort()
            self.core.abort(request_id)
            if not self._live:
                self._drain()

    def _forget(self, request_id: int) -> _Live | None:
        self._matchers.pop(request_id, None)
        self._fixed_masks.pop(request_id, None)
        self._min_tokens.pop(request_id, None)
        return self._live.pop(request_id, None)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._live)

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    # ------------------------------------------------------------------ the iteration
    def step(self) -> list[StepOutput]:
        """Run one iteration; returns the new tokens of every request that got one.

        With async scheduling (``EngineConfig.async_scheduling``, the default) a call
        waits for the iteration the previous call set running, commits it, sets the next
        one running, and then turns the finished iteration's tokens into outputs
        (detokenize, stop strings, streaming deltas) while the device computes the next:
        the outputs returned are those of the iteration that finished in this call. A
        request that its length ends gets no further row; one that a stop token or a
        stop string ends has one more row in the iteration already running or planned,
        whose token is dropped (vLLM's async scheduling does the same).

        With ``plan_ahead`` (the default) the call then also plans the iteration after
        the one it started and builds its host batch, still while the device computes,
        and launches it at once, its decode slots reading the running iteration's samples
        on the device: the device goes from one iteration to the next without waiting for
        the host, and the next call finds the next iteration running. Where the executor
        cannot feed the slots so (``JaxExecutor.feeds_ahead``: on several devices, a step
        with a collective or a decode whose token was sampled on another rank),
        the next call feeds them the tokens it waited for and starts it. Grammar-constrained
        and penalized requests keep their iterations planned after their tokens are in (no
        extra row for a grammar's end, masks from the last token).
        """
        if not self.config.async_scheduling:
            outputs: list[StepOutput] = []
            try:
                self.core.step(self._observer(outputs), self._preparer())
            except StepFailed as failed:  # a failing step fails its requests, not the engine
                return self._failed_step(failed)
            return self._settle(outputs)
        if self._lost is not None and self._flight is None:  # found by an earlier call,
            lost, self._lost = self._lost, None  # whose outputs (and its flight's) went out
            raise lost
        outputs = []
        flight, self._flight = self._flight, None
        ahead, self._ahead = self._ahead, None
        done = None
        if flight is not None:
            try:
                done = self.core.finish(flight, self._observer(outputs, "early"),
                                        ahead.plan if isinstance(ahead, InFlight) else ahead)
            except StepFailed as failed:
                outputs += self._failed_step(failed)
                if failed.ahead is not None:  # committed as not run with it
                    ahead = None
        if isinstance(ahead, InFlight):
            self._flight = ahead  # running already (committed by a later call or _drain)
        elif ahead is not None and not self._live:
            self.core.discard(ahead)  # every request in it has ended
        elif self._live and self._lost is None:
            try:
                self._flight = self.core.start(None if ahead else self._preparer(),
                                               planned=ahead)
            except StepFailed as failed:
                outputs += self._failed_step(failed)
            except ExecutorLost as exc:
                if done is None:
                    raise
                self._lost = exc  # the finished iteration's outputs go out first
        if done is not None:  # the device runs the next iteration meanwhile
            late: list[StepOutput] = []
            try:
                self._observer(late, "late")(done.plan, done.result)
            except Exception:  # its KV is committed: fail its requests, not the engine
                log.exception("output processing failed; failing the step's %d requests",
                              len(done.plan.request_ids))
                late = self._fail(list(done.plan.request_ids))
            outputs += late
        outputs = self._settle(outputs)
        if not self._live:
            self._drain()
        elif self._flight is not None and self._lost is None and self._plans_ahead():
            # After the outputs: requests that a stop string ended are out of the plan.
            self._flight = self.core.advance(self._flight)
            try:
                planned = self.core.plan_ahead()
                self._ahead = None if planned is None else \
                    self.core.launch_ahead(planned, self._flight) or planned
            except StepFailed as failed:
                outputs += self._settle(self._failed_step(failed))
            except ExecutorLost as exc:
                self._lost = exc  # raised once the running iteration's outputs are out
        return outputs

    def _plans_ahead(self) -> bool:
        """Can the next iteration be planned before the running one's tokens are in? Not
        when a request needs its last token for its mask or its penalties."""
        return self.config.plan_ahead and self.executor.builds_ahead and \
            self._preparer() is None and not self.scheduler.has_histories

    def _preparer(self) -> Preparer | None:
        masked = self._matchers or self._fixed_masks or self._min_tokens
        return self._prepare if masked else None

    def _failed_step(self, failed: StepFailed) -> list[StepOutput]:
        ids = failed.request_ids
        log.error("step failed; failing its %d requests", len(ids), exc_info=failed.__cause__)
        return self._fail(ids)

    def _settle(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """Forget the requests ``outputs`` finish; first come those that failed while
        their plan was prepared."""
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        if self._failed_now:
            outputs, self._failed_now = self._failed_now + outputs, []
        return outputs

    def _drain(self) -> None:
        """Commit the iteration still running once no request is left to use it (its rows
        are of requests that ended meanwhile), so that none outlives the last request."""
        flight, self._flight = self._flight, None
        ahead, self._ahead = self._ahead, None
        while flight is not None:
            launched = ahead if isinstance(ahead, InFlight) else None  # finished next
            planned = launched.plan if launched is not None else ahead
            try:
                self.core.finish(flight, None, planned)
            except StepFailed as failed:  # no live request was in it: nothing to fail
                log.warning("a step of ended requests failed: %s", failed.__cause__)
                if failed.ahead is not None:  # committed as not run with it
                    launched = planned = None
            if launched is None and planned is not None:
                self.core.discard(planned)
            flight, ahead = launched, None

    def _observer(self, outputs: list[StepOutput],
                  part: Literal["all", "early", "late"] = "all") -> Observer:
        """What an executed iteration's tokens do: each request's output (detokenized,
        checked against its stop conditions) appended to ``outputs``; a finished request
        leaves the scheduler.

        With async scheduling that work is split in two ``part``s. ``early`` (before the
        iteration commits, so before the next is planned) does only what the next plan
        must know: a stop
        token ends its request; grammar-constrained requests are observed in full (the
        next mask follows their token). ``late`` (while the device runs the next
        iteration) observes every other request.
        """
        def observe(plan: IterationPlan, result: StepResult) -> None:
            # Once per sampled row every iteration (hundreds at high concurrency): names
            # bound once, and no per-row lookup that the step's requests do not need.
            now, live_get, matchers = result.end_s, self._live.get, self._matchers
            finish = self.scheduler.finish
            add = outputs.append
            for rid, s in result.sampled.items():
                live = live_get(rid)
                if live is None:  # aborted or ended while the step ran
                    continue
                if part == "early":
                    if live.cached_tokens is None:  # its state may be gone before `late`
                        self._cached_tokens(rid, live)
                    if not (matchers and rid in matchers):
                        if live.tracker.stops_at(s.token):
                            finish(rid)
                        continue
                elif part == "late" and matchers and rid in matchers:
                    continue  # observed early
                out = self._output(rid, live, s, now)
                add(out)
                if out.finished:
                    finish(rid)

        return observe

    def _cached_tokens(self, rid: int, live: _Live) -> int:
        """The request's prompt tokens served from the prefix cache, read from its
        scheduler state once and kept (the state goes when the request finishes)."""
        if live.cached_tokens is None:
            st = self.scheduler.state(rid)
            live.cached_tokens = st.cached_tokens if st is not None else 0
        return live.cached_tokens

    def _output(self, rid: int, live: _Live, s: SampledToken, now: float) -> StepOutput:
        """One request's new token through its tracker (and grammar): its output."""
        tracker = live.tracker
        cached = None
        if live.first_token_s is None:
            live.first_token_s = now
            cached = self._cached_tokens(rid, live)
        live.token_times.append(now)
        n_top = tracker.params.logprobs
        top = dict(list(s.top.items())[:n_top]) if n_top else None  # best first
        delta = tracker.append(s.token, s.logprob, top)
        matcher = self._matchers.get(rid) if self._matchers else None
        if matcher is not None and not tracker.finished:
            if not matcher.advance(s.token):
                delta += tracker.abort("error")
                log.error("request %d: grammar rejected a masked token: %s", rid,
                          matcher.error)
            elif matcher.finished:  # the grammar is complete: no EOS step needed
                delta += tracker.stop()
        reason = tracker.finish_reason
        return StepOutput(rid, [s.token], delta, reason is not None, reason, now,
                          [tracker.logprobs[-1]] if tracker.logprobs is not None else None,
                          cached)

    def _prepare(self, plan: IterationPlan) -> IterationPlan:
        """The token masks of the plan's masked rows: grammar masks from committed tokens,
        and'ed with each request's fixed mask and, below min_tokens, its stop tokens off.

        Each matcher first follows its request's output ids as the scheduler holds them
        (rolling back anything the request no longer holds), so a recompute after
        preemption, which replays those ids, samples under the right state.
        """
        matchers, fixed, min_tokens = self._matchers, self._fixed_masks, self._min_tokens
        rows = [r for r in plan.sampling_ids if r in matchers or r in fixed or r in min_tokens]
        if not rows:
            return plan
        grammar_rows: list[int] = []
        outputs: dict[int, int] = {}
        for rid in rows:
            st = self.scheduler.state(rid)
            if st is None:
                continue
            outputs[rid] = len(st.output_ids)
            m = matchers.get(rid)
            if m is None:
                continue
            if m.sync(st.output_ids):
                grammar_rows.append(rid)
            else:  # cannot happen with masked sampling; fail the request, not the step
                log.error("request %d: grammar rejected its own tokens: %s", rid, m.error)
                self._failed_now += self._fail([rid])
                del outputs[rid]
        words = self._grammars.words
        grammar = np.empty((len(grammar_rows), words), np.int32)
        if grammar_rows:
            self._grammars.fill_masks([matchers[r] for r in grammar_rows], grammar)
        masks = dict(zip(grammar_rows, grammar, strict=True))
        for rid, produced in outputs.items():
            floor = min_tokens.get(rid)
            if floor is not None and produced >= floor[0]:  # outputs only grow
                del min_tokens[rid]
                floor = None
            mask = masks.get(rid)
            if mask is None and rid not in fixed and floor is None:
                continue
            if mask is None:
                mask = np.full(words, -1, np.int32)
            if rid in fixed:
                mask = mask & fixed[rid]
            if floor is not None and floor[1]:
                ids = np.asarray(floor[1])
                mask = mask.copy()
                np.bitwise_and.at(mask, ids // 32, ~(np.int32(1) << (ids % 32).astype(np.int32)))
            masks[rid] = mask
        return dataclasses.replace(plan, token_masks=masks)

    def _fail(self, ids: list[int]) -> list[StepOutput]:
        now = time.perf_counter()
        outs = []
        for rid in ids:
            live = self._forget(rid)
            if live is None:
                continue
            delta = live.tracker.abort("error")
            self.core.abort(rid)
            outs.append(StepOutput(rid, [], delta, True, "error", now))
        return outs

    def output(self, request_id: int) -> RequestOutput | None:
        live = self._live.get(request_id)
        if live is None:
            return None
        return RequestOutput(str(request_id), live.prompt, live.prompt_ids,
                             [live.tracker.completion()], live.tracker.finished)

    # ------------------------------------------------------------------ offline use
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling: Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion (the offline ``LLM`` API). A prompt whose params ask
        for ``n`` outputs runs as ``n`` requests (with a seed, output i uses seed + i)."""
        groups: list[list[int]] = []
        try:
            for p, sp in zip(prompts, sampling, strict=True):
                group: list[int] = []
                groups.append(group)
                for i in range(sp.n):
                    seed = None if sp.seed is None else sp.seed + i
                    group.append(self.add_request(p, dataclasses.replace(sp, n=1, seed=seed)))
        except Exception:
            for rid in (r for g in groups for r in g):  # all or nothing: queue none
                self.abort(rid)
            raise
        ids = [r for g in groups for r in g]
        snapshots = {rid: self._live[rid] for rid in ids}
        while any(rid in self._live for rid in ids):
            self.step()
        results = []
        for group, prompt in zip(groups, prompts, strict=True):
            lives = [snapshots[rid] for rid in group]
            first = lives[0]
            results.append(RequestOutput(
                str(group[0]), prompt if isinstance(prompt, str) else None,
                first.prompt_ids, [live.tracker.completion(i) for i, live in enumerate(lives)],
                True, metrics={"arrival_s": first.arrival_s,
                               "first_token_s": first.first_token_s,
                               "token_times_s": first.token_times}))
        return results


def default_latency_model(num_layers: int, num_ranks: int) -> LatencyModel:
    """A rough CPU-scale estimate used until a fitted profile is supplied.

    It only shapes how much prefill the scheduler co-batches per iteration; correctness
    never depends on it. ``python -m conflux_jax.bench estimator --profile`` fits a real one.
    """
    return LatencyModel(num_layers=num_layers, num_ranks=num_ranks,
                        gemm=Affine(a=2e-5, b=5e-4), dec=Affine(a=2e-7, b=1e-4),
                        pre=Affine(a=1e-8, b=1e-4), comm=Affine(a=1e-6, b=5e-5))
