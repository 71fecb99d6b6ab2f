"""The real executor: runs ``IterationPlan``s on a device mesh with AOT-compiled buckets.

It reads nothing but the plan (tokens, page ids, sampling parameters): the host packs the
plan into one :class:`~conflux_jax.executor.batch.StepBatch`, packs it into a few int32
buffers and runs the compiled step of the plan's bucket on them (the call moves them to the
mesh).

In a multi-process instance (``distributed.py``) every process holds one of these over the
same global mesh. Process 0 runs ``execute`` and posts each host batch to the others
(``multihost.py``), which run ``follow``: the same batch, the same compiled step.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conflux_jax.config import ModelConfig
from conflux_jax.executor.batch import (
    BatchLayout,
    Packed,
    PackedSample,
    RankInputs,
    SampledRows,
    SampleRows,
    StepBatch,
    pack_forward,
)
from conflux_jax.executor.buckets import BucketConfig, ShapePlanner, StepShape
from conflux_jax.executor.compile_cache import enable_compilation_cache
from conflux_jax.executor.compile_guard import CompileGuard, RecompilationError
from conflux_jax.executor.device import (
    DEFAULT_MEMORY_UTILIZATION,
    default_buckets,
    is_accelerator,
    memory_budget,
    resolve_dtype,
)
from conflux_jax.executor.head_padding import pad_heads
from conflux_jax.executor.huge_pages import Advice, advise_in_background
from conflux_jax.executor.mesh import SP, MeshSpec, make_mesh
from conflux_jax.executor.multihost import STOP, StepChannel, put_global, unpack
from conflux_jax.executor.step import (
    ATTENTION,
    KV_LAYOUTS,
    KV_POOL_SPEC,
    StepConfig,
    build_step,
    kv_pool_shape,
    num_kv_pools,
    param_specs,
    transfer_link_bytes,
)
from conflux_jax.latency.roofline import hardware_for_device_kind
from conflux_jax.models.decoder import LINEARS
from conflux_jax.models.params import Params, pack_linears, unstack_layers
from conflux_jax.plan import (
    ExecutorLost,
    IterationPlan,
    KVLost,
    KVSpec,
    PrefillPiece,
    Preparer,
    RunningStep,
    SampledToken,
    SamplingSpec,
    StepResult,
)
from conflux_jax.sampling import MAX_LOGIT_BIAS, mask_words
from pallas_kernels._common import TPU_IMPL, asked_impl, resolve_impl
from pallas_kernels.cpu_attention import paged_attention_available
from pallas_kernels.cpu_gemm import blas_available, packed_gemm_available
from pallas_kernels.ragged_paged_attention.combined import tpu_kernel_obstacle

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ExecutorConfig:
    mesh: str | None = None  # "sp=4,tp=1"; None = every device as an sp rank
    page_size: int = 16
    # KV pages per rank. None = sized from device memory (``gpu_memory_utilization``) on
    # an accelerator, or on a CPU when a utilization is given; else CPU_NUM_PAGES.
    num_pages: int | None = None
    max_model_len: int = 2048
    buckets: BucketConfig | None = None  # None = the device's defaults (device.py)
    dtype: str = "auto"  # "auto" = bfloat16 on GPU/TPU, float32 on CPU
    attention_impl: str | None = None
    num_top_logprobs: int = 0
    compile_workers: int = 2
    return_logits: bool = False  # tests: keep each sampled row's logits in `last_logits`
    compile_cache: str | None = None  # directory; None = $CONFLUX_COMPILE_CACHE or default
    # vLLM's --gpu-memory-utilization: the share of each device's memory that weights,
    # the largest step's temporaries and the KV pool may use. None = 0.9 on an accelerator.
    gpu_memory_utilization: float | None = None
    device_memory_bytes: int | None = None  # one device's memory; None = ask the device
    # How the linears run: "xla" (XLA's dot), "packed" (our GEMM on weights packed in
    # 32-column panels, reading each layer in place: fp32 on the CPU, tp=1; 1.1-3x XLA's
    # dot at 1-256 rows, bench/RESULTS.md) or "blas" (OpenBLAS in place, fp32 on the
    # CPU). "auto" = packed where it can run, else xla.
    linears: str = "auto"
    # Decode attention: "rpa" (the ragged paged attention kernel, ``attention_impl``) or
    # "cpu" (a C++ FFI handler reading each sequence's pages in place, fp32 on the CPU:
    # 2.7x faster than the XLA form at 16 decodes of ~150 tokens). "auto" = "cpu" where it
    # runs and the kernel would take its XLA path, else "rpa".
    decode_attention: str = "auto"
    # Prefill attention (prefill chunks, owner-alone suffixes): the same choices, "cpu"
    # being a C++ handler for ragged causal chunks (2.1x faster than the XLA form at 256
    # queries on 512 keys, ``python -m conflux_jax.bench kernels``).
    prefill_attention: str = "auto"
    # How the layer weights are held: "stacked" ([L, ...] arrays, the layers in a scan) or
    # "per_layer" (arrays of their own, the layers unrolled: no matmul reads a copy of its
    # weights, for a program L times longer to compile). "auto" = per_layer on a GPU/TPU
    # (the copies cost an 8B model's decode step ~6 ms on an H200, bench/RESULTS.md),
    # stacked on the CPU: there the unrolled prefill step ran 3x slower (XLA copies the
    # KV pool around each layer's attention loop) and compiled 4.6x longer, for a decode
    # step within the host's noise.
    layer_weights: str = "auto"
    # How the KV is pooled: "split" (a K pool and a V pool) or "combined" (one pool, K and V
    # of each head side by side: the layout JAX's TPU kernel reads). "auto" = combined
    # exactly when attention runs that kernel (``attention_impl`` "tpu", the default on a
    # TPU for head dims it takes), else split.
    kv_layout: str = "auto"


LINEAR_CHOICES = ("auto", *LINEARS)
LAYER_WEIGHTS = ("auto", "stacked", "per_layer")
ATTENTION_CHOICES = ("auto", *ATTENTION)
KV_LAYOUT_CHOICES = ("auto", *KV_LAYOUTS)


def resolve_layer_weights(layer_weights: str, linears: str, platform: str) -> str:
    """"stacked" or "per_layer" for ``ExecutorConfig.layer_weights`` on ``platform``, given
    the linears route asked for (``ExecutorConfig.linears``)."""
    if layer_weights not in LAYER_WEIGHTS:
        raise ValueError(f"layer_weights must be one of {LAYER_WEIGHTS}, got {layer_weights!r}")
    if layer_weights == "per_layer" and linears == "blas":
        raise ValueError("layer_weights='per_layer' cannot run with linears='blas' "
                         "(OpenBLAS reads the stacked weights in place)")
    if layer_weights == "auto":
        return "per_layer" if is_accelerator(platform) else "stacked"
    return layer_weights


def _cpu_fp32_obstacle(platform: str, dtype: Any) -> str:
    """Why a CPU fp32 handler cannot run on ``platform`` in ``dtype`` ("" when it can)."""
    if platform != "cpu":
        return f"it runs on the CPU only (this mesh is {platform})"
    if jnp.dtype(dtype) != jnp.float32:
        return f"it is fp32 only (dtype is {jnp.dtype(dtype).name})"
    return ""


def resolve_linears(linears: str, platform: str, dtype: Any, tp: int) -> str:
    """The route for ``ExecutorConfig.linears``; one asked for where it cannot run is
    refused with the reason."""
    if linears not in LINEAR_CHOICES:
        raise ValueError(f"linears must be one of {LINEAR_CHOICES}, got {linears!r}")
    if linears == "xla":
        return linears
    if linears == "blas":
        why = _cpu_fp32_obstacle(platform, dtype) or blas_available()[1]
        if why:
            raise ValueError(f"linears='blas' cannot run: {why}")
        return linears
    why = _cpu_fp32_obstacle(platform, dtype) or (
        "its panels are not split over tensor-parallel shards (tp=1 only)" if tp > 1 else "")
    built = "" if why else packed_gemm_available()[1]  # where it would run: does it build?
    if not why and not built:
        return "packed"
    if linears == "packed":
        raise ValueError(f"linears='packed' cannot run: {why or built}")
    if built:
        log.warning("linears: XLA's dot (the packed GEMM is unavailable: %s)", built)
    return "xla"


def resolve_kv_layout(choice: str, attention_impl: str | None, config: ModelConfig,
                      n: int, tp: int, dtype: Any) -> tuple[str, str]:
    """(kv layout, attention impl) for ``ExecutorConfig.kv_layout`` and ``attention_impl``;
    ``config`` has the mesh's padded head counts. JAX's TPU kernel asked for by name where
    it cannot run (or with split pools) is refused with the reason; picked by default, it
    gives way to the XLA path."""
    if choice not in KV_LAYOUT_CHOICES:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUT_CHOICES}, got {choice!r}")
    impl = resolve_impl(attention_impl, combined_kv=True)
    asked_layout = "combined" if choice == "combined" else "split"
    if impl != TPU_IMPL:
        return asked_layout, impl
    asked = asked_impl(attention_impl) == TPU_IMPL
    # The kernel's calls: prefill over head shards (Ulysses), decode over the rank's heads.
    hq, hkv, d = config.num_heads // tp, config.num_kv_heads // tp, config.head_dim
    why = (tpu_kernel_obstacle(hq // n, hkv // n, d, dtype)
           or tpu_kernel_obstacle(hq, hkv, d, dtype))
    if choice == "split":
        why = why or "kv_layout='split' was asked for, and the kernel reads the combined pool"
    if not why:
        return "combined", impl
    if asked:
        raise ValueError(f"attention_impl='tpu' cannot run: {why}")
    log.warning("attention: the kernel's XLA form (JAX's TPU kernel cannot run: %s)", why)
    return asked_layout, "xla"


def resolve_attention(option: str, choice: str, platform: str, dtype: Any,
                      attention_impl: str | None, kv_layout: str = "split") -> str:
    """"rpa" or "cpu" for ``ExecutorConfig.decode_attention`` or ``prefill_attention``
    (``option``, named in errors); "cpu" asked for where it cannot run is refused with the
    reason."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"{option} must be one of {ATTENTION_CHOICES}, got {choice!r}")
    if choice == "rpa":
        return choice
    why = _cpu_fp32_obstacle(platform, dtype) or (
        "it reads split K and V pools (kv_layout is combined)" if kv_layout == "combined"
        else "")
    if not why and choice == "auto" and resolve_impl(attention_impl) != "xla":
        return "rpa"  # the kernel asked for by name (interpret, pallas) runs everywhere
    why = why or paged_attention_available()[1]
    if not why:
        return "cpu"
    if choice == "cpu":
        raise ValueError(f"{option}='cpu' cannot run: {why}")
    if platform == "cpu":
        log.warning("%s: the kernel's XLA form (the CPU handler is unavailable: %s)",
                    option.replace("_", " "), why)
    return "rpa"


