"""The real executor: runs ``IterationPlan``s on a device mesh with AOT-compiled buckets."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from conflux_jax.config import ModelConfig
from conflux_jax.executor.base import IterationPlan, KVSpec, StepResult
from conflux_jax.executor.batch import StepBatch, zeros_like_shapes
from conflux_jax.executor.block_manager import BlockManager
from conflux_jax.executor.buckets import BucketConfig, ShapePlanner, StepShape
from conflux_jax.executor.compile_cache import enable_compilation_cache
from conflux_jax.executor.compile_guard import CompileGuard
from conflux_jax.executor.head_padding import pad_heads
from conflux_jax.executor.mesh import MeshSpec, make_mesh
from conflux_jax.executor.step import (
    KV_POOL_SPEC,
    StepConfig,
    batch_specs,
    build_step,
    kv_pool_shape,
    param_specs,
)
from conflux_jax.models.params import Params
from conflux_jax.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SequenceData:
    """What the executor reads of a request: its tokens and how to sample it.

    ``token_ids`` holds the prompt and every token generated so far; prefill pieces read
    positions ``[start, start + length)`` of it, a decode slot feeds its last token.
    """

    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    seed: int

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclasses.dataclass(frozen=True)
class ExecutorConfig:
    mesh: str | None = None  # "sp=4,tp=1"; None = every device as an sp rank
    page_size: int = 16
    num_pages: int = 256  # per rank
    max_model_len: int = 2048
    buckets: BucketConfig = BucketConfig()
    dtype: str = "float32"
    attention_impl: str | None = None
    num_top_logprobs: int = 0
    compile_workers: int = 2
    return_logits: bool = False  # tests: keep each sampled row's logits in `last_logits`
    compile_cache: str | None = None  # directory; None = $CONFLUX_COMPILE_CACHE or default


@dataclasses.dataclass(frozen=True)
class SampledToken:
    token: int
    logprob: float
    top: dict[int, float]


class JaxExecutor:
    """Owns the device state (weights, KV pools) and the compiled step per bucket."""

    def __init__(self, config: ModelConfig, params: Params, exec_config: ExecutorConfig,
                 sequences: Mapping[int, SequenceData]):
        self.exec_config = ec = exec_config
        self.compile_cache_dir = enable_compilation_cache(ec.compile_cache)
        self.mesh_spec = MeshSpec.parse(ec.mesh)
        self.mesh = make_mesh(self.mesh_spec)
        n, tp = self.mesh_spec.sp, self.mesh_spec.tp
        self.model_config = config
        padded_config, padded_params = pad_heads(config, params, n * tp)
        self.step_config = StepConfig(
            model=padded_config, num_ranks=n, tp=tp, page_size=ec.page_size,
            num_pages=ec.num_pages, num_top_logprobs=ec.num_top_logprobs,
            attention_impl=ec.attention_impl, return_logits=ec.return_logits)
        self.block_manager = BlockManager(n, ec.num_pages, ec.page_size)
        self.sequences = sequences
        self._kv_spec = KVSpec(num_ranks=n, num_pages=ec.num_pages, page_size=ec.page_size)
        dtype = jnp.dtype(ec.dtype)
        self._param_specs = param_specs(padded_params)
        self.params = jax.tree.map(
            lambda a, s: jax.device_put(jnp.asarray(a, dtype), NamedSharding(self.mesh, s)),
            padded_params, self._param_specs)
        pool_sharding = NamedSharding(self.mesh, KV_POOL_SPEC)
        shape = kv_pool_shape(self.step_config)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=pool_sharding)
        self.k_pool, self.v_pool = zeros(), zeros()
        self._step = build_step(self.step_config, self.mesh, self._param_specs)
        self.prefill_pages_per_seq = -(-ec.max_model_len // (ec.page_size * n))
        self.planner = ShapePlanner(
            ec.buckets, max_pages_per_seq=-(-ec.max_model_len // ec.page_size),
            transfer_groups=self.prefill_pages_per_seq)
        self._compiled: dict[StepShape, Any] = {}
        self.guard = CompileGuard()
        self.clock_start = time.perf_counter()

    # ------------------------------------------------------------------ protocol
    @property
    def num_ranks(self) -> int:
        return self.mesh_spec.sp

    @property
    def kv(self) -> KVSpec:
        return self._kv_spec

    # ------------------------------------------------------------------ compilation
    def _abstract_args(self, shape: StepShape):
        n = self.num_ranks
        arrays = zeros_like_shapes(n, shape.tokens, shape.prefill, shape.decode,
                                   self.exec_config.buckets.max_prefill_seqs,
                                   shape.decode_pages, self.prefill_pages_per_seq,
                                   shape.transfer)
        specs = batch_specs()
        batch = StepBatch(**{
            k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                    sharding=NamedSharding(self.mesh, getattr(specs, k)))
            for k, v in arrays.items()})

        def abstract(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

        return (jax.tree.map(abstract, self.params), abstract(self.k_pool),
                abstract(self.v_pool), batch)

    def compile_shape(self, shape: StepShape) -> None:
        if shape not in self._compiled:
            self._compiled[shape] = self._step.lower(*self._abstract_args(shape)).compile()

    def warmup(self, shapes: list[StepShape] | None = None, progress: bool = True) -> float:
        """AOT-compile every bucket the engine can emit; returns seconds spent."""
        from tqdm.auto import tqdm

        todo = [s for s in (shapes or self.planner.all_shapes()) if s not in self._compiled]
        start = time.perf_counter()
        bar = tqdm(total=len(todo), desc="compiling buckets", unit="shape", disable=not progress)
        workers = max(1, self.exec_config.compile_workers)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            lowered = {s: pool.submit(lambda s=s: self._step.lower(*self._abstract_args(s))
                                      .compile()) for s in todo}
            for s, fut in lowered.items():
                self._compiled[s] = fut.result()
                bar.update(1)
        bar.close()
        return time.perf_counter() - start

    # ------------------------------------------------------------------ execution
    def execute(self, plan: IterationPlan) -> StepResult:
        sampled = self.run(plan)
        now = time.perf_counter() - self.clock_start
        return StepResult(tokens={r: s.token for r, s in sampled.items()},
                          latency_s=self.last_latency_s, end_s=now)

    def run(self, plan: IterationPlan) -> dict[int, SampledToken]:
        """Execute one plan; returns the token sampled for each sampling request."""
        start = time.perf_counter()
        shape, arrays, rows = self.build_batch(plan)
        compiled = self._compiled.get(shape)
        if compiled is None:
            if self.guard.serving:
                raise RuntimeError(f"step shape {shape} was not compiled at warm-up")
            self.compile_shape(shape)
            compiled = self._compiled[shape]
        specs = batch_specs()
        batch = StepBatch(**{k: jax.device_put(v, NamedSharding(self.mesh, getattr(specs, k)))
                             for k, v in arrays.items()})
        with self.guard.watch():
            self.k_pool, self.v_pool, toks, lps, top_ids, top_lps, *logits = compiled(
                self.params, self.k_pool, self.v_pool, batch)
        toks, lps = np.asarray(toks), np.asarray(lps)
        top_ids, top_lps = np.asarray(top_ids), np.asarray(top_lps)
        out: dict[int, SampledToken] = {}
        for req, (rank, row) in rows.items():
            top = {int(t): float(lp) for t, lp in zip(top_ids[rank, row], top_lps[rank, row],
                                                        strict=True)}
            out[req] = SampledToken(int(toks[rank, row]), float(lps[rank, row]), top)
        if logits:
            full = np.asarray(logits[0])
            self.last_logits = {req: full[rank, row] for req, (rank, row) in rows.items()}
        self.last_latency_s = time.perf_counter() - start
        return out

    # ------------------------------------------------------------------ host batch layout
    def build_batch(self, plan: IterationPlan
                    ) -> tuple[StepShape, dict[str, np.ndarray], dict[int, tuple[int, int]]]:
        """Pack a plan into fixed-shape arrays. Returns (shape, arrays, sample rows)."""
        n = self.num_ranks
        ps = self.exec_config.page_size
        group = ps * n
        bm = self.block_manager
        max_seqs = self.exec_config.buckets.max_prefill_seqs
        if len(plan.prefill) > max_seqs:
            raise ValueError(f"plan has {len(plan.prefill)} prefill pieces; at most "
                             f"{max_seqs} fit a step")
        n_p = [0] * n
        for piece in plan.prefill:
            if len(piece.counts) != n:
                raise ValueError(f"prefill piece of request {piece.request_id} has "
                                 f"{len(piece.counts)} rank counts for {n} ranks")
            for r, c in enumerate(piece.counts):
                n_p[r] += c
        n_d = [0] * n
        for slot in plan.decode:
            n_d[slot.rank] += 1
        decode_tables = {s.request_id: bm.page_table(s.request_id) for s in plan.decode}
        widest = max((len(t.decode or ()) for t in decode_tables.values()), default=1)
        completing = [p for p in plan.prefill if p.completes]
        groups_moved = sum(-(-(p.start + p.length) // group) for p in completing)
        shape = self.planner.shape_for(
            prefill_max=max(n_p), decode_max=max(n_d),
            combined_max=max(a + b for a, b in zip(n_p, n_d, strict=True)),
            decode_pages_max=widest)
        if groups_moved > shape.transfer:
            raise ValueError(f"plan moves {groups_moved} KV page groups to decode ranks; a "
                             f"step moves at most {shape.transfer}")
        t, p, d = shape.tokens, shape.prefill, shape.decode
        a = zeros_like_shapes(n, t, p, d, max_seqs, shape.decode_pages,
                              self.prefill_pages_per_seq, shape.transfer)
        a["transfer_dst"][:] = self.exec_config.num_pages  # out of range: dropped
        rows: dict[int, tuple[int, int]] = {}
        n_sample = [0] * n

        def add_sample(rank: int, index: int, req: int) -> None:
            seq = self.sequences[req]
            row = n_sample[rank]
            n_sample[rank] += 1
            sp = seq.sampling
            a["sample_index"][rank, row] = index
            a["temperature"][rank, row] = sp.temperature
            a["top_k"][rank, row] = sp.top_k
            a["top_p"][rank, row] = sp.top_p
            a["seed"][rank, row] = seq.seed
            a["sample_step"][rank, row] = seq.num_generated
            rows[req] = (rank, row)

        # Prefill: rank-local slots [0, n_p^r) in plan order; kernel order is plan order
        # with each chunk contiguous, which is what the attention kernel needs.
        fill = [0] * n
        perm = a["prefill_perm"]
        kernel_pos = 0
        used_a2a = np.zeros(n * p, bool)
        x_slot = 0
        for s, piece in enumerate(plan.prefill):
            seq = self.sequences[piece.request_id]
            table = bm.page_table(piece.request_id)
            if table.prefill is None:
                raise ValueError(f"request {piece.request_id} has no prefill pages")
            pos = piece.start
            for r, c in enumerate(piece.counts):
                if c == 0:
                    continue
                local = np.arange(fill[r], fill[r] + c)
                positions = np.arange(pos, pos + c)
                a["tokens"][r, local] = seq.token_ids[pos:pos + c]
                a["positions"][r, local] = positions
                kernel = np.arange(kernel_pos, kernel_pos + c)
                perm[kernel] = r * p + local
                used_a2a[r * p + local] = True
                for rr in range(n):
                    pages = np.asarray(table.prefill[rr])
                    a["prefill_slot"][rr, kernel] = pages[positions // group] * group \
                        + positions % group
                fill[r] += c
                kernel_pos += c
                pos += c
            a["prefill_cu_q_lens"][s + 1] = kernel_pos
            a["prefill_kv_lens"][s] = pos
            for rr in range(n):
                pages = table.prefill[rr]
                a["prefill_pages"][rr, s, :len(pages)] = pages
            if piece.completes:
                last_rank = max(r for r, c in enumerate(piece.counts) if c)
                add_sample(last_rank, fill[last_rank] - 1, piece.request_id)
                x_slot = self._fill_transfer(a, table, piece.request_id, pos, x_slot)
        a["prefill_cu_q_lens"][len(plan.prefill) + 1:] = kernel_pos
        a["prefill_num_seqs"][0] = len(plan.prefill)
        if p:
            # Padding kernel rows take the unused all-to-all slots: a full permutation, so
            # the inverse is a gather and every slot of the prefill slice is defined.
            perm[kernel_pos:] = np.flatnonzero(~used_a2a)
            a["prefill_inverse"][perm] = np.arange(n * p, dtype=np.int32)

        # Decode: after the rank's prefill tokens.
        dcount = [0] * n
        for slot in plan.decode:
            r = slot.rank
            seq = self.sequences[slot.request_id]
            table = decode_tables[slot.request_id]
            if table.decode_rank != r or table.decode is None:
                raise ValueError(f"request {slot.request_id} does not decode on rank {r}")
            j = dcount[r]
            dcount[r] += 1
            index = fill[r] + j
            position = len(seq.token_ids) - 1
            a["tokens"][r, index] = seq.token_ids[-1]
            a["positions"][r, index] = position
            a["decode_index"][r, j] = index
            a["decode_slot"][r, j] = table.decode[position // ps] * ps + position % ps
            a["decode_kv_len"][r, j] = position + 1
            a["decode_pages"][r, j, :len(table.decode)] = table.decode
            add_sample(r, index, slot.request_id)
        a["num_decode"][:] = dcount
        return shape, a, rows

    def _fill_transfer(self, a: dict[str, np.ndarray], table, req: int, tokens: int,
                       x_slot: int) -> int:
        n = self.num_ranks
        group = self.exec_config.page_size * n
        if table.decode is None or table.decode_rank is None:
            raise ValueError(f"request {req} completes its prefill without decode pages")
        dst = table.decode
        for g in range(-(-tokens // group)):
            for r in range(n):
                a["transfer_src"][r, x_slot] = table.prefill[r][g]
            for m in range(n):
                if g * n + m < len(dst):
                    a["transfer_dst"][table.decode_rank, x_slot * n + m] = dst[g * n + m]
            x_slot += 1
        return x_slot
