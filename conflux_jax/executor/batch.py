"""The step's device boundary: fixed-shape input and output PyTrees.

A step is two executables: the forward (``RankInputs`` + ``SharedInputs`` -> updated KV
pools and the sampling rows' logits) and the sampler (logits + ``SampleRows`` -> tokens),
so the host can fill the sampler's token masks while the device runs the forward.
Inputs are grouped by sharding: :class:`RankInputs` and :class:`SampleRows` (a leading
``[N]`` axis sharded over ``sp``: every rank's own tokens, KV slots and sampling rows) and
:class:`SharedInputs` (replicated: after the all-to-all every rank holds every prefill
token for its head shard, so the prefill attention metadata is the same everywhere).
:meth:`StepBatch.padding` is the one constructor; the host fills its numpy arrays in
place and sends each executable's part with one ``device_put`` of one :class:`Packed`
buffer per sharding (the sampler's large buffers apart). Shapes use: N ranks, T
token slots, P prefill slots, D decode slots, S prefill sequences, R = D + S sampling
rows, Wd / Wp page-table widths (decode / prefill view), X transfer page groups, K top
logprobs, V vocabulary.

Padding conventions: KV slots ``-1`` never write; buffer indices ``T`` are dropped on
scatter; transfer destination page ids ``num_pages`` are dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from conflux_jax.executor.buckets import StepShape
from conflux_jax.executor.mesh import SP


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """The static sizes of an executor that a step shape does not carry."""

    num_ranks: int  # N
    max_prefill_seqs: int  # S when the step has prefill
    prefill_pages_per_seq: int  # Wp
    num_pages: int  # pages per rank (the dropped transfer destination)
    vocab: int = 0  # V: history padding (dropped by the penalties' scatter)
    mask_words: int = 1  # W
    history_len: int = 1  # H
    bias_width: int = 1  # B


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleRows:
    """Per rank: how each sampling row is sampled (which buffer row it is:
    ``RankInputs.sample_index``).

    ``bitmask``, ``history`` and the bias rows are large and unused by most steps: a step
    with no constrained (penalized, biased) row sends the executor's device-resident
    padding for them, so it pays no transfer (see ``StepBatch.padding``).
    """

    temperature: jax.Array  # f32[N, R]
    top_k: jax.Array  # i32[N, R]
    top_p: jax.Array  # f32[N, R]
    min_p: jax.Array  # f32[N, R]  (0 = off)
    top_logprobs: jax.Array  # i32[N, R]  alternatives' logprobs wanted (0 = none)
    seed: jax.Array  # u32[N, R]
    step: jax.Array  # i32[N, R]  output index being sampled (per-request key)
    presence: jax.Array  # f32[N, R]  presence penalty (0 = off)
    frequency: jax.Array  # f32[N, R]  frequency penalty (0 = off)
    repetition: jax.Array  # f32[N, R]  repetition penalty (1 = off)
    num_prompt: jax.Array  # i32[N, R]  prompt tokens at the head of ``history``
    bitmask: jax.Array  # i32[N, R, W] allowed tokens, packed; all ones = unconstrained
    history: jax.Array  # i32[N, R, H] prompt then output ids of penalized rows; pad V
    bias_ids: jax.Array  # i32[N, R, B] logit_bias tokens; pad V (dropped)
    bias: jax.Array  # f32[N, R, B] their additive bias


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RankInputs:
    """Per rank, sharded over ``sp``."""

    tokens: jax.Array  # i32[N, T]   prefill tokens, then decode tokens, then padding
    # A sampling row's input token (at sample_index) taken on the device from the previous
    # step's samples, this rank's row token_from (the step launched before that one's
    # tokens reach the host); -1 (padding): ``tokens`` holds it.
    token_from: jax.Array  # i32[N, R]
    positions: jax.Array  # i32[N, T]   absolute position of each token
    decode_index: jax.Array  # i32[N, D]   buffer index of each decode slot (pad: T)
    decode_slot: jax.Array  # i32[N, D]   decode-view KV slot page*ps+offset (pad: -1)
    decode_kv_len: jax.Array  # i32[N, D]   KV length after this token
    decode_pages: jax.Array  # i32[N, D, Wd] decode-view page table
    num_decode: jax.Array  # i32[N]      live decode slots on the rank
    prefill_slot: jax.Array  # i32[N, N*P] prefill-view KV slot per kernel-ordered token
    prefill_pages: jax.Array  # i32[N, S, Wp] prefill-view page table (per-rank page ids)
    # Transfer groups are sorted by decode rank, the same order on every rank (each rank
    # holds one head shard of every group): destination d's groups are the slice
    # SharedInputs.transfer_start[d] : + transfer_count[d].
    transfer_src: jax.Array  # i32[N, X]   prefill-view pages to move (one page group each)
    transfer_dst: jax.Array  # i32[N, X*N] decode pages here of the groups this rank
    #                                       receives, in arrival order (pad: num_pages)
    # Prefix-cache loads share the transfer bucket (X groups = X*N decode pages per rank):
    # each rank sends every other rank its head shard of the cached decode pages it owns.
    load_src: jax.Array  # i32[N, X*N]   cached decode pages here to send (pad: any page)
    load_dst: jax.Array  # i32[N, N*X*N] per received page (source s, index j at s*X*N+j):
    #                                     prefill sub-page here = page*N + offset (pad: -1)
    # Owner-alone suffixes (plan.LocalPrefill) are rows of the decode slice after the
    # decode slots (their KV writes ride on decode_index/decode_slot); their attention is
    # one ragged call with a sequence each: local_index's rows, local_cu's boundaries.
    local_index: jax.Array  # i32[N, D]   buffer index of each local row (pad: T)
    local_cu: jax.Array  # i32[N, D+1] row boundaries of the local sequences
    local_kv_len: jax.Array  # i32[N, D]   KV length of each local sequence after its rows
    local_pages: jax.Array  # i32[N, D, Wd] its decode-view page table
    num_local: jax.Array  # i32[N]      live local sequences on the rank
    sample_index: jax.Array  # i32[N, R]  buffer index whose logits are sampled
    # Live rows: the token buffer's first ``num_rows`` (prefill, decode and local rows are
    # packed from slot 0) and ``sample_index``'s first ``num_sample``; the rest is padding,
    # which the CPU's packed GEMM skips. Padding keeps the full counts (nothing skipped).
    num_rows: jax.Array  # i32[N]
    num_sample: jax.Array  # i32[N]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedInputs:
    """Prefill attention metadata, replicated on every rank."""

    perm: jax.Array  # i32[N*P] kernel order -> all-to-all buffer index
    inverse: jax.Array  # i32[N*P] all-to-all buffer index -> kernel order
    cu_q_lens: jax.Array  # i32[S+1]
    kv_lens: jax.Array  # i32[S]
    num_seqs: jax.Array  # i32[1]
    transfer_start: jax.Array  # i32[N] first transfer group bound for decode rank d
    transfer_count: jax.Array  # i32[N] transfer groups bound for decode rank d
    load_count: jax.Array  # i32[N] cached pages rank s sends (the head of its load_src)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Everything one step reads besides the weights and the KV pools: the forward's
    ``rank`` and ``shared`` inputs, the sampler's ``sample`` rows."""

    rank: RankInputs
    shared: SharedInputs
    sample: SampleRows

    @staticmethod
    def sample_rows(shape: StepShape, layout: BatchLayout) -> int:
        """R: sampling rows per rank (no prefill slice: no rows for prefill sequences)."""
        return shape.decode + (layout.max_prefill_seqs if shape.prefill else 1)

    @staticmethod
    def padding_bitmask(rows: int, layout: BatchLayout) -> np.ndarray:  # i32[N, R, W]
        return np.full((layout.num_ranks, rows, layout.mask_words), -1, np.int32)

    @staticmethod
    def padding_history(rows: int, layout: BatchLayout) -> np.ndarray:  # i32[N, R, H]
        return np.full((layout.num_ranks, rows, layout.history_len), layout.vocab, np.int32)

    @staticmethod
    def padding_bias(rows: int, layout: BatchLayout) -> tuple[np.ndarray, np.ndarray]:
        """(i32[N, R, B] ids, f32[N, R, B] values): no token biased."""
        shape = (layout.num_ranks, rows, layout.bias_width)
        return np.full(shape, layout.vocab, np.int32), np.zeros(shape, np.float32)

    @classmethod
    def padding_sample(cls, rows: int, layout: BatchLayout, bitmask: Any = None,
                       history: Any = None, bias: tuple[Any, Any] | None = None
                       ) -> SampleRows:
        """The sampler's rows for ``rows`` (R) rows per rank, each unconstrained; the large
        buffers as given (see ``padding``) or fresh."""
        n, r, i32 = layout.num_ranks, rows, np.int32
        bias_ids, bias_values = cls.padding_bias(r, layout) if bias is None else bias
        return SampleRows(
            temperature=np.zeros((n, r), np.float32),
            top_k=np.zeros((n, r), i32), top_p=np.ones((n, r), np.float32),
            min_p=np.zeros((n, r), np.float32), top_logprobs=np.zeros((n, r), i32),
            seed=np.zeros((n, r), np.uint32),
            step=np.zeros((n, r), i32),
            presence=np.zeros((n, r), np.float32), frequency=np.zeros((n, r), np.float32),
            repetition=np.ones((n, r), np.float32), num_prompt=np.zeros((n, r), i32),
            bitmask=cls.padding_bitmask(r, layout) if bitmask is None else bitmask,
            history=cls.padding_history(r, layout) if history is None else history,
            bias_ids=bias_ids, bias=bias_values)

    @classmethod
    def padding(cls, shape: StepShape, layout: BatchLayout, bitmask: Any = None,
                history: Any = None, bias: tuple[Any, Any] | None = None) -> StepBatch:
        """Host (numpy) buffers for one step shape, every slot holding its padding value.

        ``bitmask`` / ``history`` / ``bias`` (ids, values), when given, are used as they
        are (the executor passes its device-resident padding when no row needs them);
        otherwise fresh numpy ones.
        """
        n, t, p, d = layout.num_ranks, shape.tokens, shape.prefill, shape.decode
        s = layout.max_prefill_seqs if p else 1
        r, x = cls.sample_rows(shape, layout), shape.transfer
        i32 = np.int32
        sample = cls.padding_sample(r, layout, bitmask, history, bias)
        rank = RankInputs(
            tokens=np.zeros((n, t), i32), token_from=np.full((n, r), -1, i32),
            positions=np.zeros((n, t), i32),
            decode_index=np.full((n, d), t, i32), decode_slot=np.full((n, d), -1, i32),
            decode_kv_len=np.zeros((n, d), i32),
            decode_pages=np.zeros((n, d, shape.decode_pages), i32),
            num_decode=np.zeros((n,), i32), prefill_slot=np.full((n, n * p), -1, i32),
            prefill_pages=np.zeros((n, s, layout.prefill_pages_per_seq), i32),
            transfer_src=np.zeros((n, x), i32),
            transfer_dst=np.full((n, x * n), layout.num_pages, i32),
            load_src=np.zeros((n, x * n), i32), load_dst=np.full((n, n * x * n), -1, i32),
            local_index=np.full((n, d), t, i32), local_cu=np.zeros((n, d + 1), i32),
            local_kv_len=np.zeros((n, d), i32),
            local_pages=np.zeros((n, d, shape.decode_pages), i32),
            num_local=np.zeros((n,), i32), sample_index=np.zeros((n, r), i32),
            num_rows=np.full((n,), t, i32), num_sample=np.full((n,), r, i32))
        shared = SharedInputs(
            perm=np.arange(n * p, dtype=i32), inverse=np.arange(n * p, dtype=i32),
            cu_q_lens=np.zeros((s + 1,), i32), kv_lens=np.zeros((s,), i32),
            num_seqs=np.zeros((1,), i32), transfer_start=np.zeros((n,), i32),
            transfer_count=np.zeros((n,), i32), load_count=np.zeros((n,), i32))
        return cls(rank, shared, sample)

    @staticmethod
    def specs() -> StepBatch:
        """The sharding of every field: per-rank arrays over ``sp``, the rest replicated."""
        per_rank, replicated = P(SP), P()
        return StepBatch(
            rank=RankInputs(*[per_rank] * len(dataclasses.fields(RankInputs))),
            shared=SharedInputs(*[replicated] * len(dataclasses.fields(SharedInputs))),
            sample=SampleRows(*[per_rank] * len(dataclasses.fields(SampleRows))))


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """Where each array of a packed tree lies in its buffer (hashable: static)."""

    treedef: Any  # the tree's structure
    shapes: tuple[tuple[int, ...], ...]  # each leaf's shape ([N, ...] when per rank)
    dtypes: tuple[str, ...]  # each leaf's dtype: 4 bytes wide (int32, float32, uint32)
    per_rank: bool  # leaves carry a leading [N] rank axis, kept as the buffer's first


