"""Grammar masks and penalties through the engine on the Conflux executor (4 simulated
devices). Oracles: jsonschema, a fresh llguidance matcher, numpy penalties over the
executor's raw logits."""

import json
import sys
from pathlib import Path

import jax
import jsonschema
import numpy as np
import pytest
from test_sampling import np_penalize

sys.path.insert(0, str(Path(__file__).resolve().parent / "checkpoints"))
from ckpt_helpers import tiny_llama, train_tiny_tokenizer  # noqa: E402

from conflux_jax.engine import Engine, EngineConfig, EngineError  # noqa: E402
from conflux_jax.executor.buckets import BucketConfig  # noqa: E402
from conflux_jax.executor.jax_executor import ExecutorConfig  # noqa: E402
from conflux_jax.grammar import GrammarCompiler  # noqa: E402
from conflux_jax.models.decoder import random_params  # noqa: E402
from conflux_jax.sampling import SamplingParams, StructuredOutputsParams  # noqa: E402
from conflux_jax.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")

CONFIG = tiny_llama()
PARAMS = random_params(CONFIG, seed=1, scale=0.2)
TOKENIZER = Tokenizer(train_tiny_tokenizer(), eos_token_ids=(2,))
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["xs", "tag"],
          "properties": {"xs": {"type": "array", "minItems": 6, "maxItems": 9,
                                "items": {"type": "integer", "minimum": 10, "maximum": 99}},
                         "tag": {"enum": ["left", "right"]}}}


def make_engine(num_pages: int = 128, return_logits: bool = False) -> Engine:
    ec = ExecutorConfig(mesh="sp=4,tp=1", page_size=4, num_pages=num_pages, max_model_len=128,
                        buckets=BucketConfig(tokens=(8, 32), decode=(16,), max_prefill_seqs=4),
                        return_logits=return_logits)
    return Engine(CONFIG, PARAMS, TOKENIZER, EngineConfig(executor=ec))


def test_masks_survive_preemption_and_recompute():
    engine = make_engine(num_pages=32)  # too few pages for 12 growing decodes at once
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, int(n)).tolist() for n in rng.integers(4, 12, 12)]
    so = StructuredOutputsParams(json=SCHEMA)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=60, temperature=1.0, seed=i,
                                                    structured_outputs=so)
                                     for i in range(12)])
    assert engine.scheduler.num_preemptions > 0
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    bm = engine.scheduler.blocks
    assert all(bm.free_pages(r) == bm.num_pages for r in range(bm.num_ranks))


def test_matcher_rollback_restores_the_mask_of_the_shorter_history():
    compiler = GrammarCompiler(TOKENIZER, CONFIG.vocab_size)
    so = StructuredOutputsParams(json=SCHEMA)
    tokens = TOKENIZER.encode('{"xs":[12,34,56')
    m = compiler.matcher(so)
    assert m.sync(tokens)
    assert m.sync(tokens[:3])  # the request holds fewer tokens now: roll back
    fresh = compiler.matcher(so)
    assert fresh.sync(tokens[:3])
    a, b = (np.zeros((1, compiler.words), np.int32) for _ in range(2))
    compiler.fill_masks([m], a)
    compiler.fill_masks([fresh], b)
    np.testing.assert_array_equal(a, b)
    assert not compiler.matcher(so).sync(TOKENIZER.encode("nope"))


def test_invalid_constraint_is_refused_at_admission():
    engine = make_engine()
    with pytest.raises(EngineError, match="invalid") as info:
        engine.add_request([5, 6], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    assert info.value.param == "structured_outputs"
    assert not engine.has_unfinished


def test_penalized_biased_and_min_p_tokens_follow_the_numpy_oracle():
    """Greedy rows take the argmax of numpy's bias-then-penalties over the executor's raw
    logits; the min-p row only draws tokens min-p keeps."""
    engine = make_engine(return_logits=True)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 40, 12).tolist() for _ in range(6)]  # repeats in the prompts
    bias = {int(t): float(v) for t, v in zip(rng.choice(40, 8, replace=False),
                                             rng.uniform(-4, 4, 8), strict=True)}
    params = [SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, **kw) for kw in (
        {"repetition_penalty": 1.8}, {"frequency_penalty": 1.5, "presence_penalty": -0.5},
        {"presence_penalty": 2.0, "repetition_penalty": 0.6}, {}, {"logit_bias": bias},
        {"logit_bias": bias, "frequency_penalty": 1.0})]
    params.append(SamplingParams(max_tokens=14, temperature=1.0, seed=3, min_p=0.2,
                                 ignore_eos=True))
    prompts.append(prompts[3])
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    outputs: dict[int, list[int]] = {rid: [] for rid in ids}
    checked = 0
    while engine.has_unfinished:
        for out in engine.step():
            rid, sp = out.request_id, params[ids.index(out.request_id)]
            logits = np.asarray(engine.executor.last_logits[rid], np.float64)
            token = out.new_token_ids[0]
            if sp.min_p:
                assert logits[token] >= logits.max() + np.log(sp.min_p) - 1e-4
            else:
                biased = logits.copy()
                for t, v in (sp.logit_bias or {}).items():
                    biased[t] += v
                want = np_penalize(biased, prompts[ids.index(rid)], outputs[rid],
                                   sp.presence_penalty, sp.frequency_penalty,
                                   sp.repetition_penalty)
                # Ties within float32 rounding of the adjusted logits may go either way.
                assert want[token] >= want.max() - 1e-4
            outputs[rid] += out.new_token_ids
            checked += 1
    assert checked == 7 * 14
    # The penalties and the bias did act: those runs differ from the free one's path.
    free = outputs[ids[3]]
    assert all(outputs[ids[i]] != free for i in (0, 1, 2, 4, 5))


def test_grammar_masks_are_filled_while_the_forward_runs():
    """The executor dispatches the forward, then asks the engine for the step's masks, then
    samples under them (vLLM's bitmask/forward overlap); a step with no constrained row
    asks for nothing. The constrained output still parses."""
    engine = make_engine()
    ex, events = engine.executor, []

    class Recording(dict):
        def __init__(self, compiled, tag):
            super().__init__(compiled)
            self.tag = tag

        def __getitem__(self, key):
            run = super().__getitem__(key)

            def recorded(*args):
                events.append(self.tag)
                return run(*args)
            return recorded

    ex.warmup(progress=False)
    ex._compiled, ex._samplers = Recording(ex._compiled, "forward"), \
        Recording(ex._samplers, "sample")
    prepare = engine._prepare

    def recorded_prepare(plan):
        events.append("prepare")
        return prepare(plan)

    engine._prepare = recorded_prepare
    so = StructuredOutputsParams(json=SCHEMA)
    out = engine.generate([[5, 6, 7]], [SamplingParams(max_tokens=60, temperature=1.0,
                                                       seed=3, structured_outputs=so)])[0]
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    steps = [events[i:i + 3] for i in range(0, len(events), 3)]
    assert len(steps) > 3 and all(s == ["forward", "prepare", "sample"] for s in steps)
    events.clear()
    engine.generate([[5, 6, 7]], [SamplingParams(max_tokens=4, ignore_eos=True)])
    assert events == ["forward", "sample"] * 4
