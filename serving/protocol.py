"""OpenAI request/response schemas (the subset we serve) and their mapping to SamplingParams.

Requests are validated strictly enough that nothing a client sends can reach the engine
in a shape it rejects with an exception we did not anticipate: every bound the engine or
``SamplingParams`` enforces is mirrored here, so bad input is a 400, never a 500.

Nothing is silently ignored: every field of OpenAI's and vLLM's request schemas either has
its effect, is a documented no-op (``NO_OP_FIELDS``), or is declared ``_refused``: its
neutral value is accepted and any other is a 400 naming it. An unknown field is a 400
naming it too (README, "Request fields").
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from conflux_jax.sampling import (
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
    StructuredOutputsParams,
)

MAX_N = 16  # choices per request (each one a sequence of its own in the engine)
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
# A seed is folded into 32 bits by the engine; bounding it keeps the JSON schema finite.
SeedInt = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
# Accepted and without effect here (README, "Request fields"): identifiers and hints that
# only mean something to OpenAI's own platform.
NO_OP_FIELDS = ("user", "metadata", "safety_identifier", "prompt_cache_key", "service_tier",
                "store", "priority", "guided_decoding_backend")


def _refused(reason: str, *neutral: Any) -> Any:
    """A field this server does not implement: absent, null or one of ``neutral`` (the
    value that asks for nothing) is accepted; anything else is a 400 naming it."""

    def check(value: Any) -> Any:
        if value is None or any(value == n and type(value) is type(n) for n in neutral):
            return value
        raise ValueError(f"not supported: {reason}")

    return Annotated[Any, AfterValidator(check)]


def _ill_formed(value: Any, path: str) -> str | None:
    """Where in ``value`` the first string that is not well-formed Unicode sits (a lone
    surrogate: JSON's ``"\\ud800"`` escapes decode to one), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items: Any = value.items()
        for key in value:
            if isinstance(key, str) and _ill_formed(key, "") is not None:
                return f"{path}.<key>" if path else "<key>"
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for name, item in items:
        bad = _ill_formed(item, f"{path}.{name}" if path else str(name))
        if bad is not None:
            return bad
    return None


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class RequestFieldError(ValueError):
    """A request field the server refuses (a 400 that names ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaSpec(BaseModel):
    """``response_format.json_schema``. ``strict`` (OpenAI's): every schema keyword is
    enforced or the request is refused; without it, keywords the grammar engine does not
    implement are ignored. The mask enforces the schema either way."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` extension: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat (OpenAI names plus vLLM's extensions)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)  # -1 or 0 = off (vLLM)
    seed: SeedInt | None = None
    stop: str | list[Annotated[str, Field(max_length=MAX_STOP_LEN)]] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    # Booleans are strict, as OpenAI's are: "yes" or 1 is a 400, not true.
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0, allow_inf_nan=False)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* names. At most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM's sampling extras that have their effect.
    min_tokens: int = Field(default=0, ge=0, le=2**31 - 1)
    # OpenAI's logit_bias: token id -> value in [-100, 100], added to the logit.
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1,
                                                    max_length=1 << 17)
    skip_special_tokens: StrictBool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    request_id: str | None = Field(default=None, max_length=128,
                                   pattern=r"^[A-Za-z0-9._:-]+$")
    # Documented no-ops (NO_OP_FIELDS).
    user: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching here needs no key
    service_tier: _refused("this server has one service tier", "auto", "default") = None
    store: _refused("this server stores no completions", False) = None
    priority: _refused("requests are ordered by their SLOs, not a priority", 0) = None
    guided_decoding_backend: _refused("the grammar engine is llguidance", "auto",
                                      "guidance", "llguidance") = None
    # Refused unless neutral: what a client asks for here would not happen.
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    use_beam_search: _refused("beam search", False) = None
    length_penalty: _refused("length_penalty needs beam search", 1, 1.0) = None
    spaces_between_special_tokens: _refused(
        "special tokens are always decoded without added spaces", True) = None
    prompt_logprobs: _refused("prompt logprobs are not computed") = None
    bad_words: _refused("bad_words (ban token ids with logit_bias -100)", []) = None
    logits_processors: _refused("custom logits processors") = None
    return_tokens_as_token_ids: _refused("tokens are returned as text", False) = None
    return_token_ids: StrictBool = False  # the prompt's and each choice's token ids
    # vLLM's tenant isolation: prompts share cached KV only with the same salt.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    kv_transfer_params: _refused("external KV transfer") = None
    vllm_xargs: _refused("vllm_xargs") = None
    guided_whitespace_pattern: _refused("JSON is always generated compact") = None
    # Per-request SLO extension (milliseconds), honoured by the scheduler.
    ttft_slo_ms: float | None = Field(default=None, gt=0.0, le=1e9, allow_inf_nan=False)
    tbt_slo_ms: float | None = Field(default=None, gt=0.0, le=1e9, allow_inf_nan=False)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, str) and len(v) > MAX_STOP_LEN:
            raise ValueError(f"a stop string may be at most {MAX_STOP_LEN} characters")
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not key.isdigit() or int(key) > 2**31 - 1:
                raise ValueError(f"keys are token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"values are in [-100, 100], got {value} for token {key}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise RequestFieldError("stream_options needs stream=true", "stream_options")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestFieldError("best_of other than n is not supported (choices are "
                                    "not ranked)", "best_of")
        return self

    @model_validator(mode="before")
    @classmethod
    def _well_formed_text(cls, data: Any) -> Any:
        # Before the fields: the tokenizer raises TypeError on a lone surrogate, and a
        # typed field's own error would not say what is wrong. Refuse it as a 400 here.
        bad = _ill_formed(data, "")
        if bad is not None:
            raise ValueError(f"{bad} is not well-formed Unicode text (it holds a lone "
                             "surrogate)")
        return data

    def structured(self) -> StructuredOutputsParams | None:
        """The one output constraint the request asks for, or None.

        Raises :class:`RequestFieldError` when it asks for more than one or one is invalid.
        """
        found: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            spec = rf.json_schema
            assert spec is not None
            found.append(("response_format", {"json": spec.schema_ or {},
                                              "strict": spec.strict is not False}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given = {k: v for k, v in (("json", so.json_), ("regex", so.regex),
                                       ("choice", so.choice), ("grammar", so.grammar),
                                       ("json_object", so.json_object)) if v is not None}
            found.append(("structured_outputs", given))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if (value := getattr(self, name)) is not None:
                found.append((name, {key: value}))
        if not found:
            return None
        if len(found) > 1:
            names = ", ".join(n for n, _ in found)
            raise RequestFieldError(f"give at most one output constraint (got {names})",
                                    found[1][0])
        name, kwargs = found[0]
        try:
            return StructuredOutputsParams(**kwargs)
        except ValueError as exc:
            raise RequestFieldError(f"{name}: {exc}", name) from None

    # Used when the client sends no max_tokens: None = no cap (chat); completions say 16.
    default_max_tokens: ClassVar[int | None] = None

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives asked for per token; None = no logprobs at all."""
        return None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` is text or token ids (one prompt only)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False  # the prompt's text leads the output
    suffix: str | None = None
    add_special_tokens: StrictBool = True  # e.g. a BOS before a text prompt

    default_max_tokens: ClassVar[int | None] = 16

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt "
                                 "per request")
            v = v[0]
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("the prompt is empty")
        return v

    @model_validator(mode="after")
    def _echo_alone(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise RequestFieldError("echo with logprobs needs the prompt's logprobs, which "
                                    "this server does not compute", "echo")
        return self

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as OpenAI returns it


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, sent back in the conversation."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDefinition(BaseModel):
    """One entry of ``tools``: only function tools exist here (OpenAI's ``custom`` tools
    take free text, which no served model was trained to call)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers
    refusal: str | None = None  # an assistant turn's refusal, rendered as its text

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        """Content as plain text: OpenAI's list-of-parts form keeps only text parts."""
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    add_generation_prompt: StrictBool = True
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM's chat extras.
    continue_final_message: StrictBool = False  # extend the last (assistant) message
    add_special_tokens: StrictBool = False  # the template places BOS itself
    documents: list[dict[str, str]] | None = None  # for templates that read them (RAG)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. Qwen3's enable_thinking
    chat_template: _refused("per-request chat templates (start the server with "
                            "--chat-template)") = None
    mm_processor_kwargs: _refused("multimodal inputs") = None
    echo: _refused("echo on chat", False) = None
    # OpenAI fields for what this server does not do.
    audio: _refused("audio output") = None
    modalities: _refused("output modalities other than text", ["text"]) = None
    functions: _refused("the deprecated functions (use tools)") = None
    function_call: _refused("the deprecated function_call (use tool_choice)") = None
    prediction: _refused("predicted outputs") = None
    reasoning_effort: _refused("reasoning effort (no served model reasons on request)") = None
    verbosity: _refused("verbosity") = None
    web_search_options: _refused("web search") = None
    moderation: _refused("moderation") = None
    prompt_cache_options: _refused("prompt cache options") = None
    prompt_cache_retention: _refused("prompt cache retention") = None

    @model_validator(mode="after")
    def _chat_consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestFieldError("top_logprobs needs logprobs=true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestFieldError("continue_final_message needs add_generation_prompt="
                                    "false", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise RequestFieldError("continue_final_message continues an assistant message: "
                                    "the last message must be one", "continue_final_message")
        reserved = {"messages", "tools", "add_generation_prompt", "documents"}
        if self.chat_template_kwargs and reserved & set(self.chat_template_kwargs):
            raise RequestFieldError(f"chat_template_kwargs may not set "
                                    f"{sorted(reserved & set(self.chat_template_kwargs))}",
                                    "chat_template_kwargs")
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


GenerationRequest = CompletionRequest | ChatCompletionRequest


class TokenizeCompletionRequest(BaseModel):
    """vLLM's ``POST /tokenize`` with a text prompt."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(BaseModel):
    """vLLM's ``POST /tokenize`` with messages: the prompt the chat route would build."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


def to_sampling_params(req: GenerationRequest) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``req``. Reads the request, never writes it: the
    parsed body stays what the client sent. ``SamplingParams`` may raise ValueError."""
    max_tokens = req.effective_max_tokens
    structured = req.structured()
    return SamplingParams(
        max_tokens=req.default_max_tokens if max_tokens is None else max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k if req.top_k is not None and req.top_k > 0 else 0,
        min_p=req.min_p or 0.0, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, logprobs=req.num_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output, n=req.n,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        structured_outputs=structured, min_tokens=req.min_tokens,
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        allowed_token_ids=req.allowed_token_ids, skip_special_tokens=req.skip_special_tokens)


# ---------------------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "conflux_jax"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
