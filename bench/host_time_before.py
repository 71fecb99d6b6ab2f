"""The code before the host-time work (``dbe0529``) under today's ``host-time`` measure.

Usage: ``git worktree add /tmp/before dbe0529`` then
``python bench/host_time_before.py /tmp/before`` (run from anywhere; prints one line in the
format of ``python -m conflux_jax.bench host-time``). Rounds against the current code run
this and ``python -m conflux_jax.bench host-time --modes ahead`` in turn.

Shims give the old code what the benchmark calls and it did not have yet:
``Tokenizer.word_level``, ``JaxExecutor.compiled_step`` and ``JaxExecutor.device_inputs``
(its inputs went to the devices unpacked, as its own ``_run`` sent them), and an engine
built without the ``async_scheduling`` and ``plan_ahead`` options it did not know.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
HERE = Path(__file__).resolve().parents[1]


def main() -> None:
    old = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(old))
    import tokenizers

    import conflux_jax
    if not conflux_jax.__file__.startswith(str(old)):
        raise SystemExit(f"conflux_jax came from {conflux_jax.__file__}, not {old}")
    from conflux_jax.executor.batch import StepBatch
    from conflux_jax.executor.jax_executor import JaxExecutor
    from conflux_jax.tokenizer import Tokenizer

    def word_level(cls, vocab_size, eos_token_ids=(2,)):  # noqa: ANN001, ANN202
        backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
            {f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
        backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
        return cls(backend, eos_token_ids=eos_token_ids)

    def compiled_step(self, shape):  # noqa: ANN001, ANN202
        rows = StepBatch.sample_rows(shape, self.layout)
        if shape not in self._compiled or rows not in self._samplers:
            self.compile_shape(shape)
        return self._compiled[shape], self._samplers[rows]

    def device_inputs(self, host):  # noqa: ANN001, ANN202
        return types.SimpleNamespace(forward=self._put_forward(host),
                                     sample=self._put(host.sample, self._shardings.sample))

    Tokenizer.word_level = classmethod(word_level)
    JaxExecutor.compiled_step = compiled_step
    JaxExecutor.device_inputs = device_inputs

    # Today's benchmark files, run against the old package.
    def load(name: str, module: str) -> types.ModuleType:
        spec = importlib.util.spec_from_file_location(
            module, HERE / "conflux_jax" / "bench" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        return mod

    load("replay", "conflux_jax.bench.replay")
    ht = load("host_time", "host_time_now")
    from conflux_jax.engine import Engine, EngineConfig
    from conflux_jax.executor.buckets import BucketConfig
    from conflux_jax.executor.jax_executor import ExecutorConfig
    from conflux_jax.executor.mesh import MeshSpec
    from conflux_jax.models.decoder import random_params

    def build_engine(decodes, mesh, max_model_len, *_):  # noqa: ANN001, ANN202
        n = MeshSpec.parse(mesh).sp
        per_rank = -(-decodes // n)
        pages = per_rank * (-(-max_model_len // 16)) + 64
        ec = ExecutorConfig(mesh=mesh, page_size=16, num_pages=pages,
                            max_model_len=max_model_len,
                            buckets=BucketConfig(tokens=(per_rank, 4 * per_rank),
                                                 decode=(per_rank,), transfer=(64,),
                                                 max_prefill_seqs=8))
        engine = Engine(ht.MODEL, random_params(ht.MODEL, seed=0),
                        Tokenizer.word_level(ht.MODEL.vocab_size),
                        EngineConfig(executor=ec, calibrate=False,
                                     enable_prefix_caching=False))
        engine.warmup(progress=False)
        engine.executor.guard.serving = True
        return engine

    ht.build_engine = build_engine
    r = ht.measure(mode="sync")
    print(f"{r['decodes']} resident decodes on {r['mesh']}, before (dbe0529): iteration "
          f"{r['step_ms']:.2f} ms, device {r['device_ms']:.2f} ms, host {r['host_ms']:.2f} ms "
          f"({100 * r['host_share']:.0f}% of the iteration)")


if __name__ == "__main__":
    main()
