"""The per-instance scheduler: SLO-aware ConfluxServe (Alg. 1) and comparison policies.

Lifecycle of a request: ``add`` -> waiting -> (prefill chunks) -> decode -> done.
Every iteration the caller does::

    plan = sched.schedule(now)        # decide; KV pages are allocated here
    result = executor.execute(plan)
    finished = sched.commit(plan, result)

(:class:`~conflux_jax.engine.core.EngineCore` is that loop.) Plans carry everything an
executor reads: token ids (the scheduler keeps each request's sampled tokens, as vLLM's
``Request`` does), page ids and sampling parameters.

Guarantees:
* stall-free decode: every resident decode is in every ``conflux``/``tp_chunked`` plan
  (isolated plans alternate phases by design);
* KV never over-commits: prefill pages for the whole prompt are taken when a prefill
  starts, decode pages when its last chunk is planned, one page per growth step;
* no deadlock: when a decode cannot grow, the latest-arrived request holding pages on
  that rank is preempted (recompute: its prompt plus generated tokens are prefilled
  again); when a completing prefill finds no decode rank and nothing else can free
  pages, the latest-arrived in-progress prefill is preempted;
* requests that could never fit one rank are refused by ``add`` (the caller aborts them).

Prefix caching (``SchedulerConfig.enable_prefix_caching``): a waiting request looks up
its prompt's full pages in the block manager's cache; the longest hit on any rank (its
*owner*) is taken when its prefill starts, so only the rest is prefilled, priced and
admitted. When the owner can decode it and take its whole uncached suffix this
iteration, and the latency model prices that at most the other path, the suffix is a
:class:`~conflux_jax.plan.LocalPrefill`: it runs on the owner alone, in the decode slice,
over the cached pages that become the head of its decode pages (nothing is loaded or
moved). Otherwise its first chunk loads the cached KV's head shards from the owner into
the prefill pages of every rank (Ulysses attention reads them like its own earlier
chunks); its decode home is the owner when the owner has room (the cached pages then
stay where they are and only the new KV moves), otherwise the placement rule's rank.
Pages are named in the cache at ``commit``, once their KV is written. A waiting request
whose next uncached pages another request is prefilling right now (the ``n`` choices of
one prompt, or any two prompts sharing a long head) waits for that prefill to name them,
when they are at least half of what it has left to prefill: it then prefills only its
own tail, and decodes on the same pages.

``abort``/``finish`` between ``schedule`` and ``commit`` take effect at ``commit`` so an
executor never reads freed pages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from conflux_jax.latency import LatencyModel, attention_work
from conflux_jax.plan import DecodeSlot, IterationPlan, LocalPrefill, PrefillPiece, StepResult
from conflux_jax.scheduler.admission import moore_hodgson
from conflux_jax.scheduler.block_manager import BlockManager
from conflux_jax.scheduler.config import SchedulerConfig
from conflux_jax.scheduler.placement import place_decode
from conflux_jax.scheduler.prefix_cache import block_id_page_keys, chain_hashes, token_page_keys
from conflux_jax.scheduler.request import Request, RequestState
from conflux_jax.scheduler.router import InstanceLoad
from conflux_jax.scheduler.waterfill import Dispatcher, waterfill_assign

_SKIP = -2  # candidate cannot start now (KV); try the next one
_STOP = -3  # completing chunk has no decode rank: stop admitting this iteration


@dataclasses.dataclass
class _Tentative:
    """What this iteration's plan has reserved so far (placements are incremental)."""

    ctx: list[int]  # summed decode context per rank, incl. placements made this iteration
    n: list[int]  # resident decodes per rank, likewise
    in_plan: set[int] = dataclasses.field(default_factory=set)
    placed: int = 0  # completing chunks so far
    moved: int = 0  # KV page groups those completions move to decode ranks
    loaded: list[int] = dataclasses.field(default_factory=list)  # cached pages sent, per rank
    rows: list[int] = dataclasses.field(default_factory=list)  # decode-slice rows per rank