@jax.tree_util.register_pytree_node_class
class Packed:
    """A tree of small arrays as one int32 buffer: one host-to-device transfer (one shard
    per device) for the step's inputs instead of one per array, and the same arrays again
    on the device by slicing (free inside the compiled step).

    ``buf``: i32[N, K] per rank (leaf i in columns of its own), else i32[K]. ``layout`` is
    static: it is part of the compiled step's signature, like a shape.
    """

    def __init__(self, buf: Any, layout: PackLayout) -> None:
        self.buf = buf
        self.layout = layout

    def tree_flatten(self) -> tuple[tuple[Any], PackLayout]:
        return (self.buf,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: PackLayout, children: Any) -> Packed:
        return cls(children[0], layout)

    @classmethod
    def pack(cls, tree: Any, per_rank: bool) -> Packed:
        """Host side: ``tree``'s numpy leaves (4-byte dtypes) concatenated."""
        leaves, treedef = jax.tree.flatten(tree)
        arrays = [np.asarray(leaf) for leaf in leaves]
        if any(a.dtype.itemsize != 4 for a in arrays):
            raise TypeError("only 4-byte dtypes pack into an int32 buffer")
        if per_rank:
            n = arrays[0].shape[0]
            buf = np.concatenate([a.view(np.int32).reshape(n, -1) for a in arrays], axis=1)
        else:
            buf = np.concatenate([a.view(np.int32).reshape(-1) for a in arrays])
        layout = PackLayout(treedef, tuple(a.shape for a in arrays),
                            tuple(a.dtype.name for a in arrays), per_rank)
        return cls(buf, layout)

    def unpack(self) -> Any:
        """Device side (traced): the tree again. Per rank, the leading axis is the
        buffer's own (1 inside ``shard_map``, N outside)."""
        lay, buf, out, at = self.layout, self.buf, [], 0
        for shape, dtype in zip(lay.shapes, lay.dtypes, strict=True):
            inner = shape[1:] if lay.per_rank else shape
            size = int(np.prod(inner, dtype=np.int64))
            piece = buf[:, at:at + size] if lay.per_rank else buf[at:at + size]
            at += size
            if dtype != "int32":
                piece = jax.lax.bitcast_convert_type(piece, jnp.dtype(dtype))
            out.append(piece.reshape((buf.shape[0], *inner) if lay.per_rank else inner))
        return jax.tree.unflatten(lay.treedef, out)


