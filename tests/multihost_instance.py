"""A test instance and its workload, in one process or as one process of several.

Imported, it gives the engine set-up and the mixed workload that ``test_multihost.py``
runs in the test's own (single-process, four-device) session. Run as a script, it is one
process of a two-process instance with two CPU devices each:

    python tests/multihost_instance.py PROCESS_ID PORT OUT_JSON MODE

Process 0, by MODE:
- ``mixed``: runs the workload, writes its tokens to OUT_JSON, then keeps generating
  until the instance fails (the test kills process 1 meanwhile); it then prints the error
  and exits with status 3 (0 never: the instance must not outlive a dead process);
- ``idle``: builds the engine and stops the instance at once (a clean stop); a step
  asked for afterwards is refused (printed), not run.
Process 1 follows, printing one JSON line per step it ran (what the batch held), and
exits with status 0 when process 0 stops the instance.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

if __name__ == "__main__":  # before jax is imported: two host devices per process
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tiny_models

import numpy as np
from tiny_models import TINY_LLAMA

from conflux_jax.executor.buckets import BucketConfig
from conflux_jax.executor.jax_executor import ExecutorConfig
from conflux_jax.models.decoder import random_params

PARAMS = random_params(TINY_LLAMA, seed=1, scale=0.2)
# Three step shapes: decode only, prefill, prefill + KV transfer (few compiles).
EXECUTOR = ExecutorConfig(mesh="sp=4,tp=1", page_size=4, num_pages=64, max_model_len=32,
                          buckets=BucketConfig(tokens=(32,), decode=(4,), transfer=(4,),
                                               max_prefill_seqs=4))
# (prompt length, new tokens) per request, in waves: the second wave's prompts prefill
# (and move their KV to their decode ranks) while the first wave decodes.
WAVES = (((9, 6),), ((20, 5), (5, 4)))
STEPS_BETWEEN_WAVES = 2


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, 256, n).tolist() for wave in WAVES for n, _ in wave]


def budgets() -> list[int]:
    return [m for wave in WAVES for _, m in wave]


def word_tokenizer():
    """Token i <-> word "w{i}"; EOS is token 2."""
    from conflux_jax.tokenizer import Tokenizer

    return Tokenizer.word_level(TINY_LLAMA.vocab_size)


def make_engine():
    from conflux_jax.engine import Engine, EngineConfig

    return Engine(TINY_LLAMA, PARAMS, word_tokenizer(), EngineConfig(executor=EXECUTOR))


def run_mixed(engine) -> list[list[int]]:
    """Greedy tokens of every request of ``WAVES``, in request order."""
    from conflux_jax.sampling import SamplingParams

    all_prompts, all_budgets = prompts(), budgets()
    tokens: dict[int, list[int]] = {}
    order: list[int] = []
    i = 0
    for w, wave in enumerate(WAVES):
        for _ in wave:
            sp = SamplingParams(max_tokens=all_budgets[i], temperature=0, ignore_eos=True)
            rid = engine.add_request(all_prompts[i], sp)
            order.append(rid)
            tokens[rid] = []
            i += 1
        steps = STEPS_BETWEEN_WAVES if w + 1 < len(WAVES) else None
        while engine.has_unfinished and (steps is None or steps > 0):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            steps = None if steps is None else steps - 1
    return [tokens[rid] for rid in order]


def _endless(engine) -> None:
    from conflux_jax.sampling import SamplingParams

    prompt = prompts()[0]
    while True:
        engine.generate([prompt], [SamplingParams(max_tokens=20, temperature=0,
                                                  ignore_eos=True)])


def _write(path: str, value: object) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)  # whole or absent: the test polls for it


def main(process_id: int, port: int, out_path: str, mode: str) -> int:
    from conflux_jax.executor.distributed import DistributedConfig, exit_now, initialize
    from conflux_jax.plan import ExecutorLost

    initialize(DistributedConfig(2, process_id, f"127.0.0.1:{port}", init_timeout_s=60))
    if process_id == 0:
        engine = make_engine()
        if mode == "idle":
            engine.executor.close()
            try:  # a stopped instance refuses steps: nobody would join their collectives
                run_mixed(engine)
            except ExecutorLost as exc:
                print(f"refused after the stop: {exc}", flush=True)
            return 0
        try:
            _write(out_path, run_mixed(engine))
            _endless(engine)
        except ExecutorLost as exc:
            print(f"instance lost: {exc}", file=sys.stderr, flush=True)
            exit_now(3)
        return 0
    from conflux_jax.executor.jax_executor import JaxExecutor

    executor = JaxExecutor(TINY_LLAMA, PARAMS, EXECUTOR)

    def progress(shape, batch) -> None:
        print(json.dumps({"shape": dataclasses.asdict(shape),
                          "prefills": int(batch.shared.num_seqs[0]),
                          "decodes": int(batch.rank.num_decode.sum()),
                          "transfer_groups": int(batch.shared.transfer_count.sum())}),
              flush=True)

    executor.follow(on_step=progress)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]))
