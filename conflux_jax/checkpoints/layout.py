"""Assemble per-layer source tensors into the stacked layout of ``models/params.py``.

Both the safetensors and the GGUF loader name each source tensor's place in our layout
(a ``Placement``), let the assembler check every shape against the config *before* any
data is read (so a wrong config.json fails fast with one message listing the
mismatches), then stream the tensors in. Stacked arrays are preallocated in the target
dtype and filled layer by layer, so peak memory is one copy of the model plus one tensor.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import ml_dtypes
import numpy as np

from conflux_jax.config import ModelConfig
from conflux_jax.models.params import CheckpointError, Params, param_shapes, validate_params

_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "fp32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "fp16": np.dtype(np.float16),
}
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(dtype: Any) -> np.dtype:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` (or a numpy/jax dtype) -> numpy dtype."""
    if isinstance(dtype, str):
        if dtype.lower() in _DTYPES:
            return _DTYPES[dtype.lower()]
        raise CheckpointError(f"unsupported dtype {dtype!r}; use one of {SUPPORTED_DTYPES}")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise CheckpointError(f"unsupported dtype {dtype!r}; use one of {SUPPORTED_DTYPES}"
                              ) from None
    if dt not in _DTYPES.values():
        raise CheckpointError(f"unsupported dtype {dt}; use one of {SUPPORTED_DTYPES}")
    return dt


def dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name  # ml_dtypes registers "bfloat16" as the name


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one source tensor goes: ``params[key]`` or ``params["layers"][key][layer]``.

    ``transpose``: the source matrix is ``[out, in]`` (HF/GGUF) and ours is ``[in, out]``.
    """

    key: str
    layer: int | None = None
    transpose: bool = False


@dataclasses.dataclass(frozen=True)
class NameTable:
    """How one format names tensors: whole-model names, and per-layer suffixes after a
    ``layer_re`` whose groups are (layer index, suffix)."""

    top: dict[str, Placement]
    layer_re: re.Pattern[str]
    per_layer: dict[str, tuple[str, bool]]  # suffix -> (our key, transpose)

    def place(self, name: str) -> Placement | None:
        if name in self.top:
            return self.top[name]
        m = self.layer_re.fullmatch(name)
        if m and m.group(2) in self.per_layer:
            key, transpose = self.per_layer[m.group(2)]
            return Placement(key, int(m.group(1)), transpose)
        return None


class ParamAssembler:
    """Collect source tensors into a ``Params`` tree for ``config`` in ``dtype``."""

    def __init__(self, config: ModelConfig, dtype: np.dtype, source: str) -> None:
        self.config = config
        self.dtype = np.dtype(dtype)
        self.source = source
        shapes = param_shapes(config)
        self._layer_shapes: dict[str, tuple[int, ...]] = shapes.pop("layers")
        self._top_shapes: dict[str, tuple[int, ...]] = shapes
        self._arrays: dict[str, np.ndarray] = {}
        self._filled: dict[str, set[int | None]] = {}
        self._problems: list[str] = []

    # -- planning -----------------------------------------------------------------------
    def expected_source_shape(self, p: Placement) -> tuple[int, ...] | str:
        """The shape the source tensor must have, or a string saying why it has no place."""
        if p.layer is None:
            if p.key not in self._top_shapes:
                return f"the config has no {p.key!r} weight"
            shape = self._top_shapes[p.key]
        else:
            if p.key not in self._layer_shapes:
                return f"the config has no per-layer {p.key!r} weight"
            if not 0 <= p.layer < self.config.num_layers:
                return (f"layer {p.layer} is out of range; the config has "
                        f"{self.config.num_layers} layers")
            shape = self._layer_shapes[p.key][1:]
        return tuple(reversed(shape)) if p.transpose else tuple(shape)

    def problem(self, message: str) -> None:
        """Record a problem to report with the others in one error."""
        self._problems.append(message)

    def check(self, tensor_name: str, p: Placement | None, shape: tuple[int, ...]) -> None:
        """Record a problem if ``tensor_name`` (source ``shape``) does not fit ``p``."""
        if p is None:
            self._problems.append(f"unexpected tensor {tensor_name}")
            return
        expected = self.expected_source_shape(p)
        if isinstance(expected, str):
            self._problems.append(f"unexpected tensor {tensor_name} ({expected})")
        elif tuple(shape) != expected:
            self._problems.append(
                f"tensor {tensor_name} has shape {tuple(shape)}, config expects {expected}")

    def check_complete(self, planned: list[Placement]) -> None:
        """Record every weight of the layout that no planned source tensor provides."""
        have: dict[str, set[int | None]] = {}
        for p in planned:
            have.setdefault(p.key, set()).add(p.layer)
        for key in self._top_shapes:
            if key not in have:
                self._problems.append(f"missing weight {key}")
        for key in self._layer_shapes:
            missing = sorted(set(range(self.config.num_layers)) - have.get(key, set()))
            if missing:
                shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
                self._problems.append(f"missing weight layers.{key} for layer(s) {shown}")

    def raise_if_problems(self, what: str = "weights do not match the config") -> None:
        if self._problems:
            probs = self._problems
            shown = "; ".join(probs[:6]) + (f"; ... ({len(probs) - 6} more)"
                                             if len(probs) > 6 else "")
            raise CheckpointError(f"{self.source}: {what}: {shown}")

    # -- filling ------------------------------------------------------------------------
    def put(self, p: Placement, array: np.ndarray) -> None:
        """Store ``array`` (source orientation, e.g. f32[out, in]) at ``p``, cast to dtype."""
        src = array.T if p.transpose else array
        if p.layer is None:
            self._arrays[p.key] = np.array(src, dtype=self.dtype, copy=True, order="C")
        else:
            dest = self._arrays.get(p.key)
            if dest is None:
                dest = np.empty(self._layer_shapes[p.key], dtype=self.dtype)
                self._arrays[p.key] = dest
            dest[p.layer] = src  # numpy casts (round-to-nearest-even for bfloat16)
        self._filled.setdefault(p.key, set()).add(p.layer)

    def finish(self) -> Params:
        """The assembled tree, checked with ``validate_params``."""
        params: Params = {k: self._arrays[k] for k in self._top_shapes if k in self._arrays}
        params["layers"] = {k: self._arrays[k] for k in self._layer_shapes if k in self._arrays}
        for key in self._layer_shapes:
            if key in self._arrays and len(self._filled[key]) != self.config.num_layers:
                raise CheckpointError(f"{self.source}: weight layers.{key} was not filled for "
                                      "every layer")
        validate_params(self.config, params, self.source)
        return params


def cast_params(params: Params, dtype: np.dtype) -> Params:
    """``params`` with every array in ``dtype`` (arrays already in it are not copied)."""
    dtype = np.dtype(dtype)

    def cast(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: cast(v) for k, v in x.items()}
        arr = np.asarray(x)
        return arr if arr.dtype == dtype else arr.astype(dtype)

    return cast(params)


def iter_leaves(params: Params, prefix: str = "") -> list[tuple[str, np.ndarray]]:
    """``[("layers.wq", array), ...]`` in a stable order."""
    out: list[tuple[str, np.ndarray]] = []
    for k in sorted(params):
        v = params[k]
        if isinstance(v, dict):
            out.extend(iter_leaves(v, f"{prefix}{k}."))
        else:
            out.append((f"{prefix}{k}", v))
    return out