# The sampler's small per-row fields travel packed; the large buffers stay arrays of their
# own (most steps send the executor's device-resident padding for them).
SAMPLE_PACKED = ("temperature", "top_k", "top_p", "min_p", "top_logprobs", "seed", "step",
                 "presence", "frequency", "repetition", "num_prompt")


class PackedSample(NamedTuple):
    """``SampleRows`` as the sampler takes it: the small fields packed (i32[N, 11R])."""

    small: Packed
    bitmask: Any  # i32[N, R, W]
    history: Any  # i32[N, R, H]
    bias_ids: Any  # i32[N, R, B]
    bias: Any  # f32[N, R, B]

    @classmethod
    def pack(cls, rows: SampleRows) -> PackedSample:
        small = Packed.pack({k: getattr(rows, k) for k in SAMPLE_PACKED}, per_rank=True)
        return cls(small, rows.bitmask, rows.history, rows.bias_ids, rows.bias)

    def unpack(self) -> SampleRows:
        return SampleRows(**self.small.unpack(), bitmask=self.bitmask, history=self.history,
                          bias_ids=self.bias_ids, bias=self.bias)


def pack_forward(batch: StepBatch) -> tuple[Packed, Packed]:
    """The forward's inputs of a host batch: ``rank`` (per rank) and ``shared``, packed."""
    return Packed.pack(batch.rank, per_rank=True), Packed.pack(batch.shared, per_rank=False)