CPU_NUM_PAGES = 256  # per rank, when a CPU is not asked to size the pool from memory


class DeviceInputs(NamedTuple):
    """One step's inputs as its compiled calls take them (host buffers in a single process,
    which the call moves; global arrays across processes): the forward's (after the weights
    and the pools: ``rank``, ``shared`` and ``fed``, here the executor's zeros: no row
    fed on the device) and the sampler's (after the logits)."""

    forward: tuple[Any, ...]
    sample: Any


class _PackedInputs(NamedTuple):
    """One step's inputs packed on the host, not yet on the mesh (see ``_pack``)."""

    forward: tuple[Packed, Packed]  # the forward's ``rank`` (per rank) and ``shared``
    sample: PackedSample  # the sampler's rows; fields already on the devices as they are
    on_host: dict[str, np.ndarray]  # the sampler's fields still to send


# A decode slot's token is fed at column ``index`` of the forward's packed per-rank buffer:
# ``RankInputs.tokens`` (i32[N, T]) is its first leaf; or on the device, its sampling row's
# ``token_from`` (i32[N, R], the second leaf) at column T + row.
assert [f.name for f in dataclasses.fields(RankInputs)[:2]] == ["tokens", "token_from"]


@dataclasses.dataclass(frozen=True)
class BuiltStep:
    """A plan's step made on the host ahead of its launch (``JaxExecutor.build``), its
    decode slots' tokens still to be fed (by ``JaxExecutor.launch``)."""

    plan: IterationPlan
    shape: StepShape
    host: StepBatch
    rows: dict[int, tuple[int, int]]  # request -> (rank, sampling row)
    packed: _PackedInputs
    token_rank: np.ndarray  # i32[slots]: each decode slot's rank, ``plan.decode`` order
    token_index: np.ndarray  # i32[slots]: and where its token sits in the rank's buffer
    token_row: np.ndarray  # i32[slots]: and its sampling row
    tokens: Callable[[], Sequence[int]]  # the slots' tokens, once the previous step's are in


@dataclasses.dataclass
class _SteadyDecodes:
    """The last decode-only host batch and where each of its slots sits, so that the next
    one with the same decodes (the common case: every resident decode one token further)
    is that batch updated in place (``JaxExecutor._decodes_again``)."""

    shape: StepShape
    ids: list[int]  # each slot's request, ``plan.decode`` order
    pages: list[tuple[int, ...]]  # each slot's page list as the table holds it
    batch: StepBatch
    rows: dict[int, tuple[int, int]]
    rank: np.ndarray  # i32[slots]
    slot: np.ndarray  # i32[slots]: its index in the rank's decode slice
    row: np.ndarray  # i32[slots]: its sampling row
    index: np.ndarray  # i32[slots]: its token's place in the rank's buffer


class _Dispatched(NamedTuple):
    """A step whose forward and sampler are dispatched."""

    out: Any  # the forward's outputs (logits, new pools)
    sampled: jax.Array  # i32[N, R, packed]: the sampler's packed rows
    tokens: jax.Array  # i32[N, R_max]: their tokens, padded (a next step's ``fed``)