class Scheduler:
    """Host-side scheduler of one XP instance (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, model: LatencyModel,
                 blocks: BlockManager) -> None:
        if model.num_ranks != blocks.num_ranks:
            raise ValueError(f"latency model has {model.num_ranks} ranks, "
                             f"block manager {blocks.num_ranks}")
        if config.mode == "tp_chunked" and blocks.num_ranks != 1:
            raise ValueError("tp_chunked runs the instance as one logical TP rank (N=1)")
        self.cfg = config
        self.model = model
        self.blocks = blocks
        self.n = blocks.num_ranks
        self._states: dict[int, RequestState] = {}
        self._pending: dict[int, RequestState] = {}  # waiting or mid-prefill
        self._decodes: dict[int, RequestState] = {}
        self._n_d = [0] * self.n  # resident decodes per rank
        self._ctx = [0] * self.n  # summed decode KV length per rank
        self._released: list[int] = []
        self._deferred: list[tuple[int, str]] = []
        self._inflight = False
        self._preempted_now: list[int] = []
        self.num_preemptions = 0
        self._tau = config.tbt_slo_s  # this iteration's TBT bound (per-request SLOs)
        self._penalized: set[int] = set()  # requests whose tokens go into plan.histories
        self._caching = config.enable_prefix_caching
        # Page hash -> the request whose running prefill will name it in the cache.
        self._prefilling: dict[bytes, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which were served from it
        self.local_prefills = 0  # hits whose suffix ran on the owner alone
        self.local_prefill_tokens = 0  # their suffix tokens

    # ---- request intake and exit ----------------------------------------------------
    def fits(self, req: Request) -> bool:
        """Could ``req`` ever run alone (prefill pages + decode KV + headroom on a rank)?"""
        total = req.prompt_len + req.max_new_tokens
        bm = self.blocks
        need = (bm.decode_pages_for(total) + bm.prefill_pages_for(total)
                + self.cfg.headroom_pages)
        return need <= bm.num_pages

    def add(self, req: Request) -> bool:
        """Queue ``req``; False (nothing queued) if it can never fit the KV pools."""
        if req.id in self._states:
            raise ValueError(f"duplicate request id {req.id}")
        if not self.fits(req):
            return False
        ttft = req.ttft_slo_s if req.ttft_slo_s is not None else self.cfg.ttft_slo_s
        st = RequestState(req, req.arrival_s + ttft, req.prompt_len,
                          prefilled=req.cached_prefix)
        self._states[req.id] = st
        self._pending[req.id] = st
        if req.sampling.penalized and req.prompt_token_ids:
            self._penalized.add(req.id)
        return True

    def abort(self, request_id: int) -> None:
        """Drop a request and free its pages (deferred to ``commit`` mid-iteration)."""
        if self._inflight:
            self._deferred.append((request_id, "abort"))
        else:
            self._drop(request_id)

    def finish(self, request_id: int) -> None:
        """The engine saw EOS / a stop condition: same as abort for the scheduler."""
        self.abort(request_id)

    def recompute_all(self) -> list[int]:
        """The executor lost its KV: preempt every request holding pages (decoding or part
        prefilled) to recompute from its prompt and sampled tokens. Returns their ids."""
        if self._inflight:
            raise RuntimeError("recompute_all() between schedule() and commit()")
        preempted: list[int] = []
        for st in list(self._states.values()):
            if st.id in self.blocks:
                self._preempt(st, preempted)
        self.blocks.clear_cache()
        return preempted

    def _drop(self, request_id: int) -> None:
        st = self._states.pop(request_id, None)
        if st is None:
            return
        self._penalized.discard(request_id)
        self._unclaim(st)
        if request_id in self.blocks:
            self.blocks.free(request_id)
        if st.phase == "decode":
            del self._decodes[request_id]
            self._n_d[st.rank] -= 1
            self._ctx[st.rank] -= st.kv_len
        else:
            self._pending.pop(request_id, None)
        st.phase = "done"
        self._released.append(request_id)

    # ---- introspection ----------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._pending or self._decodes)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_decoding(self) -> int:
        return len(self._decodes)

    def state(self, request_id: int) -> RequestState | None:
        return self._states.get(request_id)

    @property
    def has_histories(self) -> bool:
        """Do plans carry penalty histories (a live request is penalized)?"""
        return bool(self._penalized)

    def decode_ranks(self) -> dict[int, int]:
        return {rid: st.rank for rid, st in self._decodes.items()}

    def queued_work(self) -> int:
        """Remaining prefill tokens of queued requests (the router's load signal)."""
        return sum(st.remaining for st in self._pending.values())

    def cached_prefix_tokens(self, req: Request) -> int:
        """Leading prompt tokens of ``req`` this instance's prefix cache holds, or that a
        running prefill here is about to name (a request sharing it would wait for it).
        Looks only: nothing is acquired or touched in the LRU."""
        if not self._caching or req.cached_prefix:
            return req.cached_prefix
        st = RequestState(req, 0.0, req.prompt_len)
        named = self._hash_pages(st, req.prompt_len - 1)
        hashes = st.page_hashes[:named]
        k = len(self.blocks.longest_hit(hashes)[1])
        while k < named and hashes[k] in self._prefilling:
            k += 1
        return k * self.blocks.page_size

    def load_report(self, req: Request) -> InstanceLoad:
        """What the global router sees of this instance for arriving ``req``.

        The predicted TTFT prices the queue's uncached prefill work plus ``req``'s with the
        latency model, as one batch spread over the ranks beside the resident decodes, and
        stretches it by the share of each TBT-bounded iteration the decodes leave to
        prefill (at least a twentieth: the waterfill's quantum keeps prefill going). It is
        never less than the whole iteration that carries the prompt: the request waits for
        that iteration's decodes and fixed costs too, so an idle instance reports less than
        a busy one for the same prompt.
        """
        cached = self.cached_prefix_tokens(req)
        queued = self.queued_work()
        tokens = queued + req.prompt_len - cached
        a_p = attention_work(req.prompt_len - cached, cached) + sum(
            attention_work(st.remaining, st.prefilled) for st in self._pending.values())
        n_p = -(-tokens // self.n)
        t_dec = self._decode_only_estimate()
        t_all = self.model.iteration(n_p + max(self._n_d), n_p, a_p, self._decode_path())
        share = max(0.05, 1.0 - t_dec / self._tau) if self._decodes else 1.0
        return InstanceLoad(num_ranks=self.n, queued_tokens=queued,
                            decodes=len(self._decodes), cached_tokens=cached,
                            predicted_ttft_s=max(t_all, (t_all - t_dec) / share))

    # ---- the iteration -----------------------------------------------------------------
    def schedule(self, now: float) -> IterationPlan:
        """Build the next iteration's plan at time ``now``."""
        if self._inflight:
            raise RuntimeError("schedule() called twice without commit()")
        self._inflight = True
        # The tightest TBT SLO among resident decodes bounds every iteration's latency.
        default = self.cfg.tbt_slo_s
        self._tau = min((default if (t := st.req.tbt_slo_s) is None else t
                         for st in self._decodes.values()), default=default)
        preempted: list[int] = []
        mode = self.cfg.mode
        local: list[LocalPrefill] = []
        if mode == "isolated" and self._pending:
            pieces, est = self._dispatch_simple(now, preempted, isolated=True)
            if pieces:
                return self._plan(tuple(pieces), (), est, "isolated_prefill", preempted)
        slots = self._grow_decodes(preempted)
        if mode == "conflux":
            pieces, est = self._dispatch_conflux(now, preempted, local)
        elif mode == "tp_chunked":
            pieces, est = self._dispatch_simple(now, preempted, isolated=False)
        else:
            pieces, est = [], self._decode_only_estimate()
        plan_mode = "isolated_decode" if mode == "isolated" else mode
        return self._plan(tuple(pieces), slots, est, plan_mode, preempted, tuple(local))

    def _plan(self, pieces: tuple[PrefillPiece, ...], slots: tuple[DecodeSlot, ...],
              est: float, mode: str, preempted: list[int],
              local: tuple[LocalPrefill, ...] = ()) -> IterationPlan:
        released = tuple(self._released)
        self._released = []
        plan = IterationPlan(prefill=pieces, decode=slots, estimated_latency_s=est,
                             mode=mode, released=released,  # type: ignore[arg-type]
                             preempted=tuple(preempted), fits_slo=est <= self._tau,
                             local_prefill=local)
        if self._penalized:
            plan = dataclasses.replace(plan, histories=self._histories(plan))
        return plan

    def _histories(self, plan: IterationPlan
                   ) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Prompt and output tokens of the penalized requests that sample this iteration
        (the penalties count them on the device)."""
        return {rid: (st.req.prompt_token_ids, tuple(st.output_ids))
                for rid in self._penalized.intersection(plan.sampling_ids)
                if (st := self._states[rid]) is not None}

    def commit(self, plan: IterationPlan, result: StepResult | None = None) -> list[int]:
        """Apply an executed plan (``result``; None: it did not run); returns the ids of
        requests that finished. The same as :meth:`record` then :meth:`advance`."""
        if result is not None:
            self.record(plan, result)
        return self.advance(plan, ran=result is not None)

    def record(self, plan: IterationPlan, result: StepResult) -> None:
        """Append the tokens ``plan`` sampled to their requests' outputs.

        Separate from :meth:`advance` so that the next plan can be made before this one's
        tokens are known (the engine plans ahead while the device runs): nothing in
        :meth:`schedule` but a decode slot's ``token_id`` and penalty histories reads the
        newest token, and a request preempted meanwhile is not prefilled again in the
        same schedule() call, so its recompute reads the token recorded by then.
        """
        sampled, states = result.sampled, self._states
        for rid in plan.sampling_ids:
            st = states.get(rid)
            if st is not None:
                st.output_ids.append(sampled[rid].token)

    def last_tokens(self, plan: IterationPlan) -> list[int]:
        """Each decode slot's newest recorded token, in ``plan.decode`` order (the slots of
        a plan made ahead carry stale ones)."""
        states = self._states
        return [states[d.request_id].output_ids[-1] for d in plan.decode]

    def advance(self, plan: IterationPlan, ran: bool = True) -> list[int]:
        """Apply a plan's progress (prefill chunks, completions into decode, KV growth,
        prefix-cache pages, length limits), which needs none of its sampled tokens;
        ``ran``: False when it did not run. Returns the ids of requests that finished."""
        self._inflight = False
        finished: list[int] = []
        bm = self.blocks
        states = self._states
        completed: list[tuple[RequestState, int]] = []
        for p in plan.prefill:
            st = states.get(p.request_id)
            if st is None or st.phase != "prefill":
                continue
            st.prefilled += p.length
            if p.completes:
                assert p.decode_rank is not None
                completed.append((st, p.decode_rank))
        for lp in plan.local_prefill:
            st = states.get(lp.request_id)
            if st is not None and st.phase == "prefill":
                st.prefilled += lp.length
                completed.append((st, lp.rank))
        for st, rank in completed:
            rid = st.id
            bm.release_prefill(rid)
            if self._caching and ran:  # only KV that was written
                bm.register(rid, self._hashes(st, st.prefilled))
            self._unclaim(st)
            del self._pending[rid]
            st.phase = "decode"
            st.rank = rank
            st.kv_len = st.prefilled
            st.kv_cap = bm.decode_pages_for(st.prefilled + 1) * bm.page_size
            st.pages = bm.decode_pages(rid)
            self._decodes[rid] = st
            self._n_d[rank] += 1
            self._ctx[rank] += st.kv_len
            st.generated += 1
            if st.generated >= st.req.max_new_tokens:
                finished.append(rid)
        ctx = self._ctx
        decodes = self._decodes
        ps = bm.page_size if self._caching and ran else 0
        for d in plan.decode:
            st = decodes.get(d.request_id)
            if st is None:
                continue
            st.kv_len += 1
            if ps and st.kv_len % ps == 0:  # a page filled: it can serve later prompts
                bm.register(d.request_id, self._hashes(st, st.kv_len))
            ctx[d.rank] += 1
            st.generated += 1
            if st.generated >= st.req.max_new_tokens:
                finished.append(d.request_id)
        for rid in finished:
            self._drop(rid)
        for rid, _ in self._deferred:
            self._drop(rid)
        self._deferred.clear()
        return finished

    # ---- decode growth and preemption ---------------------------------------------------
    def _grow_decodes(self, preempted: list[int]) -> tuple[DecodeSlot, ...]:
        bm = self.blocks
        ps = bm.page_size
        for st in list(self._decodes.values()):
            if st.phase != "decode" or st.kv_len + 1 <= st.kv_cap:
                continue
            while not bm.can_append_decode(st.id, st.kv_len + 1):
                victim = self._victim(st.rank)
                self._preempt(victim, preempted)
                if victim is st:
                    break
            if st.phase == "decode":
                st.kv_cap += ps * len(bm.append_decode(st.id, st.kv_len + 1))
                st.pages = bm.decode_pages(st.id)
        # tuple.__new__ skips the NamedTuple's Python-level __new__: every resident decode
        # gets a slot every iteration, and this is the hot path of schedule().
        new = tuple.__new__
        return tuple([new(DecodeSlot, (st.req.id, st.rank, st.kv_len,
                                       st.output_ids[-1] if st.output_ids else 0, st.pages,
                                       st.req.sampling, st.generated))
                      for st in self._decodes.values()])

    def _victim(self, rank: int, exclude: Iterable[int] = ()) -> RequestState:
        """Latest-arrived request holding pages on ``rank`` (decode there, or prefill)."""
        skip = set(exclude)
        best: RequestState | None = None
        for pool in (self._decodes.values(), self._pending.values()):
            for st in pool:
                if st.id in skip or (st.phase == "decode" and st.rank != rank):
                    continue
                if st.phase == "waiting":
                    continue
                if best is None or (st.req.arrival_s, st.id) > (best.req.arrival_s, best.id):
                    best = st
        if best is None:
            raise RuntimeError(f"no request holds pages on rank {rank}")
        return best

    def _preempt(self, st: RequestState, preempted: list[int]) -> None:
        self._unclaim(st)
        self.blocks.free(st.id)
        if st.phase == "decode":
            del self._decodes[st.id]
            self._n_d[st.rank] -= 1
            self._ctx[st.rank] -= st.kv_len
            self._pending[st.id] = st
        st.phase = "waiting"
        st.target = st.req.prompt_len + st.generated
        st.kv_len = st.kv_cap = 0
        st.prefilled = st.req.cached_prefix  # the cache still holds the prefix
        st.cached, st.cache_rank, st.cache_pages = 0, -1, ()  # looked up again
        st.rank = -1
        st.pages = ()
        st.preemptions += 1
        self.num_preemptions += 1
        preempted.append(st.id)
        self._released.append(st.id)

    # ---- prefill candidates -----------------------------------------------------------
    def _candidates(self, now: float, preempted: list[int],
                    disp: Dispatcher | None) -> tuple[list[RequestState], int]:
        """Pending requests in dispatch order, and how many overdue ones lead it.

        Overdue requests (still waiting ``overdue_grace_s`` past their TTFT deadline) come
        first, oldest first: whatever the policy's order, no request waits unboundedly.
        """
        skip = set(preempted)
        grace = self.cfg.overdue_grace_s
        overdue_before = now - (self.cfg.ttft_slo_s if grace is None else grace)
        cands: list[RequestState] = []
        overdue: list[RequestState] = []
        for st in self._pending.values():
            if st.id not in skip:
                if self._caching and st.phase == "waiting":
                    self._look_up(st)
                (overdue if st.deadline_s < overdue_before else cands).append(st)
        overdue.sort(key=lambda s: (s.req.arrival_s, s.id))
        order = self.cfg.order
        if order == "fcfs":
            cands.sort(key=lambda s: (s.req.arrival_s, s.id))
        elif order == "srpt":
            cands.sort(key=lambda s: (s.remaining, s.req.arrival_s, s.id))
        else:
            # Alg. 1 lines 2-4: B0 with no candidate, Moore–Hodgson admission, EDF then SJF.
            b0 = disp.budget()[0] if disp is not None else self._static_budget()
            adm, rej = moore_hodgson([(s.deadline_s, s.remaining, s) for s in cands],
                                     b0, now, self._tau)
            cands = adm + rej
        return overdue + cands, len(overdue)

    def _static_budget(self) -> int:
        if self.cfg.mode == "tp_chunked":
            return max(0, self.cfg.token_budget - len(self._decodes))
        return self.cfg.max_tokens_per_rank * self.n

    def _reserve(self, st: RequestState, completes: bool, tent_ctx: list[int],
                 tent_n: list[int], in_plan: set[int], placed: int) -> int:
        """Take KV for a chunk of ``st``: prefill pages if it starts, decode pages if it
        completes. Returns the decode rank, -1 (not completing), _SKIP or _STOP."""
        bm = self.blocks
        started = st.phase == "prefill"
        if not started and st.cache_pages:
            if not self._hit_holds(st):
                return _SKIP
            bm.acquire_hit(st.id, st.cache_rank, st.cache_pages)
        rank = self._reserve_pages(st, completes, started, tent_ctx, tent_n, in_plan, placed)
        if not started:
            if rank in (_SKIP, _STOP):
                if st.id in bm:  # give back the cached prefix it took
                    bm.free(st.id)
            elif self._caching:
                self._count_hit(st)
        return rank

    def _count_hit(self, st: RequestState) -> None:
        """A prefill starts: count its prompt tokens and cached ones (the metrics)."""
        self.prefix_queries += st.target
        self.prefix_hits += st.cached
        if st.preemptions == 0:
            st.cached_tokens = st.cached

    def _hit_holds(self, st: RequestState) -> bool:
        """Is the hit ``st`` was priced by still cached? (Else it is looked up again.)"""
        rank, hit = self.blocks.longest_hit(st.page_hashes[:len(st.cache_pages)])
        if rank != st.cache_rank or tuple(hit) != st.cache_pages:
            self._look_up(st, exact=True)  # evicted since it was priced: next time
            return False
        return True

    def _reserve_pages(self, st: RequestState, completes: bool, started: bool,
                       tent_ctx: list[int], tent_n: list[int], in_plan: set[int],
                       placed: int) -> int:
        bm = self.blocks
        pre_need = 0 if started else bm.prefill_pages_for(st.target)
        if pre_need > bm.min_free_pages():
            return _SKIP
        rank = -1
        if completes:
            need = bm.decode_pages_for(st.target + 1)
            cap = self.cfg.max_decodes_per_rank
            owner, hit = bm.hit(st.id) if st.id in bm else (None, ())
            while True:
                free = [bm.free_pages(r) - pre_need for r in range(self.n)]
                if cap is not None:  # a full rank is infeasible however much KV it has
                    free = [-1 if tent_n[r] >= cap else f for r, f in enumerate(free)]
                if owner is not None and \
                        need - len(hit) + self.cfg.headroom_pages <= free[owner]:
                    rank = owner  # affinity: the cached prefix stays where it is
                    break
                got = place_decode(need, free, bm.num_pages, tent_ctx, self.cfg.eta,
                                   self.cfg.headroom_pages)
                if got is not None:
                    rank = got
                    break
                # Nothing else will free pages: no decodes, no transition this iteration.
                if self._decodes or placed:
                    return _STOP
                victims = [s for s in self._pending.values()
                           if s.phase == "prefill" and s is not st and s.id not in in_plan]
                if not victims:
                    return _STOP
                v = max(victims, key=lambda s: (s.req.arrival_s, s.id))
                self._preempt(v, self._preempted_now)
                pre_need = 0 if started else bm.prefill_pages_for(st.target)
        if not started:
            bm.allocate_prefill(st.id, st.target)
            st.phase = "prefill"
            if self._caching:
                self._claim_pages(st)
        if completes:
            bm.transition(st.id, rank, st.target + 1, keep_prefill=True)
            tent_ctx[rank] += st.target + 1
            tent_n[rank] += 1
        return rank

    # ---- prefix cache ---------------------------------------------------------------
    def _hashes(self, st: RequestState, tokens: int) -> list[bytes]:
        """Hashes of ``st``'s full pages among its first ``tokens`` tokens, as far as their
        content is known (token ids, or a trace's block ids for the prompt)."""
        return st.page_hashes[:self._hash_pages(st, tokens)]

    def _hash_pages(self, st: RequestState, tokens: int) -> int:
        """Extend ``st.page_hashes`` over the full pages of its first ``tokens`` tokens;
        returns how many of them are named (no copy: the per-iteration look-up uses it)."""
        ps = self.blocks.page_size
        want = tokens // ps
        have = st.page_hashes
        if len(have) < want:
            req = st.req
            if req.prompt_token_ids:
                keys = token_page_keys(st.token_ids(len(have) * ps, want * ps), ps)
            elif req.block_ids:
                keys = block_id_page_keys(req.block_ids, req.block_tokens, ps,
                                          min(want * ps, req.prompt_len), len(have))
            else:
                keys = []
            have.extend(chain_hashes(keys, have[-1] if have else None, req.cache_salt))
        return min(want, len(have))

    def _look_up(self, st: RequestState, exact: bool = False) -> None:
        """Price a waiting request by its longest cached prefix (at least its last token
        is computed: it samples the first output).

        Waiting requests are looked up every iteration, so unless ``exact`` a previous hit
        whose last page is still cached, and whose next page no rank caches, is kept
        (O(ranks), not O(pages)); ``_reserve`` checks the whole hit before taking it.
        """
        if st.req.cached_prefix:
            return
        bm = self.blocks
        named, hashes = self._hash_pages(st, st.target - 1), st.page_hashes
        k = len(st.cache_pages)
        if not exact and k and bm.caches(st.cache_rank, hashes[k - 1], st.cache_pages[-1]) \
                and (k == named or not bm.any_caches(hashes[k])):
            return
        rank, pages = bm.longest_hit(hashes[:named])
        st.cache_rank, st.cache_pages = rank, tuple(pages)
        st.cached = st.prefilled = len(pages) * bm.page_size

    def _claim_pages(self, st: RequestState) -> None:
        """Index the full pages ``st``'s starting prefill will name (past its hit)."""
        for h in self._hashes(st, st.target)[len(st.cache_pages):]:
            self._prefilling.setdefault(h, st.id)

    def _unclaim(self, st: RequestState) -> None:
        if not self._prefilling:
            return
        for h in st.page_hashes:
            if self._prefilling.get(h) == st.id:
                del self._prefilling[h]

    def _waits_for_prefix(self, st: RequestState) -> bool:
        """Should waiting ``st`` let another request's running prefill compute its next
        pages first? Yes when they are at least half of its uncached tokens."""
        if not self._prefilling or st.phase != "waiting" or st.req.cached_prefix:
            return False
        hashes, k = st.page_hashes, len(st.cache_pages)
        owner = self._prefilling.get(hashes[k]) if k < len(hashes) else None
        if owner is None or owner == st.id:
            return False
        shared = 1
        while k + shared < len(hashes) and self._prefilling.get(hashes[k + shared]) == owner:
            shared += 1
        return 2 * shared * self.blocks.page_size >= st.remaining

    def _claim(self, st: RequestState, length: int, tent: _Tentative) -> tuple[int, bool, int]:
        """Reserve KV for a ``length``-token chunk of ``st``; returns (length, completes, rank).

        A completion that would overflow the executor's per-step KV transfer is held
        back by one token (it completes next iteration). ``rank`` is the decode rank, -1
        (not completing), _SKIP (try the next candidate) or _STOP (stop admitting).
        """
        completes = length == st.remaining
        loads = len(st.cache_pages) if self._load(st) else 0
        if loads and not self._load_fits(st.cache_rank, loads, tent):
            return length, completes, _SKIP
        if completes and not self._transfer_fits(st, tent.moved):
            if length == 1:
                return length, False, _SKIP
            length, completes = length - 1, False
        rank = self._reserve(st, completes, tent.ctx, tent.n, tent.in_plan, tent.placed)
        if rank in (_SKIP, _STOP):
            return length, completes, rank
        tent.placed += completes
        tent.moved += self.blocks.prefill_pages_for(st.target) if completes else 0
        if loads:
            tent.loaded[st.cache_rank] += loads
        tent.in_plan.add(st.id)
        return length, completes, rank

    def _piece(self, st: RequestState, counts: tuple[int, ...], completes: bool,
               rank: int) -> PrefillPiece:
        """The plan's prefill piece for a claimed chunk: tokens, pages and sampling."""
        bm = self.blocks
        start = st.prefilled
        loads = bool(st.cache_pages) and start == st.cached  # the first chunk after a hit
        return PrefillPiece(
            st.id, start, counts, completes, rank if completes else None,
            token_ids=st.token_ids(start, start + sum(counts)),
            pages=bm.prefill_pages(st.id),
            decode_pages=bm.decode_pages(st.id) if completes else (),
            sampling=st.req.sampling, sample_step=st.generated,
            load_rank=st.cache_rank if loads else None,
            load_pages=st.cache_pages if loads else (),
            resident_tokens=bm.resident_pages(st.id) * bm.page_size if completes else 0)

    def _load(self, st: RequestState) -> int:
        """Cached prefix tokens the next chunk of ``st`` loads from its owner rank."""
        return st.cached if st.cache_pages and st.prefilled == st.cached else 0

    def _load_fits(self, owner: int, pages: int, tent: _Tentative) -> bool:
        """Can this iteration also load ``pages`` cached pages from ``owner``? Loads share
        the executor's transfer bucket: ``max_transfer_groups`` groups of N pages."""
        cap = self.cfg.max_transfer_groups
        return cap is None or tent.loaded[owner] == 0 or \
            tent.loaded[owner] + pages <= cap * self.n

    def _transfer_fits(self, st: RequestState, moved: int) -> bool:
        """Can this iteration also move ``st``'s KV to a decode rank (executor limit)?"""
        cap = self.cfg.max_transfer_groups
        return cap is None or moved == 0 or \
            moved + self.blocks.prefill_pages_for(st.target) <= cap

    def _dispatch_conflux(self, now: float, preempted: list[int], local: list[LocalPrefill]
                          ) -> tuple[list[PrefillPiece], float]:
        """Prefill pieces (and, into ``local``, local prefills) of a conflux iteration."""
        n_d, ctx = self._n_d, self._ctx
        disp = Dispatcher(self.model, self._tau, n_d, self._decode_path(), self.cfg.quantum,
                          self.cfg.max_tokens_per_rank, decode_work=self._decode_work())
        pieces: list[PrefillPiece] = []
        if not self._pending:
            return pieces, disp.estimate()
        self._preempted_now = preempted
        tent = _Tentative(list(ctx), list(n_d), loaded=[0] * self.n, rows=list(n_d))
        max_pieces = self.cfg.max_prefill_pieces
        cands, n_overdue = self._candidates(now, preempted, disp)
        for i, st in enumerate(cands):  # Alg. 1 line 5
            if max_pieces is not None and len(pieces) >= max_pieces:
                break
            if st.id in preempted or self._waits_for_prefix(st):
                continue
            rem = st.remaining
            load = self._load(st)
            if load and st.phase == "waiting" and self.cfg.local_prefill:
                if (lp := self._local(st, disp, tent)) is not None:
                    local.append(lp)
                    continue
                if self._load(st) != load:  # its hit was evicted: priced anew next time
                    continue
            length, add = disp.dispatch(rem, st.prefilled, load)  # Alg. 1 line 6 (Alg. 2)
            # A chunk that runs even past the TBT budget (the plan then says it does not
            # fit): the oldest overdue request always progresses (bounded waiting), an
            # idle instance runs one quantum rather than stall, and busy ones at least
            # min_prefill_chunk tokens (liveness of prefill).
            if i == 0 and n_overdue:
                floor = min(rem, self.cfg.overdue_min_chunk, self._room(disp.loads))
            elif length == 0 and not pieces and not self._decodes:
                floor = min(rem, self.cfg.quantum)
            elif not pieces and self.cfg.min_prefill_chunk:
                floor = min(rem, self.cfg.min_prefill_chunk, self._room(disp.loads))
            else:
                floor = 0
            if length < floor:
                length = floor
                add = waterfill_assign(disp.loads, length)
            elif length == 0:  # Alg. 1 line 7: the TBT-safe budget is spent
                break
            asked = length
            # Alg. 1 lines 8-12: a completing chunk needs a decode rank (Alg. 3) or stops.
            length, completes, rank = self._claim(st, length, tent)
            if rank == _SKIP:
                if i < n_overdue:  # younger requests must not take the pages it waits for
                    break
                continue
            if rank == _STOP:
                break
            if length < asked:  # completion held back: take the token off the fullest rank
                add = list(add)
                add[max(range(self.n), key=add.__getitem__)] -= asked - length
            piece = self._piece(st, tuple(add), completes, rank)
            disp.commit(add, st.prefilled, rank if completes else None,  # Alg. 1 line 13
                        piece.resident_tokens, st.cache_rank, load)
            pieces.append(piece)
        return pieces, disp.estimate()

    def _local(self, st: RequestState, disp: Dispatcher, tent: _Tentative
               ) -> LocalPrefill | None:
        """Prefill waiting ``st``'s uncached suffix on its owner rank alone, if the owner
        can decode it and hold the whole suffix in this iteration's decode slice, and the
        latency model prices it within the TBT budget and at most the load + Ulysses path
        (that path's transfer and load against the owner's extra rows); else None."""
        bm, cfg = self.blocks, self.cfg
        owner, c, length = st.cache_rank, st.cached, st.remaining
        cap = cfg.max_decodes_per_rank
        if cap is not None and (tent.n[owner] >= cap or tent.rows[owner] + length > cap):
            return None
        if disp.loads[owner] + length > cfg.max_tokens_per_rank:
            return None
        t_local = disp.estimate_local(owner, length, c)
        # The other path: the suffix waterfilled, moved to the owner after the cached
        # prefix is loaded from it (both cross the owner's links).
        if t_local > self._tau or t_local > disp.estimate_ulysses(length, c, length + c):
            return None
        if not self._hit_holds(st):
            return None
        bm.acquire_hit(st.id, owner, st.cache_pages)  # cached-free pages are free no more
        need = bm.decode_pages_for(st.target + 1) - len(st.cache_pages)
        if need + cfg.headroom_pages > bm.free_pages(owner):
            bm.free(st.id)
            return None
        bm.transition(st.id, owner, st.target + 1)
        st.phase = "prefill"
        self._claim_pages(st)
        self._count_hit(st)
        disp.commit_local(owner, length, c)
        self.local_prefills += 1
        self.local_prefill_tokens += length
        tent.ctx[owner] += st.target + 1
        tent.n[owner] += 1
        tent.rows[owner] += length
        tent.in_plan.add(st.id)
        return LocalPrefill(st.id, owner, c, token_ids=st.token_ids(c, st.target),
                            pages=bm.decode_pages(st.id), sampling=st.req.sampling,
                            sample_step=st.generated, length=length)

    def _room(self, loads: list[int]) -> int:
        """Tokens the ranks' token buckets still hold this iteration."""
        cap = self.cfg.max_tokens_per_rank
        return sum(cap - x for x in loads if x < cap)

    def _dispatch_simple(self, now: float, preempted: list[int],
                         isolated: bool) -> tuple[list[PrefillPiece], float]:
        """Token-budget dispatch: uniform-TP chunked prefill, or isolated SP prefill."""
        n = self.n
        budget = self._static_budget()
        pieces: list[PrefillPiece] = []
        self._preempted_now = preempted
        tent = _Tentative(list(self._ctx), list(self._n_d), loaded=[0] * self.n)
        n_p = [0] * n
        a_p = 0.0
        moved = [0] * n  # KV tokens completing prefills move to each decode rank
        max_pieces = self.cfg.max_prefill_pieces
        cands, n_overdue = self._candidates(now, preempted, None)
        for i, st in enumerate(cands):
            if budget <= 0 or (max_pieces is not None and len(pieces) >= max_pieces):
                break
            if st.id in preempted or self._waits_for_prefix(st):
                continue
            rem = st.remaining
            length, completes, rank = self._claim(st, min(rem, budget), tent)
            if rank == _SKIP:
                if i < n_overdue:  # younger requests must not take the pages it waits for
                    break
                continue
            if rank == _STOP:
                break
            # Fill the lightest ranks first so no rank exceeds its token bucket.
            counts = tuple(waterfill_assign(n_p, length))
            for r, c in enumerate(counts):
                n_p[r] += c
            a_p += attention_work(length, st.prefilled)
            piece = self._piece(st, counts, completes, rank)
            if completes:
                moved[rank] += st.prefilled + length - piece.resident_tokens
            if piece.load_rank is not None:
                moved[piece.load_rank] += piece.start
            budget -= length
            pieces.append(piece)
        if isolated:
            est = self.model.iteration(max(n_p), max(n_p), a_p, 0.0, max(moved))
        else:
            loads = [p + d for p, d in zip(n_p, self._n_d, strict=True)]
            est = self.model.iteration(max(loads), max(n_p), a_p, self._decode_path(),
                                       max(moved))
        return pieces, est

    def _decode_work(self) -> list[int]:
        """Decode attention work per rank of the resident decodes (context + 1 each)."""
        return [c + d for c, d in zip(self._ctx, self._n_d, strict=True)]

    def _decode_path(self) -> float:
        """T_D of this iteration's resident decodes."""
        return self.model.decode_path(self.model.decode_work(self._decode_work()))

    def _decode_only_estimate(self) -> float:
        return self.model.iteration(max(self._n_d), 0, 0.0, self._decode_path())