def _as_i32(a: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, jnp.int32)


def unpacked(x: Any) -> Any:
    """``x`` itself, or the tree a :class:`Packed` / :class:`PackedSample` carries."""
    return x.unpack() if isinstance(x, Packed | PackedSample) else x


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampledRows:
    """What the sampler drew, per rank and sampling row. The sampler returns it packed
    (``pack``: one array, so the host reads one buffer per device, not four)."""

    tokens: jax.Array  # i32[N, R]
    logprobs: jax.Array  # f32[N, R]
    top_ids: jax.Array  # i32[N, R, K]
    top_logprobs: jax.Array  # f32[N, R, K]

    def pack(self) -> jax.Array:  # i32[N, R, 2 + 2K]
        """Device side: token, log-probability, top ids, top log-probabilities per row
        (floats bit-cast)."""
        return jnp.concatenate([self.tokens[..., None], _as_i32(self.logprobs)[..., None],
                                self.top_ids, _as_i32(self.top_logprobs)], axis=-1)

    @classmethod
    def from_packed(cls, buf: np.ndarray) -> SampledRows:
        """Host side: numpy views of what ``pack`` made (buf i32[N, R, 2 + 2K])."""
        k = (buf.shape[-1] - 2) // 2
        return cls(buf[..., 0], buf[..., 1].view(np.float32), buf[..., 2:2 + k],
                   buf[..., 2 + k:].view(np.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutputs:
    """The forward's result: the updated (donated) KV pools and the sampling rows' logits."""

    # (K, V) each f[N, L, pages, page_size, Hkv, d], or (KV,) f[N, L, pages, page_size,
    # 2*Hkv, d] (``StepConfig.kv_layout``)
    kv_pools: tuple[jax.Array, ...]
    logits: jax.Array  # f32[N, R, V]
