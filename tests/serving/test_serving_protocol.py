"""Request -> SamplingParams: a pure mapping (the parsed request is left as it was sent)."""

from __future__ import annotations

import pytest

from serving.protocol import ChatCompletionRequest, CompletionRequest, to_sampling_params

COMMON = {"model": "tiny", "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 7,
          "stop": ["\n", "END"], "stop_token_ids": [2, 3], "ignore_eos": True,
          "include_stop_str_in_output": True}


def _unchanged_after_mapping(req):
    before = req.model_dump()
    sp = to_sampling_params(req)
    assert req.model_dump() == before
    return sp


def test_completion_request_maps_without_being_changed():
    req = CompletionRequest.model_validate({**COMMON, "prompt": "hi", "max_tokens": 9,
                                            "logprobs": 3})
    sp = _unchanged_after_mapping(req)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (9, 0.7, 0.9, 40, 7)
    assert sp.stop == ("\n", "END") and sp.stop_token_ids == (2, 3)
    assert sp.ignore_eos and sp.include_stop_str_in_output and sp.logprobs == 3


def test_chat_max_completion_tokens_wins_and_max_tokens_stays_as_sent():
    # The old helper wrote max_completion_tokens into the request's max_tokens.
    req = ChatCompletionRequest.model_validate({
        **COMMON, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50,
        "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2})
    sp = _unchanged_after_mapping(req)
    assert req.max_tokens == 50 and sp.max_tokens == 5
    assert sp.logprobs == 2 and sp.stop == ("\n", "END") and sp.seed == 7


@pytest.mark.parametrize("req, max_tokens, logprobs", [
    (CompletionRequest(model="m", prompt="x"), 16, None),  # OpenAI's legacy default
    (ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}]), None,
     None),
    (ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                           logprobs=True), None, 0),
])
def test_defaults(req, max_tokens, logprobs):
    sp = _unchanged_after_mapping(req)
    assert (sp.max_tokens, sp.logprobs) == (max_tokens, logprobs)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.stop) == (1.0, 1.0, 0, None, None)


def test_top_k_minus_one_means_off():
    sp = _unchanged_after_mapping(CompletionRequest(model="m", prompt="x", top_k=-1))
    assert sp.top_k == 0