class LaunchedStep:
    """A launched plan (``JaxExecutor.launch``); ``result()`` waits for its tokens once
    and keeps them. ``dispatched``: the step on the device, when its sampled tokens can
    feed a next one there (a single process)."""

    def __init__(self, executor: JaxExecutor, rows: dict[int, tuple[int, int]], start: float,
                 collect: Callable[[], tuple[Any, Any]],
                 dispatched: _Dispatched | None = None) -> None:
        self._executor, self._start, self._collect = executor, start, collect
        self.rows = rows  # request -> (rank, sampling row)
        self.dispatched = dispatched
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            s, logits = self._collect()
            sampled = self._executor._sampled(self.rows, s, logits)
            end = time.perf_counter()
            self._result = StepResult(sampled=sampled, latency_s=end - self._start, end_s=end)
        return self._result


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How the KV pool was sized on one device (bytes), for the log and the benchmarks."""

    num_pages: int  # per rank
    page_bytes: int  # K and V of one page, every layer, this device's heads
    device_bytes: int = 0  # the device's memory (0: the pool was not sized from memory)
    budget_bytes: int = 0  # utilization * device_bytes, capped by the allocator
    weight_bytes: int = 0
    activation_bytes: int = 0  # the largest step's temporaries, inputs and outputs
    largest_shape: StepShape | None = None
    utilization: float | None = None


class JaxExecutor:
    """Owns the device state (weights, KV pools) and the compiled step per bucket."""

    def __init__(self, config: ModelConfig, params: Params, exec_config: ExecutorConfig):
        self.exec_config = ec = exec_config
        self.compile_cache_dir = enable_compilation_cache(ec.compile_cache)
        self.mesh_spec = MeshSpec.parse(ec.mesh)
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        if self.process_count > 1 and self.mesh_spec.size != jax.device_count():
            raise ValueError(f"mesh {self.mesh_spec} uses {self.mesh_spec.size} of the "
                             f"{jax.device_count()} devices of this {self.process_count}-"
                             "process instance; a multi-process mesh must use them all")
        self.mesh = make_mesh(self.mesh_spec)
        # This process's devices in the mesh: what its memory is sized from.
        self._local_devices = [d for d in self.mesh.devices.flat
                               if d.process_index == self.process_index]
        self.platform = self.mesh.devices.flat[0].platform
        self.device_kind = self.mesh.devices.flat[0].device_kind
        self.dtype = jnp.dtype(resolve_dtype(ec.dtype, self.platform))
        n, tp = self.mesh_spec.sp, self.mesh_spec.tp
        buckets = ec.buckets or default_buckets(self.platform)
        if n == 1:
            # One rank: a completing prefill's KV only moves between this rank's own pages,
            # never over a link, so one transfer bucket spares the extra compiles.
            buckets = dataclasses.replace(buckets, transfer=(buckets.transfer[-1],))
        self.buckets = buckets
        self.model_config = config
        padded_config, padded_params = pad_heads(config, params, n * tp)
        self.layer_weights = resolve_layer_weights(ec.layer_weights, ec.linears, self.platform)
        self.linears = resolve_linears(ec.linears, self.platform, self.dtype, tp)
        if self.layer_weights == "per_layer" and self.linears == "blas":
            self.linears = "xla"  # per-layer weights leave OpenBLAS no copy to spare
        self.kv_layout, self.attention_impl = resolve_kv_layout(
            ec.kv_layout, ec.attention_impl, padded_config, n, tp, self.dtype)
        self.decode_attention, self.prefill_attention = (
            resolve_attention(option, getattr(ec, option), self.platform, self.dtype,
                              self.attention_impl, self.kv_layout)
            for option in ("decode_attention", "prefill_attention"))
        log.info("attention: %s in decode, %s in prefill", *(
            "the CPU handler (KV pages read in place)" if a == "cpu"
            else "the ragged paged attention kernel"
            for a in (self.decode_attention, self.prefill_attention)))
        if self.layer_weights == "per_layer":
            padded_params = unstack_layers(padded_params)
        if self.linears == "packed":
            padded_params = pack_linears(padded_params)
        self._param_specs = param_specs(padded_params)
        dtype = self.dtype

        def place(a: Any, spec: Any) -> jax.Array:
            sharding = NamedSharding(self.mesh, spec)
            if self.process_count == 1:
                return jax.device_put(jnp.asarray(a, dtype), sharding)
            return put_global(np.asarray(a, dtype), sharding)

        self.params = jax.tree.map(place, padded_params, self._param_specs)
        max_sample_rows = buckets.decode[-1] + buckets.max_prefill_seqs  # R_max
        # The forward's ``fed`` when no row takes its token on the device (i32[N, R_max]).
        self._no_fed = jax.jit(lambda: jnp.zeros((n, max_sample_rows), jnp.int32),
                               out_shardings=NamedSharding(self.mesh, P(SP)))()
        prefill_pages_per_seq = -(-ec.max_model_len // (ec.page_size * n))
        self.planner = ShapePlanner(
            self.buckets, max_pages_per_seq=-(-ec.max_model_len // ec.page_size),
            transfer_groups=prefill_pages_per_seq)
        self._shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s),
                                       StepBatch.specs())

        def step_config(num_pages: int) -> StepConfig:
            return StepConfig(
                model=padded_config, num_ranks=n, tp=tp, page_size=ec.page_size,
                num_pages=num_pages, num_top_logprobs=ec.num_top_logprobs,
                attention_impl=self.attention_impl, linears=self.linears,
                decode_attention=self.decode_attention,
                prefill_attention=self.prefill_attention, kv_layout=self.kv_layout,
                # The CPU handlers' library writes the KV too, wherever it attends, on
                # stacked layers: unrolled ones hand it the step's pool argument, which XLA
                # then copies around each in-place call (so it does around its own scatter).
                kv_write="cpu" if "cpu" in (self.decode_attention, self.prefill_attention)
                and self.layer_weights == "stacked" else "xla",
                replicate_samples=self.process_count > 1,
                max_sample_rows=max_sample_rows)

        def layout(num_pages: int) -> BatchLayout:
            return BatchLayout(n, self.buckets.max_prefill_seqs, prefill_pages_per_seq,
                               num_pages, vocab=config.vocab_size,
                               mask_words=mask_words(config.vocab_size),
                               history_len=ec.max_model_len, bias_width=MAX_LOGIT_BIAS)

        self.memory = self._plan_memory(step_config, layout)
        num_pages = self._agree(self.memory.num_pages)
        if num_pages != self.memory.num_pages:
            self.memory = dataclasses.replace(self.memory, num_pages=num_pages)
        self.step_config = step_config(num_pages)
        self._kv_spec = KVSpec(num_ranks=n, num_pages=num_pages, page_size=ec.page_size)
        pool_sharding = NamedSharding(self.mesh, KV_POOL_SPEC)
        shape = kv_pool_shape(self.step_config)
        count = num_kv_pools(self.step_config)
        self._zero_pools = jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for _ in range(count)),
                                   out_shardings=(pool_sharding,) * count)
        # (K, V) or (KV,) (``kv_layout``): donated to every forward, replaced by its outputs
        self.kv_pools = self._zero_pools()
        self.huge_pages: Advice | None = None
        self._on_huge_pages([*jax.tree_util.tree_leaves(self.params), *self.kv_pools],
                            "the weights and KV pools")
        self._step = build_step(self.step_config, self.mesh, self._param_specs)
        self.layout = layout(num_pages)
        # Device-resident mask / history / bias padding per row count R: a step with no
        # constrained, penalized or biased row sends these instead of fresh host buffers.
        self._idle_rows: dict[int, tuple[Any, Any, Any]] = {}
        # Each resident decode's page list as an array, rebuilt only when the scheduler hands
        # over a new list (it keeps one per request until a page is added): request ->
        # (pages tuple, i32[pages]).
        self._page_arrays: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
        self._built: BuiltStep | None = None  # a plan made ahead, launched next
        self._last: LaunchedStep | None = None  # the step dispatched last (single process)
        self._steady: _SteadyDecodes | None = None  # the last decode-only batch
        self._compiled: dict[StepShape, Any] = {}  # the forward per step shape
        self._samplers: dict[int, Any] = {}  # the sampler per sampling-row count R
        self.guard = CompileGuard()
        self.last_transfer_bytes = 0  # link bytes of the last step's KV transfer
        self.clock_start = time.perf_counter()
        # Multi-process: the leader posts each step to the followers, who follow().
        self.channel = StepChannel() if self.process_count > 1 else None
        if self.channel is not None and self.is_leader:
            # Followers wait for a stop message; send it however the leader exits (runs
            # before JAX's own exit hook, which waits for every process to shut down).
            atexit.register(self.close)
        self._log_kv_capacity()

    def _on_huge_pages(self, arrays: list[jax.Array], what: str) -> None:
        """On the CPU, back long-lived buffers with huge pages: every step streams the
        weights and the live KV pages (``huge_pages``). ``huge_pages`` holds the advice
        (a thread; its ``result`` once done), None off the CPU."""
        self.huge_pages = (advise_in_background(arrays, what) if self.platform == "cpu"
                           else None)

    def _put(self, tree: Any, shardings: Any) -> Any:
        """Host values onto the mesh: one batched ``device_put`` in a single process;
        per process, its own devices' slices in several (``multihost.put_global``)."""
        if self.process_count == 1:
            return jax.device_put(tree, shardings)
        return put_global(tree, shardings)

    def _send(self, tree: Any) -> Any:
        """A step's packed host inputs as its compiled call takes them. In a single process
        the numpy arrays themselves: the call moves them to the mesh on its own C++ path (one
        device: ~2 us for the step's packed buffers, against ~45 us for a ``device_put``
        of them apart, which took ~0.4 ms inside a serving step, while the device waited
        for the step's launch). Across processes, each one's own slices (``_put``, with
        ``_packed_shardings``: made only there)."""
        if self.process_count == 1:
            return tree
        return self._put(tree, self._packed_shardings(tree))

    @property
    def builds_ahead(self) -> bool:
        """Can :meth:`build` make steps ahead? In a single process: the other processes
        of an instance take each step whole, in its message."""
        return self.channel is None

    @property
    def is_leader(self) -> bool:
        """Process 0: the one that plans and calls ``execute`` (the others ``follow``)."""
        return self.process_index == 0

    def _agree(self, num_pages: int) -> int:
        """Pages per rank every process can hold: the pool is one global array, so hosts
        that sized it from their own memory take the smallest."""
        if self.process_count == 1:
            return num_pages
        from jax.experimental import multihost_utils

        return int(np.min(multihost_utils.process_allgather(np.int32(num_pages))))

    # ------------------------------------------------------------------ KV pool sizing
    def _plan_memory(self, step_config: Any, layout: Any) -> MemoryPlan:
        """Pages per rank: given, or what device memory holds after the weights and the
        largest step's temporaries (vLLM's profile-then-allocate, with the compiled
        executable's memory analysis in place of a profiling run)."""
        ec = self.exec_config
        local_heads = step_config(1).model.num_kv_heads // self.mesh_spec.tp
        m = self.model_config
        page_bytes = (2 * m.num_layers * ec.page_size * local_heads * m.head_dim
                      * self.dtype.itemsize)
        util = ec.gpu_memory_utilization
        if ec.num_pages is not None:
            return MemoryPlan(ec.num_pages, page_bytes)
        if util is None and not is_accelerator(self.platform):
            return MemoryPlan(CPU_NUM_PAGES, page_bytes)
        util = DEFAULT_MEMORY_UTILIZATION if util is None else util
        devices = self._local_devices
        if ec.device_memory_bytes is not None:
            size, budget = ec.device_memory_bytes, int(util * ec.device_memory_bytes)
        else:
            hw = hardware_for_device_kind(self.device_kind)
            size, budget = memory_budget(devices, util, hw.hbm_bytes if hw else None)
        dev0 = devices[0]  # a device of this process (its shards are addressable)
        weights = sum(sh.data.nbytes for leaf in jax.tree.leaves(self.params)
                      for sh in leaf.addressable_shards if sh.device == dev0)
        # Compile the largest step against a small stand-in pool: its temporaries do not
        # grow with the pool (tests/executor/test_memory_safety.py: the pools are aliased
        # and never copied), so they are the same for the real one.
        probe_pages = self.planner.max_pages_per_seq + 1
        largest = max(self.planner.all_shapes())
        probe = build_step(step_config(probe_pages), self.mesh, self._param_specs)
        pool = jax.ShapeDtypeStruct(kv_pool_shape(step_config(probe_pages)), self.dtype,
                                    sharding=NamedSharding(self.mesh, KV_POOL_SPEC))
        pools = (pool,) * num_kv_pools(step_config(probe_pages))
        mem = probe.forward.lower(*self._abstract_args(largest, layout(probe_pages), pools)
                                  ).compile().memory_analysis()
        probe_pool = probe_pages * page_bytes  # K and V on this device
        inputs = max(0, mem.argument_size_in_bytes - weights - probe_pool)
        outputs = max(0, mem.output_size_in_bytes - mem.alias_size_in_bytes)
        # The sampler runs while the forward's logits are held (counted in its outputs,
        # so not again among the sampler's arguments).
        rows = StepBatch.sample_rows(largest, layout(probe_pages))
        sampler = probe.sample.lower(*self._abstract_sample_args(rows, layout(probe_pages))
                                     ).compile().memory_analysis()
        logits = rows * m.vocab_size * 4  # f32[R, V] on this device
        activations = (mem.temp_size_in_bytes + inputs + outputs
                       + sampler.temp_size_in_bytes + sampler.output_size_in_bytes
                       + max(0, sampler.argument_size_in_bytes - logits))
        pages = (budget - weights - activations) // page_bytes
        need = -(-ec.max_model_len // ec.page_size) + self.planner.transfer_groups
        if pages < need:
            raise ValueError(
                f"not enough device memory for the KV cache: {budget / 2**30:.2f} GiB "
                f"({util:.2f} of {size / 2**30:.2f} GiB) less {weights / 2**30:.2f} GiB of "
                f"weights and {activations / 2**30:.2f} GiB for the largest step {largest} "
                f"leaves {max(pages, 0)} pages per rank; one {ec.max_model_len}-token "
                f"request needs {need}. Raise gpu_memory_utilization, or lower "
                "max_model_len or the token buckets")
        return MemoryPlan(int(pages), page_bytes, size, budget, weights, activations,
                          largest, util)

    def _log_kv_capacity(self) -> None:
        """vLLM's two start-up lines: how many tokens of KV fit, and for how many
        max-length requests at once."""
        mp, ec, n = self.memory, self.exec_config, self.num_ranks
        if mp.device_bytes:
            log.info("memory per device: %.2f GiB = %.2f of %.2f GiB; weights %.2f GiB, "
                     "largest step %s %.2f GiB, KV cache %.2f GiB", mp.budget_bytes / 2**30,
                     mp.utilization, mp.device_bytes / 2**30, mp.weight_bytes / 2**30,
                     mp.largest_shape, mp.activation_bytes / 2**30,
                     mp.num_pages * mp.page_bytes / 2**30)
        tokens = mp.num_pages * ec.page_size
        log.info("KV cache: %d tokens (%d per rank x %d ranks, %d pages of %d, %s); "
                 "max concurrency for %d tokens per request: %.2fx", tokens * n, tokens, n,
                 mp.num_pages, ec.page_size, self.dtype.name, ec.max_model_len,
                 tokens * n / ec.max_model_len)

    # ------------------------------------------------------------------ protocol
    @property
    def num_ranks(self) -> int:
        return self.mesh_spec.sp

    @property
    def kv(self) -> KVSpec:
        return self._kv_spec

    def now(self) -> float:
        return time.perf_counter()

    # ------------------------------------------------------------------ compilation
    def _send_forward(self, batch: StepBatch) -> tuple[Packed, Packed]:
        """The forward's part of a host batch (``rank``, ``shared``) for its call
        (``_send``): one packed buffer each, not one transfer (of one shard per device)
        per array."""
        return self._send(pack_forward(batch))

    def _send_sample(self, sample: SampleRows) -> PackedSample:
        """The sampler's rows for its call (``_send``; small fields packed); the large
        buffers that are already the executor's device-resident padding stay as they are."""
        packed, on_host = self._pack_sample(sample)
        return packed._replace(**self._send(on_host))

    @staticmethod
    def _pack_sample(sample: SampleRows) -> tuple[PackedSample, dict[str, np.ndarray]]:
        """The sampler's rows packed, and those of its fields still on the host."""
        packed = PackedSample.pack(sample)
        return packed, {k: x for k, x in packed._asdict().items()
                        if not isinstance(x, jax.Array)}

    @functools.cached_property
    def _batch_shardings(self) -> tuple[NamedSharding, NamedSharding]:
        """Per rank (``sp``) and replicated, made once: every step's inputs take them."""
        return NamedSharding(self.mesh, P(SP)), NamedSharding(self.mesh, P())

    def _packed_shardings(self, packed: Any) -> Any:
        """Shardings for a packed batch: a ``Packed``'s buffer per rank (``sp``) or
        replicated as its layout says; a ``PackedSample``'s leaves all per rank."""
        per_rank, replicated = self._batch_shardings

        def sharding(x: Any) -> Any:
            if isinstance(x, Packed):  # the same tree, its buffer's sharding as the leaf
                return Packed(per_rank if x.layout.per_rank else replicated, x.layout)
            return per_rank

        return jax.tree.map(sharding, packed, is_leaf=lambda x: isinstance(x, Packed))

    def device_inputs(self, host: StepBatch) -> DeviceInputs:
        """A host batch as the compiled forward and sampler take it (``_send``): the
        forward's and the sampler's buffers, packed."""
        return self._send_packed(self._pack(host))

    def _pack(self, host: StepBatch) -> _PackedInputs:
        return _PackedInputs(pack_forward(host), *self._pack_sample(host.sample))

    def _send_packed(self, packed: _PackedInputs) -> DeviceInputs:
        forward, sample, on_host = packed
        forward, on_host = self._send((forward, on_host))
        return DeviceInputs((*forward, self._no_fed), sample._replace(**on_host))

    def compiled_step(self, shape: StepShape) -> tuple[Any, Any]:
        """The compiled forward and sampler of ``shape`` (compiled now when warm-up did
        not: outside serving)."""
        rows = StepBatch.sample_rows(shape, self.layout)
        if shape not in self._compiled or rows not in self._samplers:  # not after warm-up
            self.compile_shape(shape)
        return self._compiled[shape], self._samplers[rows]

    def _abstract_args(self, shape: StepShape, layout: BatchLayout | None = None,
                       pools: tuple[jax.ShapeDtypeStruct, ...] | None = None):
        """The forward's abstract arguments for ``shape`` (``layout`` and ``pools``: a
        stand-in pool's, when sizing the real one)."""
        packed = pack_forward(StepBatch.padding(shape, layout or self.layout))
        rank, shared = _abstract(packed, self._packed_shardings(packed))

        def abstract(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

        if pools is None:
            pools = tuple(abstract(pool) for pool in self.kv_pools)
        return (jax.tree.map(abstract, self.params), pools, rank, shared,
                abstract(self._no_fed))

    def _abstract_sample_args(self, rows: int, layout: BatchLayout | None = None):
        """The sampler's abstract arguments for ``rows`` (R) sampling rows per rank."""
        layout = layout or self.layout
        packed = PackedSample.pack(StepBatch.padding_sample(rows, layout))
        sample = _abstract(packed, self._packed_shardings(packed))
        logits = jax.ShapeDtypeStruct((layout.num_ranks, rows, self.model_config.vocab_size),
                                      jnp.float32, sharding=NamedSharding(self.mesh, P(SP)))
        return logits, sample

    def _sample_rows_of(self, shapes: list[StepShape]) -> list[int]:
        """The sampler sizes ``shapes`` need that are not compiled yet."""
        rows = {StepBatch.sample_rows(s, self.layout) for s in shapes}
        return sorted(r for r in rows if r not in self._samplers)

    def compile_shape(self, shape: StepShape) -> None:
        if shape not in self._compiled:
            self._compiled[shape] = self._compile_forward(shape)
        for rows in self._sample_rows_of([shape]):
            self._samplers[rows] = self._compile_sampler(rows)

    def _compile_forward(self, shape: StepShape) -> Any:
        return self._step.forward.lower(*self._abstract_args(shape)).compile()

    def _compile_sampler(self, rows: int) -> Any:
        return self._step.sample.lower(*self._abstract_sample_args(rows)).compile()

    def warmup(self, shapes: list[StepShape] | None = None, progress: bool = True) -> float:
        """AOT-compile every bucket the engine can emit (each shape's forward and each
        row count's sampler); returns seconds spent."""
        from tqdm.auto import tqdm

        shapes = shapes or self.planner.all_shapes()
        todo = [s for s in shapes if s not in self._compiled]
        samplers = self._sample_rows_of(shapes)
        start = time.perf_counter()
        bar = tqdm(total=len(todo) + len(samplers), desc="compiling buckets", unit="exe",
                   disable=not progress)
        workers = max(1, self.exec_config.compile_workers)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            forwards = {s: pool.submit(self._compile_forward, s) for s in todo}
            sample_futs = {r: pool.submit(self._compile_sampler, r) for r in samplers}
            for s, fut in forwards.items():
                self._compiled[s] = fut.result()
                bar.update(1)
            for r, fut in sample_futs.items():
                self._samplers[r] = fut.result()
                bar.update(1)
        bar.close()
        return time.perf_counter() - start

    # ------------------------------------------------------------------ execution
    def execute(self, plan: IterationPlan, prepare: Preparer | None = None) -> StepResult:
        """Run one plan; returns the token sampled for each sampling request.

        ``prepare(plan)`` (the engine's grammar masks) runs on the host while the device
        runs the forward; its ``token_masks`` go to the sampler. In a multi-process
        instance it runs first: the other processes need the masks in the step's message.
        """
        return self.launch(plan, prepare).result()

    def launch(self, plan: IterationPlan, prepare: Preparer | None = None,
               after: RunningStep | None = None) -> LaunchedStep:
        """Start one plan as :meth:`execute` runs it and return once the device has it:
        the host is free while it computes. ``result()`` on the returned step waits for
        the tokens. (A multi-process instance runs the step to the end here.)

        ``after``: the step launched last, still running, whose samples the decode slots
        of ``plan`` (made by :meth:`build`) take on the device (see :meth:`feeds_ahead`):
        the device goes from that step to this one without waiting for the host."""
        if not self.is_leader:
            raise RuntimeError("only process 0 executes plans; the others follow()")
        start = time.perf_counter()
        built = self._built
        if after is not None and (built is None or built.plan is not plan
                                  or after is not self._last):
            raise ValueError("a plan launched after a running step must be the one built "
                             "last, after the step launched last (feeds_ahead)")
        self._built = None
        if after is not None:
            return self._launch_built(cast(BuiltStep, built), start, self._last)
        if built is not None and built.plan is plan and prepare is None:
            return self._launch_built(built, start)
        if prepare is not None and self.channel is not None:
            plan, prepare = prepare(plan), None
        shape, host, rows = self.build_batch(plan)
        if shape not in self._compiled and self.guard.serving:
            raise RuntimeError(f"step shape {shape} was not compiled at warm-up")
        self.last_transfer_bytes = self.transfer_bytes(host)
        complete = None
        if prepare is not None:
            def complete() -> SampleRows:
                return self._with_masks(host.sample, rows, prepare(plan).token_masks)
        if self.channel is None:
            dispatched = self._dispatch(shape, host, complete)
            return self._launched(rows, start, dispatched)
        # Past this point every process runs the step: any failure leaves them out of
        # step with each other, so it ends the instance, not just this step.
        seq = self.channel.send(shape, host)
        try:
            ran = self._run(shape, host)
        except RecompilationError:
            self.channel.done(seq)  # the step itself ran everywhere
            raise
        except Exception as exc:
            raise self._lost(exc) from exc
        self.channel.done(seq)
        return LaunchedStep(self, rows, start, lambda: ran)

    def build(self, plan: IterationPlan, tokens: Callable[[], Sequence[int]]) -> None:
        """Make ``plan``'s step on the host, inputs packed, while the device still runs the
        previous one (the engine plans ahead). Its decode slots' tokens are what that one
        samples: the next :meth:`launch` of ``plan`` feeds them ``tokens()`` (one per
        slot, in ``plan.decode`` order) and starts it. For plans that need no
        ``Preparer`` and carry no penalty histories, in a single process."""
        if not self.builds_ahead or plan.histories or plan.token_masks:
            raise ValueError("only a single process builds plans ahead, and only plans "
                             "without penalty histories or token masks")
        self._built = None
        shape, host, rows = self.build_batch(plan)
        if shape not in self._compiled and self.guard.serving:
            raise RuntimeError(f"step shape {shape} was not compiled at warm-up")
        at = np.array([rows[d.request_id] for d in plan.decode], np.int32).reshape(-1, 2)
        rank, row = at[:, 0], at[:, 1]
        self._built = BuiltStep(plan, shape, host, rows, self._pack(host), rank,
                                host.rank.sample_index[rank, row], row, tokens)

    def feeds_ahead(self, plan: IterationPlan, after: RunningStep) -> bool:
        """Can ``launch(plan, after=after)`` take each decode slot's token on the device
        from ``after``'s samples? Only for the plan :meth:`build` made last, after the step
        dispatched last, when every slot's token was sampled on its own rank there; and on
        a mesh of several devices only for a step with no collective: decode slots alone,
        no tensor parallelism. Devices wait for each other in a step's collectives, so one
        launched on the outputs of a step that failed on some of them only (its inputs
        failed there, not elsewhere) would leave the others waiting for good; without
        collectives each device's part runs or fails on its own."""
        built, last = self._built, self._last
        if built is None or built.plan is not plan or last is None or after is not last:
            return False
        shape = built.shape
        if self.mesh.devices.size > 1 and (self.mesh_spec.tp > 1 or shape.prefill
                                           or shape.transfer):
            return False
        prev = last.rows
        return all((src := prev.get(d.request_id)) is not None and src[0] == d.rank
                   for d in plan.decode)

    def _launch_built(self, built: BuiltStep, start: float,
                      after: LaunchedStep | None = None) -> LaunchedStep:
        """Start a step made by :meth:`build`, its decode slots fed their tokens: from
        the host (``built.tokens()``), or on the device from ``after``'s sampled tokens,
        by the sampling row that each slot's request had there (``token_from``)."""
        buf = built.packed.forward[0].buf  # the packed copy of the rank inputs that is sent
        fed = None
        if after is None:
            tokens = built.tokens()
            if len(tokens) != len(built.token_rank):
                raise ValueError(f"{len(tokens)} tokens for {len(built.token_rank)} decode "
                                 "slots")
            at = built.token_rank, built.token_index
            built.host.rank.tokens[at] = tokens
            buf[at] = tokens
        else:
            assert after.dispatched is not None
            prev, fed = after.rows, after.dispatched.tokens
            src = np.array([prev.get(d.request_id, (-1, -1)) for d in built.plan.decode],
                           np.int32).reshape(-1, 2)  # each slot's (rank, row) there
            if (src[:, 0] != built.token_rank).any():
                raise ValueError("a decode slot's token was not sampled on its own rank in "
                                 "the step it is fed from (feeds_ahead)")
            buf[built.token_rank, built.shape.tokens + built.token_row] = src[:, 1]
        self.last_transfer_bytes = self.transfer_bytes(built.host)
        dispatched = self._dispatch(built.shape, built.host, packed=built.packed, fed=fed)
        return self._launched(built.rows, start, dispatched)

    def _launched(self, rows: dict[int, tuple[int, int]], start: float,
                  dispatched: _Dispatched) -> LaunchedStep:
        """A step dispatched in a single process, kept as the last one (``feeds_ahead``)."""
        self._last = LaunchedStep(self, rows, start, lambda: self._collect(dispatched),
                                  dispatched)
        return self._last

    def _run(self, shape: StepShape, host: StepBatch) -> tuple[Any, Any]:
        """Run the step of ``shape`` on ``host`` to the end; see :meth:`_collect`."""
        return self._collect(self._dispatch(shape, host))

    def _dispatch(self, shape: StepShape, host: StepBatch,
                  complete: Callable[[], SampleRows] | None = None,
                  packed: _PackedInputs | None = None,
                  fed: jax.Array | None = None) -> _Dispatched:
        """Dispatch the forward of ``shape`` on ``host`` (``packed``: already packed;
        ``fed``: the previous step's sampled tokens, which its ``token_from`` rows read),
        then the sampler on ``host.sample`` or, when given, on what ``complete()`` returns
        (host work that overlaps the forward). Returns before the device has finished
        either."""
        forward, sampler = self.compiled_step(shape)
        with self.guard.watch():
            try:
                if complete is None:  # the sampler's rows are known: one transfer
                    inputs = self._send_packed(self._pack(host) if packed is None else packed)
                    (rank, shared, _), sample = inputs
                else:
                    (rank, shared), sample = self._send_forward(host), None
                out = forward(self.params, self.kv_pools, rank, shared,
                              self._no_fed if fed is None else fed)
                # The forward's pools, valid unless it fails (which surfaces below).
                self.kv_pools = out.kv_pools
                if sample is None:
                    sample = self._send_sample(complete())  # while the forward runs
                sampled, tokens = sampler(out.logits, sample)
            except Exception as exc:
                lost = self._kv_lost(exc)
                if lost is None:
                    raise
                raise lost from exc
        return _Dispatched(out, sampled, tokens)

    def _collect(self, step: _Dispatched) -> tuple[Any, Any]:
        """Wait for a dispatched step: the numpy ``SampledRows`` (replicated: every rank's
        rows) and, with ``return_logits``, the sampling rows' logits f32[N, R, V]."""
        try:
            # Errors of the device computations surface here, when results are read.
            s = SampledRows.from_packed(np.asarray(jax.device_get(step.sampled)))
            logits = jax.device_get(step.out.logits) if self.exec_config.return_logits \
                else None
        except Exception as exc:
            lost = self._kv_lost(exc)
            if lost is None:
                raise
            raise lost from exc
        return s, logits

    def _kv_lost(self, exc: Exception) -> KVLost | None:
        """After a step raised ``exc``: when the pools the executor holds now are gone
        (donated to a forward that failed, or to one launched after the failed step, on
        its samples), rebuild them empty and return the :class:`KVLost` to raise; None
        when the KV is intact (the failure came before a forward took the pools, or
        after the last one that took them ran: a host or sampler failure)."""
        if self.channel is not None:
            return None  # fails the instance (ExecutorLost): no pool to rebuild
        pools = self.kv_pools
        if not any(pool.is_deleted() for pool in pools) and all(map(_computed, pools)):
            return None
        self.kv_pools = self._zero_pools()
        self._on_huge_pages(list(self.kv_pools), "the rebuilt KV pools")
        return KVLost(f"the compiled step failed ({type(exc).__name__}: {exc}); "
                      "its donated KV pools are gone and were rebuilt empty")

    def _sampled(self, rows: Mapping[int, tuple[int, int]], s: Any, logits: Any
                 ) -> dict[int, SampledToken]:  # noqa: ANN401
        """Each sampling request's token from the step's rows (``rows``: request id ->
        (rank, row))."""
        # Python lists once, then plain indexing: per-row numpy scalars cost ~10 us each.
        tokens, logprobs = s.tokens.tolist(), s.logprobs.tolist()
        new = tuple.__new__  # the NamedTuple's Python-level __new__ skipped: once per row
        if s.top_ids.shape[-1] == 0:  # no alternatives compiled in: one shared empty map
            none = SampledToken._field_defaults["top"]
            sampled = {req: new(SampledToken, (tokens[rank][row], logprobs[rank][row], none))
                       for req, (rank, row) in rows.items()}
        else:
            top_ids, top_logprobs = s.top_ids.tolist(), s.top_logprobs.tolist()
            sampled = {req: new(SampledToken, (tokens[rank][row], logprobs[rank][row],
                                               dict(zip(top_ids[rank][row],
                                                        top_logprobs[rank][row], strict=True))))
                       for req, (rank, row) in rows.items()}
        if logits is not None:
            self.last_logits = {req: logits[rank, row] for req, (rank, row) in rows.items()}
        return sampled

    def _lost(self, exc: Exception) -> ExecutorLost:
        if isinstance(exc, ExecutorLost):
            return exc
        return ExecutorLost(
            f"the {self.process_count}-process instance failed during a step "
            f"({type(exc).__name__}: {exc}); a process most likely died or left (see its "
            "log). The instance cannot run further steps")

    # ------------------------------------------------------------------ multi-process
    def follow(self, on_step: Callable[[StepShape, StepBatch], None] | None = None) -> int:
        """A follower's loop: run each step process 0 posts until it stops; returns the
        steps run. ``on_step(shape, host_batch)`` is called after each one. Raises
        :class:`~conflux_jax.plan.ExecutorLost` when the leader or a step fails."""
        if self.channel is None or self.is_leader:
            raise RuntimeError("follow() runs on processes 1.. of a multi-process instance")
        steps = 0
        while True:
            msg = self.channel.receive()
            if msg.kind == STOP:
                log.info("process 0 stopped the instance after %d steps", steps)
                return steps
            assert msg.shape is not None
            host = unpack(msg.payload, self._padding(msg.shape, msg.masked, msg.penalized,
                                                       msg.biased))
            try:
                self._run(msg.shape, host)  # the masks came with the message
            except Exception as exc:
                raise self._lost(exc) from exc
            steps += 1
            if on_step is not None:
                on_step(msg.shape, host)

    def close(self) -> None:
        """Leader of a multi-process instance: stop the followers (idempotent; a no-op
        in a single process)."""
        if self.channel is not None and self.is_leader:
            try:
                self.channel.stop()
            except ExecutorLost as exc:  # nobody left to stop
                log.warning("could not stop the other processes: %s", exc)

    # ------------------------------------------------------------------ host batch layout
    def build_batch(self, plan: IterationPlan
                    ) -> tuple[StepShape, StepBatch, dict[int, tuple[int, int]]]:
        """Pack a plan into fixed-shape host arrays: (shape, batch, request -> sample row).

        A decode-only plan with the same decodes as the last one updates that batch in
        place (only positions, tokens, KV slots and new pages change): a returned batch
        is valid until the next call.
        """
        n = self.num_ranks
        ps = self.exec_config.page_size
        group = ps * n
        max_seqs = self.layout.max_prefill_seqs
        if len(plan.prefill) > max_seqs:
            raise ValueError(f"plan has {len(plan.prefill)} prefill pieces; at most "
                             f"{max_seqs} fit a step")
        n_p = plan.prefill_per_rank(n)
        n_d = plan.decode_per_rank(n)
        # Transfer groups in decode-rank order: each destination's groups are one slice
        # (what the ragged all-to-all sends).
        completing = sorted((p for p in plan.prefill if p.completes),
                            key=lambda p: -1 if p.decode_rank is None else p.decode_rank)
        groups_moved = sum(len(p.pages[0]) - self._resident_groups(p)
                           for p in completing if p.pages)
        if groups_moved > self.planner.transfer_groups:
            raise ValueError(f"plan moves {groups_moved} KV page groups to decode ranks; a "
                             f"step moves at most {self.planner.transfer_groups}")
        # Cached prefixes loaded from their owners, in page groups per sending rank: they
        # share the transfer bucket (a step with either compiles both).
        loaded = [0] * n
        for piece in plan.prefill:
            if piece.load_pages:
                if piece.load_rank is None or len(piece.load_pages) * ps != piece.start:
                    raise ValueError(f"request {piece.request_id} loads "
                                     f"{len(piece.load_pages)} cached pages for a chunk "
                                     f"starting at {piece.start}")
                loaded[piece.load_rank] += len(piece.load_pages)
        load_groups = -(-max(loaded) // n)
        if load_groups > self.planner.transfer_groups:
            raise ValueError(f"plan loads {max(loaded)} cached pages from one rank; a step "
                             f"loads at most {self.planner.transfer_groups * n}")
        shape = self.planner.shape_for(
            prefill_max=max(n_p), decode_max=max(n_d),
            combined_max=max(a + b for a, b in zip(n_p, n_d, strict=True)),
            decode_pages_max=max((len(s.pages) for s in (*plan.decode, *plan.local_prefill)),
                                 default=1),
            transfer_max=max(groups_moved, load_groups))
        p = shape.prefill
        biased = any(p.completes and p.sampling.logit_bias for p in plan.prefill) or \
            any(d.sampling.logit_bias for d in (*plan.decode, *plan.local_prefill))
        decode_only = not (plan.prefill or plan.local_prefill or plan.histories
                           or plan.token_masks)
        if decode_only and (again := self._decodes_again(plan, shape)) is not None:
            return again
        self._steady = None
        batch = self._padding(shape, False, bool(plan.histories), biased)
        a, meta, rows_in = batch.rank, batch.shared, batch.sample
        rows: dict[int, tuple[int, int]] = {}
        n_sample = [0] * n
        histories = plan.histories

        def add_sample(rank: int, index: int, req: int, spec: SamplingSpec, step: int) -> None:
            row = n_sample[rank]
            n_sample[rank] += 1
            a.sample_index[rank, row] = index
            rows_in.temperature[rank, row] = spec.temperature
            rows_in.top_k[rank, row] = spec.top_k
            rows_in.top_p[rank, row] = spec.top_p
            rows_in.min_p[rank, row] = spec.min_p
            rows_in.top_logprobs[rank, row] = spec.top_logprobs
            rows_in.seed[rank, row] = spec.seed
            rows_in.step[rank, row] = step
            rows[req] = (rank, row)
            add_extras(rank, row, req, spec)

        def add_extras(rank: int, row: int, req: int, spec: SamplingSpec) -> None:
            """A row's penalty history and logit biases, when it has them."""
            if histories and (hist := histories.get(req)) is not None:
                self._fill_penalties(rows_in, rank, row, spec, hist)
            if spec.logit_bias:
                ids, values = zip(*spec.logit_bias, strict=True)
                rows_in.bias_ids[rank, row, :len(ids)] = ids
                rows_in.bias[rank, row, :len(ids)] = values

        # Prefill: rank-local slots [0, n_p^r) in plan order; kernel order is plan order
        # with each chunk contiguous, which is what the attention kernel needs.
        fill = [0] * n
        kernel_pos = 0
        used_a2a = np.zeros(n * p, bool)
        for s, piece in enumerate(plan.prefill):
            _check_piece(piece, n)
            tokens = np.asarray(piece.token_ids, np.int32)
            pos = piece.start
            for r, c in enumerate(piece.counts):
                if c == 0:
                    continue
                local = np.arange(fill[r], fill[r] + c)
                positions = np.arange(pos, pos + c)
                a.tokens[r, local] = tokens[pos - piece.start:pos - piece.start + c]
                a.positions[r, local] = positions
                kernel = np.arange(kernel_pos, kernel_pos + c)
                meta.perm[kernel] = r * p + local
                used_a2a[r * p + local] = True
                for rr in range(n):
                    pages = np.asarray(piece.pages[rr])
                    a.prefill_slot[rr, kernel] = pages[positions // group] * group \
                        + positions % group
                fill[r] += c
                kernel_pos += c
                pos += c
            meta.cu_q_lens[s + 1] = kernel_pos
            meta.kv_lens[s] = pos
            for rr in range(n):
                a.prefill_pages[rr, s, :len(piece.pages[rr])] = piece.pages[rr]
            if piece.completes:
                last_rank = max(r for r, c in enumerate(piece.counts) if c)
                add_sample(last_rank, fill[last_rank] - 1, piece.request_id, piece.sampling,
                           piece.sample_step)
        for piece in completing:
            self._fill_transfer(batch, piece)
        sent = [0] * n
        for piece in plan.prefill:
            if piece.load_pages:
                self._fill_load(batch, piece, sent)
        meta.cu_q_lens[len(plan.prefill) + 1:] = kernel_pos
        meta.num_seqs[0] = len(plan.prefill)
        if p:
            # Padding kernel rows take the unused all-to-all slots: a full permutation, so
            # the inverse is a gather and every slot of the prefill slice is defined.
            meta.perm[kernel_pos:] = np.flatnonzero(~used_a2a)
            meta.inverse[meta.perm] = np.arange(n * p, dtype=np.int32)
            # On one rank this is the identity, which the step relies on to skip both
            # gathers (step.py).

        # Decode slice, after the rank's prefill tokens: one row per decode slot, then one
        # per local prefill token (each writes its KV there; the slice writes every row's
        # KV before any row reads). The decode slots attend one query each; each local
        # prefill is one ragged sequence over its pages.
        dcount = [0] * n

        def add_row(r: int, token: int, position: int, pages: tuple[int, ...]) -> int:
            j = dcount[r]
            dcount[r] += 1
            index = fill[r] + j
            a.tokens[r, index] = token
            a.positions[r, index] = position
            a.decode_index[r, j] = index
            a.decode_slot[r, j] = pages[position // ps] * ps + position % ps
            return j

        at = self._fill_decodes(batch, plan.decode, fill, dcount, n_sample, rows)
        if decode_only and at is not None:
            self._steady = _SteadyDecodes(shape, [d.request_id for d in plan.decode],
                                          [d.pages for d in plan.decode], batch, rows, *at)
        for slot in plan.decode if biased or histories else ():  # most steps have neither
            if slot.sampling.logit_bias or (histories and slot.request_id in histories):
                add_extras(*rows[slot.request_id], slot.request_id, slot.sampling)
        a.num_decode[:] = dcount
        for lp in plan.local_prefill:
            r, pages = lp.rank, lp.pages
            if len(lp.token_ids) != lp.length or lp.length < 1 or not pages:
                raise ValueError(f"local prefill of request {lp.request_id} carries "
                                 f"{len(lp.token_ids)} token ids for {lp.length} tokens"
                                 f"{'' if pages else ' and no pages'}")
            k = int(a.num_local[r])
            a.num_local[r] += 1
            first = int(a.local_cu[r, k])
            for i, token in enumerate(lp.token_ids):
                j = add_row(r, token, lp.start + i, pages)
                a.local_index[r, first + i] = fill[r] + j
            a.local_cu[r, k + 1:] = first + lp.length
            a.local_kv_len[r, k] = lp.start + lp.length
            a.local_pages[r, k, :len(pages)] = pages
            add_sample(r, fill[r] + j, lp.request_id, lp.sampling, lp.sample_step)
        a.num_rows[:] = np.asarray(fill) + dcount
        a.num_sample[:] = n_sample
        if plan.token_masks:
            batch = dataclasses.replace(
                batch, sample=self._with_masks(batch.sample, rows, plan.token_masks))
        return shape, batch, rows

    def _decodes_again(self, plan: IterationPlan, shape: StepShape
                       ) -> tuple[StepShape, StepBatch, dict[int, tuple[int, int]]] | None:
        """``plan``'s batch as the last decode-only batch updated in place, when ``plan``
        runs the same decodes in the same order at the same shape; else None. Their
        sampling rows, parameters and buffer places stay; what moves is written again."""
        st, slots = self._steady, plan.decode
        if st is None or st.shape != shape or len(slots) != len(st.ids) or \
                [d.request_id for d in slots] != st.ids:
            return None
        a, ps = st.batch.rank, self.exec_config.page_size
        r, j = st.rank, st.slot
        for k, (slot, pages) in enumerate(zip(slots, st.pages, strict=True)):
            if slot.pages is not pages:  # a page was added (or the list replaced)
                a.decode_pages[r[k], j[k]] = 0
                a.decode_pages[r[k], j[k], :len(slot.pages)] = slot.pages
                st.pages[k] = slot.pages
        pos = np.fromiter([d.position for d in slots], np.int32, len(slots))
        a.tokens[r, st.index] = [d.token_id for d in slots]
        a.positions[r, st.index] = pos
        a.decode_kv_len[r, j] = pos + 1
        a.decode_slot[r, j] = a.decode_pages[r, j, pos // ps] * ps + pos % ps
        st.batch.sample.step[r, st.row] = [d.sample_step for d in slots]
        return shape, st.batch, st.rows

    def _fill_decodes(self, batch: StepBatch, slots: Any, fill: list[int], dcount: list[int],
                      n_sample: list[int], rows: dict[int, tuple[int, int]]
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """The plan's decode slots, one row each after their rank's prefill tokens, and
        their sampling rows, written field by field over all slots at once (numpy's
        scalar writes, per slot and field, were most of the host batch's time at 256
        decodes). The page tables too: every slot's pages in one scatter, from arrays
        kept per request while its page list is unchanged. Penalty histories and logit
        biases are the caller's. Returns each slot's rank, decode slice index, sampling row
        and buffer index (i32[slots] each), None without slots."""
        if not slots:
            return None
        a, s_in, ps = batch.rank, batch.sample, self.exec_config.page_size
        js, row_ids, page_arrays = [], [], []
        cached, kept = self._page_arrays, {}
        for slot in slots:
            r, rid, pages = slot.rank, slot.request_id, slot.pages
            if not pages:
                raise ValueError(f"decode slot of request {rid} has no pages")
            j, row = dcount[r], n_sample[r]
            dcount[r], n_sample[r] = j + 1, row + 1
            rows[rid] = (r, row)
            js.append(j)
            row_ids.append(row)
            entry = cached.get(rid)
            if entry is None or entry[0] is not pages:
                entry = (pages, np.asarray(pages, np.int32))
            kept[rid] = entry
            page_arrays.append(entry[1])
        self._page_arrays = kept  # requests no longer decoding drop out
        r = np.array([slot.rank for slot in slots])
        pos = np.array([slot.position for slot in slots])
        j, row = np.array(js), np.array(row_ids)
        counts = np.array([len(x) for x in page_arrays])
        flat = np.concatenate(page_arrays)
        starts = np.cumsum(counts) - counts
        a.decode_pages[np.repeat(r, counts), np.repeat(j, counts),
                       np.arange(flat.size) - np.repeat(starts, counts)] = flat
        index = np.asarray(fill)[r] + j
        a.tokens[r, index] = [slot.token_id for slot in slots]
        a.positions[r, index] = pos
        a.decode_index[r, j] = index
        a.decode_slot[r, j] = flat[starts + pos // ps] * ps + pos % ps
        a.decode_kv_len[r, j] = pos + 1
        a.sample_index[r, row] = index
        specs = [slot.sampling for slot in slots]
        s_in.temperature[r, row] = [sp.temperature for sp in specs]
        s_in.top_k[r, row] = [sp.top_k for sp in specs]
        s_in.top_p[r, row] = [sp.top_p for sp in specs]
        s_in.min_p[r, row] = [sp.min_p for sp in specs]
        s_in.top_logprobs[r, row] = [sp.top_logprobs for sp in specs]
        s_in.seed[r, row] = [sp.seed for sp in specs]
        s_in.step[r, row] = [slot.sample_step for slot in slots]
        return r, j, row, index

    def _with_masks(self, sample: SampleRows, rows: dict[int, tuple[int, int]],
                    masks: dict[int, Any] | None) -> SampleRows:
        """``sample`` with the rows of ``masks`` (request -> i32[W] allowed tokens)
        constrained: a fresh host bitmask in place of the device-resident padding."""
        if not masks:
            return sample
        bitmask = StepBatch.padding_bitmask(sample.temperature.shape[1], self.layout)
        for req, mask in masks.items():
            if (at := rows.get(req)) is not None:
                bitmask[at] = mask
        return dataclasses.replace(sample, bitmask=bitmask)

    def _padding(self, shape: StepShape, masked: bool, penalized: bool,
                 biased: bool = False) -> StepBatch:
        """The step's host batch; mask, history and bias buffers only when some row uses
        them (``masked``, ``penalized``, ``biased``), else the device-resident padding."""
        layout = self.layout
        r = StepBatch.sample_rows(shape, layout)
        idle = self._idle_rows.get(r)
        if idle is None:
            spec = self._shardings.sample
            idle = (self._put(StepBatch.padding_bitmask(r, layout), spec.bitmask),
                    self._put(StepBatch.padding_history(r, layout), spec.history),
                    self._put(StepBatch.padding_bias(r, layout), (spec.bias_ids, spec.bias)))
            self._idle_rows[r] = idle
        return StepBatch.padding(shape, layout,
                                 bitmask=None if masked else idle[0],
                                 history=None if penalized else idle[1],
                                 bias=None if biased else idle[2])

    def _fill_penalties(self, rows_in: Any, rank: int, row: int, spec: SamplingSpec,
                        hist: tuple[Any, Any]) -> None:
        prompt, output = hist
        h = self.layout.history_len
        tokens = np.concatenate([np.asarray(prompt, np.int32),
                                 np.asarray(output, np.int32)])[:h]
        rows_in.history[rank, row, :len(tokens)] = tokens
        rows_in.num_prompt[rank, row] = len(prompt)
        rows_in.presence[rank, row] = spec.presence_penalty
        rows_in.frequency[rank, row] = spec.frequency_penalty
        rows_in.repetition[rank, row] = spec.repetition_penalty

    def _fill_transfer(self, batch: StepBatch, piece: PrefillPiece) -> None:
        """Transfer slots moving a completed prefill's page groups to its decode pages.

        Called in decode-rank order: the piece's groups follow those already placed, so
        each destination's groups stay one contiguous slice."""
        n = self.num_ranks
        a, meta = batch.rank, batch.shared
        if piece.decode_rank is None or not piece.decode_pages:
            raise ValueError(f"request {piece.request_id} completes its prefill without "
                             "decode pages")
        d, dst = piece.decode_rank, piece.decode_pages
        x_slot = int(meta.transfer_count.sum())
        if meta.transfer_count[d] == 0:
            meta.transfer_start[d] = x_slot
        received = int(meta.transfer_count[d])  # the groups' index on arrival at d
        # Groups wholly inside the cached prefix resident on d stay; in the group that
        # straddles it, the resident pages' destinations are dropped.
        first = self._resident_groups(piece)
        resident = piece.resident_tokens // self.exec_config.page_size
        for j, g in enumerate(range(first, len(piece.pages[0]))):
            for r in range(n):
                a.transfer_src[r, x_slot + j] = piece.pages[r][g]
            for m in range(n):
                if resident <= g * n + m < len(dst):
                    a.transfer_dst[d, (received + j) * n + m] = dst[g * n + m]
        meta.transfer_count[d] += len(piece.pages[0]) - first

    def _resident_groups(self, piece: PrefillPiece) -> int:
        """Page groups of a completing piece already wholly on its decode rank."""
        return piece.resident_tokens // (self.exec_config.page_size * self.num_ranks)

    def _fill_load(self, batch: StepBatch, piece: PrefillPiece, sent: list[int]) -> None:
        """Load slots copying a cached prefix from its owner into the piece's prefill
        pages: cached page j (positions j*ps..) is prefill sub-page j % N of page j // N."""
        n = self.num_ranks
        a = batch.rank
        owner = piece.load_rank
        assert owner is not None
        per_rank = a.load_src.shape[1]
        for j, page in enumerate(piece.load_pages):
            y = sent[owner]
            sent[owner] += 1
            batch.shared.load_count[owner] += 1
            a.load_src[owner, y] = page
            for q in range(n):
                a.load_dst[q, owner * per_rank + y] = piece.pages[q][j // n] * n + j % n

    def transfer_bytes(self, batch: StepBatch) -> int:
        """Bytes one step's KV transfer and prefix-cache loads send over links (K and V,
        every layer): each moved page group is N decode pages, N-1 of which leave another
        rank; each loaded cached page leaves its owner in N-1 of its N head shards (N
        loaded pages weigh one moved group)."""
        cfg, n = self.step_config, self.num_ranks
        moved = transfer_link_bytes(cfg, int(batch.shared.transfer_count.sum()),
                                    self.dtype.itemsize)
        loaded = transfer_link_bytes(cfg, int(batch.shared.load_count.sum()),
                                     self.dtype.itemsize)
        return moved + loaded // n


def _abstract(tree: Any, shardings: Any) -> Any:
    """Abstract values (shape, dtype, sharding) of a host tree's leaves."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        tree, shardings)


def _computed(array: jax.Array) -> bool:
    """Whether ``array``'s computation succeeded (waits for it)."""
    try:
        array.block_until_ready()
    except Exception:  # noqa: BLE001 - the computation's own error: it failed
        return False
    return True


def _check_piece(piece: PrefillPiece, num_ranks: int) -> None:
    """A prefill piece must carry its tokens and its pages on every rank."""
    if len(piece.token_ids) != piece.length:
        raise ValueError(f"prefill piece of request {piece.request_id} carries "
                         f"{len(piece.token_ids)} token ids for {piece.length} tokens")
    if len(piece.pages) != num_ranks:
        raise ValueError(f"request {piece.request_id} has no prefill pages")
