"""Request and response schemas of the HTTP API (pydantic): SGLang's native /generate and OpenAI's
/v1/completions, /v1/chat/completions, /v1/responses (its request; openai/responses/api.py builds the reply),
/v1/models, and SGLang's /tokenize and /detokenize.

Requests validate in strict mode: a string where a number belongs is a 400 naming the field, not a
silent conversion. The sampling fields of the OpenAI requests (`OpenAISampling`) are the exception: the
model takes any JSON value for them and the schema says their types, since the request's one check types
them (`SamplingParams.validate`, with the table every route shares, core/field_types.py). A JSON `null` means "the default" for every field (OpenAI clients send
`"top_p": null`). OpenAI requests ignore fields they do not know (clients add vendor fields); the
native request rejects them, so a misspelt `return_logprobs` is reported instead of ignored.
Beyond OpenAI's fields, OpenAI requests take SGLang's extras: regex, json_schema, ebnf, ignore_eos,
no_stop_trim, skip_special_tokens, stop_token_ids, stop_regex, min_tokens, top_k, min_p, repetition_penalty, rid,
and chat requests vLLM's and SGLang's continue_final_message and add_generation_prompt. Tool calling
(tools, tool_choice, tool_calls, tool messages) follows OpenAI's shapes.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, WithJsonSchema, model_validator
from pydantic.json_schema import SkipJsonSchema

from jaxserve.core.sampling_params import SEED_MAX, SEED_MIN


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


# ---- native (SGLang) ----------------------------------------------------------------------------
class GenerateRequest(_Request):
    """POST /generate. One prompt (`text` or `input_ids`) or a batch (a list of them); per-prompt
    `sampling_params`, `rid`, `return_logprob`, `top_logprobs_num`, `logprob_start_len` and
    `token_ids_logprob` (a list of id lists), `cache_salt`, `extra_key` and `lora_path` may be lists of
    the same length. These are the IMPLEMENTED rows of
    `sglang_fields.REQUEST_FIELDS`; the handler drops SGLang's other accepted fields before this
    model sees the body."""

    model_config = ConfigDict(strict=True, extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    top_logprobs_num: int | list[int] = 0
    logprob_start_len: int | list[int] = -1
    return_text_in_logprobs: bool = False
    token_ids_logprob: list[int] | list[list[int]] | None = None
    cache_salt: str | list[str] | None = None
    return_prompt_token_ids: bool = False
    log_metrics: bool = True
    # SGLang's: the reply reasons first, so under --reasoning-parser a grammar applies after </think>
    require_reasoning: bool = False
    extra_key: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None
    rid: str | list[str] | None = None


class LoadLoRAAdapterRequest(_Request):
    """POST /load_lora_adapter (SGLang's LoadLoRAAdapterReqInput; `lora_id` is SGLang-internal, ignored)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False
    lora_id: str | None = None


class UnloadLoRAAdapterRequest(_Request):
    """POST /unload_lora_adapter (SGLang's UnloadLoRAAdapterReqInput)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_id: str | None = None


class LoRAUpdateOutput(BaseModel):
    """The reply of both (SGLang's): `loaded_adapters` maps each loaded adapter's name to its path."""

    success: bool
    error_message: str = ""
    loaded_adapters: dict[str, str] | None = None


class MetaInfo(BaseModel):
    """SGLang's meta_info, as the OpenAPI document describes it (openapi.py); the body itself is built by
    the engine's one builder, `engine.outputs.meta_info`. Lengths in tokens, latency in seconds. Logprobs are
    `[logprob, token_id, token_text or null]` triples (top: a list of them per output token).

    The logprob keys are those of SGLang 0.5.23 (`TokenizerManager.add_logprob_to_meta_info`): with
    logprobs asked for, `input_token_logprobs`, `output_token_logprobs` and
    `output_token_logprobs_length`; with `top_logprobs_num` > 0 also `input_top_logprobs` and
    `output_top_logprobs`; with `token_ids_logprob` also `input_token_ids_logprobs` and
    `output_token_ids_logprobs`. The `input_*` lists are empty without prompt positions
    (`logprob_start_len` -1 or the prompt's length). Keys that do not apply are left out."""

    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict[str, Any] | None
    e2e_latency: float
    # by tier: {"device", "host"} (+ "storage", "storage_backend" with a storage tier); null: none cached
    cached_tokens_details: dict[str, Any] | None = None
    output_token_logprobs: list[list[Any]] | None = None
    output_top_logprobs: list[list[list[Any]]] | None = None
    output_token_logprobs_length: int | None = None
    input_token_logprobs: list[list[Any]] | None = None  # from logprob_start_len on; the first may be null
    # per prompt position from logprob_start_len on: null where input_token_logprobs is null, else triples
    input_top_logprobs: list[list[list[Any]] | None] | None = None
    input_token_ids_logprobs: list[list[list[Any]] | None] | None = None
    output_token_ids_logprobs: list[list[list[Any]]] | None = None  # per output token, one triple per token_ids_logprob id


class GenerateOutput(BaseModel):
    """One sequence of a /generate response. In a stream, `text` and `output_ids` are cumulative and
    `index` says which sequence of a batch (or of n) the event belongs to."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = None


# ---- OpenAI: requests ---------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


def _checked_later(json_type: Any) -> Any:
    """A sampling field that takes any JSON value, its schema `json_type`'s: the request's one check
    (`SamplingParams.validate`) refuses a wrong type, worded as on every route."""
    return Annotated[Any, WithJsonSchema(TypeAdapter(json_type).json_schema())]


class OpenAISampling(_Request):
    """Fields shared by completions and chat completions. `max_completion_tokens` is OpenAI's newer
    name of `max_tokens`; given both, the smaller one applies. `logit_bias` maps token ids (as
    strings) to a bias in [-100, 100] added to their logits, at most 300 entries."""

    model: str | None = None
    max_tokens: _checked_later(int | None) = None
    max_completion_tokens: _checked_later(int | None) = None
    temperature: _checked_later(float | None) = None
    top_p: _checked_later(float | None) = None
    top_k: _checked_later(int | None) = None
    min_p: _checked_later(float | None) = None
    frequency_penalty: _checked_later(float | None) = None
    presence_penalty: _checked_later(float | None) = None
    repetition_penalty: _checked_later(float | None) = None
    n: _checked_later(int) = 1
    stop: _checked_later(str | list[str] | None) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # the range is checked by the engine (`check_seed`, core/sampling_params.py: a 400 naming seed); the schema says it
    seed: _checked_later(int | None) = Field(None, json_schema_extra={"minimum": SEED_MIN, "maximum": SEED_MAX})
    user: str | None = None
    logit_bias: dict[str, float | int] | None = None
    response_format: ResponseFormat | None = None
    # SGLang's extra sampling fields
    regex: _checked_later(str | None) = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: _checked_later(str | None) = None
    ignore_eos: _checked_later(bool | None) = None
    no_stop_trim: _checked_later(bool | None) = None
    skip_special_tokens: _checked_later(bool | None) = None
    stop_token_ids: _checked_later(list[int] | None) = None
    stop_regex: _checked_later(str | list[str] | None) = None
    min_tokens: _checked_later(int | None) = None
    rid: str | None = None
    # SGLang's: a loaded LoRA adapter (one, or one per prompt); `model: "<served>:<adapter>"` wins over it
    lora_path: str | list[str | None] | None = None


class CompletionRequest(OpenAISampling):
    """POST /v1/completions. `prompt`: a text, a list of texts, token ids, or a list of those.
    `max_tokens` defaults to 16 (OpenAI's default), cut to what the context leaves."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None  # accepted only equal to n (`openai/checks.check_best_of`)


class ContentPart(_Request):
    # the schema says what is served (text parts); validation stays in chat_prompt, which names the field
    model_config = ConfigDict(json_schema_extra={"required": ["type", "text"]})

    type: str = Field(json_schema_extra={"enum": ["text"]})
    text: str | None = None


class FunctionCallIn(_Request):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire format)


class ToolCallIn(_Request):
    """A tool call of an earlier assistant turn, sent back by the client."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    # /openapi.json: content is required except on an assistant message with tool_calls (what
    # openai/checks.py checks, naming messages[i].content); a null content is not documented
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["content"]},
        {"required": ["tool_calls"],
         "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}}},
    ]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | SkipJsonSchema[None] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(OpenAISampling):
    """POST /v1/chat/completions. Without max_tokens / max_completion_tokens the reply may use the
    rest of the context.

    Tool calling: `tools` (function definitions), `tool_choice` ("none", "auto" (the default with
    tools), "required" or {"type": "function", "function": {"name": ...}}). Assistant prefill (vLLM's
    and SGLang's extensions): `continue_final_message` continues the last (assistant) message instead
    of closing it; `add_generation_prompt` (default true) opens a new assistant turn;
    `chat_template_kwargs` are extra variables of the chat template. With `--reasoning-parser`,
    `separate_reasoning` (SGLang's, default true) moves the reasoning into `reasoning_content`;
    `stream_reasoning` (SGLang's, default true) false streams it in one piece once it ends.
    """

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    # SGLang's and vLLM's: extra variables of the chat template (Qwen3's enable_thinking, ...)
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's: with --reasoning-parser, false leaves the reasoning in content
    separate_reasoning: bool = True
    # SGLang's: with --reasoning-parser and stream, false sends the reasoning in one
    # delta.reasoning_content once it ends instead of as it is decoded (server/openai/reasoning.py)
    stream_reasoning: bool = True
    # not a chat field (OpenAI refuses it); kept only to answer with a 400 that names it, and out of
    # /openapi.json, which documents what the route accepts
    best_of: SkipJsonSchema[Any] = None


# ---- SGLang's tokenization routes ---------------------------------------------------------------
class TokenizeRequest(_Request):
    """POST /tokenize and /v1/tokenize (SGLang 0.5.23's TokenizeRequest): exactly one of `prompt` (a
    text, or a list of texts) and `messages`. `add_special_tokens` (default true) applies to `prompt`.
    `messages` are rendered with `tools`, `tool_choice`, `continue_final_message` and
    `chat_template_kwargs` as /v1/chat/completions renders them (the body's other chat fields are read
    as that route reads them); `add_generation_prompt` given (true or false) is passed to the template
    and the rendered text is then encoded with `add_special_tokens` only when the request sets it
    (SGLang's rule), omitted the template's text is encoded as a chat's is, without adding any."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool | None = None


class TokenizeResponse(BaseModel):
    """A text's token ids and their count, or per text of a list (lists of both); `max_model_len` as
    SGLang reports it: the tokenizer's `model_max_length`, or the served context length where the
    tokenizer has none (transformers' placeholder 1e30)."""

    tokens: list[int] | list[list[int]]
    count: int | list[int]
    max_model_len: int


class DetokenizeRequest(_Request):
    """POST /detokenize and /v1/detokenize (SGLang 0.5.23's DetokenizeRequest): `tokens`, a list of
    token ids (one text back) or a list of such lists (a text per list); every id in the tokenizer's
    vocabulary. `skip_special_tokens` (default true) leaves special tokens out of the text."""

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class DetokenizeResponse(BaseModel):
    text: str | list[str]


# ---- OpenAI Responses API: requests -------------------------------------------------------------
class ResponseInputText(_Request):
    """A text part of an input message: `input_text` (user, system, developer) or `output_text` (an
    earlier assistant turn sent back; its annotations are ignored)."""

    type: Literal["input_text", "output_text"]
    text: str


class ResponseInputMessage(_Request):
    """A message of `input` (OpenAI's EasyInputMessage, or an output message of an earlier response)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponseInputText]
    id: str | None = None  # an item sent back keeps its id (GET .../input_items lists it)


class ResponseInputReasoning(_Request):
    """A reasoning item of an earlier response sent back as input: accepted and left out of the prompt,
    as chat templates leave out earlier turns' reasoning."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)  # kept for GET .../input_items only


class ResponseFunctionCallInput(_Request):
    """A function call of an earlier reply, sent back (an `output` item of type function_call)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    id: str | None = None


class ResponseFunctionCallOutput(_Request):
    """The result of the function call `call_id`, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None


class ResponseFunctionTool(_Request):
    """A function the model may call (the Responses API's flat form of a chat `tools` entry)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ResponseNamedFunction(_Request):
    type: Literal["function"]
    name: str


class ResponseTextFormat(_Request):
    """`text.format`: plain text, any JSON object, or JSON that matches `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseTextConfig(_Request):
    format: ResponseTextFormat | None = None


class ResponsesRequest(_Request):
    """POST /v1/responses: OpenAI's Responses API over the chat path. `input` is a text (one user
    message) or a list of messages; `instructions` becomes a system message first (not carried over
    to a response that continues this one through `previous_response_id`, as OpenAI documents);
    `max_output_tokens` bounds the reply (default: the rest of the context); `text.format` constrains
    it to JSON; `tools` are function tools, called as in chat completions (`tool_choice` "required" or
    named forces a call under a grammar), their calls sent back as function_call items and their
    results as function_call_output items; `store` (default true) keeps the response for
    GET /v1/responses/{id} and for `previous_response_id`; `background` (with `store`, not streamed)
    returns at once, status "queued", and runs on (poll GET, stop with POST .../cancel); `include`
    takes "message.output_text.logprobs" (not streamed; `top_logprobs` alternatives per token); the
    sampling extras are SGLang's fields of the same request."""

    model: str | None = None
    input: str | list[ResponseInputMessage | ResponseInputReasoning | ResponseFunctionCallInput | ResponseFunctionCallOutput]
    instructions: str | None = None
    max_output_tokens: _checked_later(int | None) = None
    temperature: _checked_later(float | None) = None
    top_p: _checked_later(float | None) = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    text: ResponseTextConfig | None = None
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedFunction | None = None
    parallel_tool_calls: bool = True
    background: bool = False
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    user: str | None = None
    # SGLang's extra sampling fields of its ResponsesRequest
    top_k: _checked_later(int | None) = None
    min_p: _checked_later(float | None) = None
    frequency_penalty: _checked_later(float | None) = None
    presence_penalty: _checked_later(float | None) = None
    repetition_penalty: _checked_later(float | None) = None
    stop: _checked_later(str | list[str] | None) = None
    seed: _checked_later(int | None) = Field(None, json_schema_extra={"minimum": SEED_MIN, "maximum": SEED_MAX})
    request_id: str | None = None


# ---- OpenAI: responses --------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists over output tokens."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None  # a JSON object as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(BaseModel):
    """A piece of a streamed tool call: the first has `id`, `type` and the name, later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # SGLang's field, with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's card: the served model it adapts
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
