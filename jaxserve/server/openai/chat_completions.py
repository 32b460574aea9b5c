"""OpenAI-compatible API: POST /v1/completions, POST /v1/chat/completions (GET /v1/models: models.py).

Sampling fields map onto the engine's `SamplingParams` as SGLang's OpenAI layer maps them
(max_tokens / max_completion_tokens -> max_new_tokens, min_tokens -> min_new_tokens,
response_format -> json_schema, SGLang's extra fields as they are); a bad value is a 400 whose
`param` uses the OpenAI name. finish_reason is "stop" (EOS, stop token, stop string), "length", or
"abort" (cancelled through /abort_request); `matched_stop` says what stopped it (SGLang's field).
Streams send `data: {chunk}` events and end with `data: [DONE]`; with
`stream_options.include_usage` the last chunk before [DONE] has empty choices and the usage.

Completions with `echo` and `logprobs` take the prompt's logprobs from the engine's prompt-logprob path
(`logprob_start_len=0`); `max_tokens: 0` then runs one token and drops it. Chat tool calling: the
tools go into the prompt (chat_prompt.py), the reply is parsed by the `--tool-call-parser` format
(tools/), and tool_choice "required" or a named function constrains decoding to that format's
grammar, so the call always parses and its arguments validate against the function's schema.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.core.errors import RequestError, SamplingParamsError
from jaxserve.core.request import finish_length
from jaxserve.core.sampling_params import MAX_N, SamplingParams
from jaxserve.core.size_limits import check_request_sizes
from jaxserve.engine.outputs import StepOutput
from jaxserve.engine.request_input import GenerateInput
from jaxserve.engine.validation.check import RequestChecker
from jaxserve.server.engine_client import RequestGroup, abort_on_disconnect, preprocess
from jaxserve.server.errors import APIError, error_body, error_response, from_engine_error, parse_json_body
from jaxserve.server.metrics import mark_streaming
from jaxserve.server.native.generate import failure_of
from jaxserve.server.openai.chat_prompt import chat_prompt
from jaxserve.server.openai.checks import (
    check_best_of,
    check_chat_messages,
    check_openai_request,
    check_tokenizer_needed,
    check_tool_messages,
)
from jaxserve.server.openai.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from jaxserve.server.openai.lora import resolve_lora_paths
from jaxserve.server.openai.reasoning import ReasoningFormat, ReasoningSplitter, grammar_think_end_ids, split_reasoning
from jaxserve.server.openai.tools.plan import ToolPlan, tool_calls_out, tool_plan
from jaxserve.server.openai.tools.streaming import CallStart, Content, StreamEvent, ToolCallStreamer, read_reply
from jaxserve.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    FunctionCall,
    OpenAISampling,
    PromptTokensDetails,
    ToolCallDelta,
    UsageInfo,
)
from jaxserve.server.sse import DONE, SSEResponse, sse_event

MAX_TOP_LOGPROBS = 20
MAX_INT32 = 2**31 - 1  # the largest max_new_tokens (core/sampling_params.py says so in its range errors)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# ---- request -> engine ----------------------------------------------------------------------------
def sampling_params_of(req: OpenAISampling, max_new_tokens: int | None, ebnf: str | None = None) -> SamplingParams:
    """The engine's sampling params of an OpenAI request, under SGLang's names (absent fields keep their
    defaults; `max_new_tokens` None: the route's default). Their types and values are checked once, by the
    request's one check (`SamplingParams.validate`; its errors renamed to this API's fields). `ebnf` is a
    grammar the API layer imposes (a forced tool call) in place of the request's. The whole reply is then the call, and its grammar ends it: `stop`,
    `stop_token_ids` and `stop_regex` are left out, as they could only cut the call short, leaving no call."""
    forced = ebnf is not None
    d = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": req.min_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty,
        "n": req.n,
        "stop": None if forced else req.stop,
        "stop_token_ids": None if forced else req.stop_token_ids,
        "stop_regex": None if forced else req.stop_regex,
        "seed": req.seed,
        "ignore_eos": req.ignore_eos,
        "no_stop_trim": req.no_stop_trim,
        "skip_special_tokens": req.skip_special_tokens,
        "regex": req.regex,
        "ebnf": ebnf if ebnf is not None else req.ebnf,
        "json_schema": _json_schema_of(req),
        "logit_bias": req.logit_bias,
    }
    return SamplingParams.from_dict({k: v for k, v in d.items() if v is not None})


def _json_schema_of(req: OpenAISampling) -> str | None:
    schema = json.dumps(req.json_schema) if isinstance(req.json_schema, dict) else req.json_schema
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return schema
    if schema is not None:
        raise APIError("give either response_format or json_schema, not both", 400, param="response_format", code="invalid_value")
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    body = fmt.json_schema or {}
    inner = body.get("schema", body.get("schema_"))
    if not isinstance(inner, dict):
        raise APIError(
            "response_format of type json_schema needs json_schema.schema (an object)",
            400, param="response_format.json_schema.schema", code="invalid_value",
        )
    return json.dumps(inner)


def max_tokens_of(req: OpenAISampling) -> tuple[int | None, str]:
    """(the requested output length or None, the field that set it): max_completion_tokens replaces
    max_tokens; given both, the smaller applies (as OpenAI documents)."""
    given = [(v, f) for v, f in ((req.max_tokens, "max_tokens"), (req.max_completion_tokens, "max_completion_tokens"))
             if v is not None]
    if not given:
        return None, "max_tokens"
    # a wrong type or an out-of-range value goes on, for the request's one check to name, even if the other
    # one is smaller
    bad = [(v, f) for v, f in given if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_INT32]
    return bad[0] if bad else min(given)


def _renames(req: OpenAISampling, prompt_field: str, max_field: str, top_field: str) -> dict[str, str]:
    """Engine field -> OpenAI field, for error messages."""
    renames = {
        "max_new_tokens": max_field,
        "min_new_tokens": "min_tokens",
        "prompt": prompt_field,
        "input_ids": prompt_field,
        "top_logprobs_num": top_field,
    }
    if req.response_format is not None and req.response_format.type != "text":
        renames["json_schema"] = "response_format"
    return renames


def _submit(group: RequestGroup, checker: RequestChecker, renames: dict[str, str], prompts: list[tuple[str | list[int], str | None]],
            req: OpenAISampling, return_logprob: bool, top_logprobs_num: int, *, max_new_tokens: int | None,
            default_max_new_tokens: int | None, add_special_tokens: bool = True, logprob_start_len: int = -1,
            ebnf: str | None = None, think_end_ids: tuple[int, ...] = (), served_model_name: str = "") -> None:
    """Check every (prompt, rid) (`checker`: the request's one check), then submit them: a bad prompt
    refuses them all before any runs. The prompt is a text or token ids, the rid None for a fresh one. `max_new_tokens` None takes the route's
    `default_max_new_tokens` (None: what the context leaves). `add_special_tokens` False: the prompt is a
    chat template's text. `think_end_ids`: the grammar applies after these tokens
    (`reasoning.grammar_think_end_ids`). The LoRA adapter of each prompt: `model`'s "<served>:<adapter>",
    else `lora_path` (`lora.resolve_lora_paths`)."""
    n = req.n if isinstance(req.n, int) and 1 <= req.n <= MAX_N else 1  # an invalid n: its submit refuses it
    try:
        loras, lora_field = resolve_lora_paths(req.model, req.lora_path, served_model_name, len(prompts))
    except ValueError as e:
        raise APIError(str(e), 400, param="lora_path", code="invalid_value") from None
    renames = {**renames, "lora_path": lora_field}
    try:
        with group.reserved(len(prompts) * n, "n" if len(prompts) == 1 else "prompt"):
            params = sampling_params_of(req, max_new_tokens, ebnf)
            checked = [checker.check(GenerateInput(
                prompt, params, rid=rid, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                logprob_start_len=logprob_start_len, think_end_ids=think_end_ids, lora_path=lora,
                add_special_tokens=add_special_tokens, default_max_new_tokens=default_max_new_tokens,
            )) for (prompt, rid), lora in zip(prompts, loras)]
            for c in checked:
                group.submit(c)
    except (SamplingParamsError, RequestError) as e:
        group.abort()
        raise from_engine_error(e, renames) from None
    except BaseException:
        group.abort()
        raise


def _tokenize(engine_loop, prompt: str | list[int], field: str, add_special_tokens: bool = True) -> list[int]:
    try:
        return engine_loop.engine.checker.tokenize(prompt, add_special_tokens)
    except RequestError as e:
        raise from_engine_error(e, {"input_ids": field, "prompt": field}) from None


# ---- engine -> response ---------------------------------------------------------------------------
def finish_reason_of(out: StepOutput) -> tuple[str | None, int | str | None]:
    """(OpenAI finish_reason, matched stop) of a finished output; (None, None) while it runs."""
    reason = out.meta.finish_reason
    if not out.finished or reason is None:
        return None, None
    return reason.kind, reason.matched


def _usage(outputs: list[StepOutput], n: int) -> UsageInfo:
    """Usage over prompts x n sequences: each prompt counted once, its cached tokens the best of its n."""
    groups = [outputs[i : i + n] for i in range(0, len(outputs), n)]
    prompt = sum(g[0].meta.prompt_tokens for g in groups)
    cached = sum(max(o.meta.cached_tokens for o in g) for g in groups)
    completion = sum(o.meta.completion_tokens for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _chunk_event(chunk: ChatCompletionChunk | CompletionChunk) -> str:
    payload = chunk.model_dump()
    for choice, model in zip(payload["choices"], chunk.choices):
        if "delta" in choice:  # OpenAI sends only the delta fields that are set
            choice["delta"] = model.delta.model_dump(exclude_none=True)
    return sse_event(payload)


def _failure_response(outputs: list[StepOutput]) -> Response | None:
    for out in outputs:
        if (failure := failure_of(out)) is not None:
            return error_response(failure[1], failure[0], code="engine_error")
    return None


# ---- /v1/completions ------------------------------------------------------------------------------
def _completion_prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        return [[]]  # an empty prompt: reported by the engine's validation
    return list(prompt)


def _without_output(out: StepOutput) -> StepOutput:
    """`out` as if no token had been generated: `max_tokens: 0` with echo and logprobs runs one token
    (the engine computes prompt logprobs only for a request it runs) that the reply leaves out."""
    meta = dataclasses.replace(out.meta, completion_tokens=0, output_token_logprobs=[], output_top_logprobs=[],
                               finish_reason=finish_length(0) if out.finished else None)
    return dataclasses.replace(out, new_token_ids=[], output_ids=[], text="", text_delta="", meta=meta)


async def completions(request: Request) -> Response:
    """POST /v1/completions."""
    engine_loop = request.app.state.engine_loop
    body = parse_json_body(await request.body())
    check_request_sizes(body)
    req = CompletionRequest.model_validate(body)
    check_openai_request(req)
    check_best_of(req)
    if req.suffix:
        raise APIError("suffix is not supported", 400, param="suffix", code="unsupported_parameter")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise APIError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}", 400, param="logprobs", code="invalid_value")
    check_tokenizer_needed(request, "prompt", any(isinstance(p, str) for p in _completion_prompts(req.prompt)))
    max_tokens, max_field = max_tokens_of(req)
    prompt_logprobs = req.echo and req.logprobs is not None
    drop_output = prompt_logprobs and max_tokens == 0
    raw_prompts = _completion_prompts(req.prompt)
    group = RequestGroup(engine_loop)
    # several prompts of one rid: one sequence each, `<rid>-p<i>` (no rid: the engine gives each its own)
    rids = [req.rid] if len(raw_prompts) == 1 else [req.rid and f"{req.rid}-p{i}" for i in range(len(raw_prompts))]
    await preprocess(request, lambda: _submit(
        group, engine_loop.engine.checker, _renames(req, "prompt", max_field, "logprobs"), list(zip(raw_prompts, rids)), req,
        req.logprobs is not None, req.logprobs or 0, max_new_tokens=1 if drop_output else max_tokens,
        default_max_new_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS, logprob_start_len=0 if prompt_logprobs else -1,
        served_model_name=request.app.state.model_name))
    rid = req.rid or group.base_rids[0]
    tokenizer = engine_loop.engine.tokenizer
    echoes = [(p if isinstance(p, str) else tokenizer.decode(p)) if req.echo else "" for p in raw_prompts]
    model = request.app.state.model_name
    if req.stream:
        mark_streaming(request, group.rids)
        return SSEResponse(_completion_stream(group, req, f"cmpl-{rid}", model, echoes, tokenizer, drop_output))
    async with abort_on_disconnect(request, group):
        outputs = await group.wait()
    if (failure := _failure_response(outputs)) is not None:
        return failure
    if drop_output:
        outputs = [_without_output(o) for o in outputs]
    texts = TokenTexts(tokenizer)
    choices = []
    for i, out in enumerate(outputs):
        echo = echoes[i // req.n]
        reason, matched = finish_reason_of(out)
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(out, 0, texts, 0 if prompt_logprobs else len(echo), req.logprobs, prompt_logprobs)
            if prompt_logprobs:  # the output tokens start where the echoed text ends
                _shift_output_offsets(logprobs, len(out.meta.input_token_logprobs or []), len(echo))
        choices.append(CompletionChoice(index=i, text=echo + out.text, logprobs=logprobs, finish_reason=reason, matched_stop=matched))
    response = CompletionResponse(id=f"cmpl-{rid}", model=model, choices=choices, usage=_usage(outputs, req.n))
    return JSONResponse(response.model_dump())


def _shift_output_offsets(logprobs: CompletionLogprobs, num_prompt: int, echo_len: int) -> None:
    """Restart the text offsets of the output tokens at the end of the echoed prompt text (token texts
    decoded one by one need not add up to the prompt's text)."""
    offset = echo_len
    for j in range(num_prompt, len(logprobs.tokens)):
        logprobs.text_offset[j] = offset
        offset += len(logprobs.tokens[j])


def _completion_stream(group: RequestGroup, req: CompletionRequest, response_id: str, model: str,
                       echoes: list[str], tokenizer: Any, drop_output: bool) -> AsyncIterator[str]:
    index = {rid: i for i, rid in enumerate(group.rids)}
    offsets = {rid: len(echoes[index[rid] // req.n]) for rid in group.rids}  # text offset of the next token
    prompt_logprobs = req.echo and req.logprobs is not None
    pending_echo = set(group.rids) if prompt_logprobs else set()  # echo goes out with the prompt logprobs
    texts = TokenTexts(tokenizer)
    created = int(time.time())

    def chunk(i: int, text: str, logprobs=None, reason=None, matched=None) -> str:
        choice = CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=reason, matched_stop=matched)
        return _chunk_event(CompletionChunk(id=response_id, created=created, model=model, choices=[choice]))

    def logprobs_since(out: StepOutput, start: int) -> CompletionLogprobs | None:
        with_prompt = out.rid in pending_echo
        if len(out.output_ids) <= start and not with_prompt:
            return None
        logprobs = completion_logprobs(out, start, texts, 0 if with_prompt else offsets[out.rid], req.logprobs, with_prompt)
        if with_prompt:
            _shift_output_offsets(logprobs, len(out.meta.input_token_logprobs or []), offsets[out.rid])
        if len(out.output_ids) > start:
            offsets[out.rid] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        return logprobs

    def delta(i: int, out: StepOutput, text: str, logprobs) -> list[str]:
        if out.rid in pending_echo:
            pending_echo.discard(out.rid)
            text = echoes[i // req.n] + text
        return [chunk(i, text, logprobs)]

    return _stream_events(
        group, req,
        opening=[chunk(i, echoes[i // req.n]) for i in index.values()] if req.echo and not prompt_logprobs else [],
        logprobs_since=logprobs_since if req.logprobs is not None else None,
        delta=delta,
        finish=lambda i, out, reason, matched: [chunk(i, "", None, reason, matched)],
        usage=lambda usage: _chunk_event(CompletionChunk(id=response_id, created=created, model=model, choices=[], usage=usage)),
        transform=_without_output if drop_output else None,
    )


async def _stream_events(
    group: RequestGroup,
    req: OpenAISampling,
    *,
    opening: list[str],
    logprobs_since: Callable[[StepOutput, int], Any] | None,
    delta: Callable[[int, StepOutput, str, Any], Iterable[str]],
    finish: Callable[[int, StepOutput, str | None, Any], Iterable[str]],
    usage: Callable[[UsageInfo], str],
    transform: Callable[[StepOutput], StepOutput] | None = None,
) -> AsyncIterator[str]:
    """The SSE events of one streamed OpenAI request group, shared by completions and chat.

    `opening` events go first; then, per engine output (through `transform` if given), the `delta`
    events for new text or logprobs (from `logprobs_since(out, first unsent token)`, which returns None
    when there is nothing new; itself None when logprobs were not asked for) and the `finish` events when
    a choice ends; then the `usage` event if `stream_options.include_usage`, and `[DONE]`. Leaving
    the stream early (client gone) aborts the group's requests.
    """
    index = {rid: i for i, rid in enumerate(group.rids)}
    sent = dict.fromkeys(group.rids, 0)  # output tokens whose logprobs were sent
    final: dict[str, StepOutput] = {}
    try:
        for event in opening:
            yield event
        async for out in group:
            i = index[out.rid]
            if (failure := failure_of(out)) is not None:
                final[out.rid] = out
                yield sse_event(error_body(failure[1], failure[0], code="engine_error"))
                continue
            if transform is not None:
                out = transform(out)
            logprobs = None
            if logprobs_since is not None:
                logprobs = logprobs_since(out, sent[out.rid])
                sent[out.rid] = len(out.output_ids)
            if out.text_delta or logprobs is not None:
                for event in delta(i, out, out.text_delta, logprobs):
                    yield event
            if out.finished:
                final[out.rid] = out
                for event in finish(i, out, *finish_reason_of(out)):
                    yield event
        if req.stream_options is not None and req.stream_options.include_usage:
            yield usage(_usage([final[r] for r in group.rids], req.n))
        yield DONE
    finally:
        group.abort()


# ---- /v1/chat/completions -------------------------------------------------------------------------
def _chat_finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


@dataclasses.dataclass
class ChatRun:
    """A chat request submitted to the engine (`submit_chat`): its request group, and how to read its
    outputs: `plan` (the tools and their parser), `reasoning` (the format that splits the reasoning
    out of the text, None to leave it in)."""

    group: RequestGroup
    rid: str
    plan: ToolPlan
    reasoning: ReasoningFormat | None


async def submit_chat(request: Request, req: ChatCompletionRequest, field_names: dict[str, str] | None = None) -> ChatRun:
    """Check `req`, render its prompt and submit it (on the preprocessing thread). `field_names` renames
    fields in error params for an API that takes the chat under other names (/v1/responses' `input`,
    `max_output_tokens`).

    Raises:
        APIError: 400 naming the field (with `field_names` applied).
    """
    rename = field_names or {}
    try:
        return await _submit_chat(request, req, rename)
    except APIError as e:
        if e.param is not None:
            head, sep, rest = e.param.partition("[") if "[" in e.param else e.param.partition(".")
            e.param = rename.get(head, head) + sep + rest
        raise


async def _submit_chat(request: Request, req: ChatCompletionRequest, rename: dict[str, str]) -> ChatRun:
    engine_loop = request.app.state.engine_loop
    check_openai_request(req)
    check_chat_messages(req)
    check_tokenizer_needed(request, "messages", True)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", 400, param="top_logprobs", code="invalid_value")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}", 400,
                           param="top_logprobs", code="invalid_value")
    plan = tool_plan(req, request.app.state.server_args.tool_call_parser)
    max_tokens, max_field = max_tokens_of(req)
    tokenizer = engine_loop.engine.tokenizer
    group = RequestGroup(engine_loop)
    renames = {k: rename.get(v, v) for k, v in _renames(req, "messages", max_field, "top_logprobs").items()}
    for name, other in rename.items():  # engine fields the chat keeps its own name for (rid)
        renames.setdefault(name, other)
    if plan.grammar is not None:
        renames["ebnf"] = "tool_choice"
    fmt = request.app.state.reasoning_format
    constrained = plan.grammar is not None or req.regex is not None or req.ebnf is not None or _json_schema_of(req) is not None
    # as SGLang's ReasonerGrammarBackend: a request that reasons gets its grammar after </think>; one that
    # does not (enable_thinking false) has it from the first token, and then its reply holds no reasoning
    think_end_ids = grammar_think_end_ids(fmt, req.chat_template_kwargs, tokenizer) if constrained else ()

    def prepare() -> None:  # on the preprocessing thread: the template, then the request's one check
        prompt = chat_prompt(tokenizer, req, plan.parser, plan.tools, request.app.state.chat_template)
        _submit(group, engine_loop.engine.checker, renames, [(prompt, req.rid)], req, req.logprobs, req.top_logprobs or 0, max_new_tokens=max_tokens,
                default_max_new_tokens=None, add_special_tokens=False, ebnf=plan.grammar, think_end_ids=think_end_ids,
                served_model_name=request.app.state.model_name)

    await preprocess(request, prepare)
    reasoning = fmt if req.separate_reasoning and (not constrained or think_end_ids) else None
    return ChatRun(group, group.base_rids[0], plan, reasoning)


def _chat_prompt_ids(request: Request, req: ChatCompletionRequest, plan: ToolPlan,
                     add_special_tokens: bool = False) -> list[int]:
    """The prompt token ids of a chat: its template rendered with the plan's tools, then tokenized
    (without adding special tokens, as a chat's prompt: the template wrote them)."""
    engine_loop = request.app.state.engine_loop
    prompt = chat_prompt(engine_loop.engine.tokenizer, req, plan.parser, plan.tools, request.app.state.chat_template)
    return _tokenize(engine_loop, prompt, "messages", add_special_tokens=add_special_tokens)


async def chat_prompt_ids(request: Request, req: ChatCompletionRequest, add_special_tokens: bool = False) -> list[int]:
    """The prompt token ids `req` would be submitted with (`_chat_prompt_ids` on the preprocessing
    thread, as `submit_chat` computes them); nothing is submitted. `add_special_tokens`: also add the
    tokenizer's own to the rendered text (SGLang's /tokenize with `add_generation_prompt` given).

    Raises:
        APIError: 400 as `submit_chat` would for the messages or tools (code context_length_exceeded
            for a prompt refused by its length in characters before it is tokenized).
    """
    plan = tool_plan(req, request.app.state.server_args.tool_call_parser)
    return await preprocess(request, lambda: _chat_prompt_ids(request, req, plan, add_special_tokens))


async def chat_prompt_tokens(request: Request, req: ChatCompletionRequest) -> int:
    """The number of prompt tokens `req` would be submitted with (`chat_prompt_ids`).

    Raises:
        APIError: as `chat_prompt_ids`.
    """
    return len(await chat_prompt_ids(request, req))


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions."""
    body = parse_json_body(await request.body())
    check_request_sizes(body)
    req = ChatCompletionRequest.model_validate(body)
    # here, not in submit_chat: /v1/responses checks its function_call_output items by their own names
    check_tool_messages(req)
    run = await submit_chat(request, req)
    group, rid, plan, reasoning = run.group, run.rid, run.plan, run.reasoning
    tokenizer = request.app.state.engine_loop.engine.tokenizer
    model = request.app.state.model_name
    if req.stream:
        mark_streaming(request, group.rids)
        return SSEResponse(_chat_stream(group, req, f"chatcmpl-{rid}", model, tokenizer, plan, reasoning))
    async with abort_on_disconnect(request, group):
        outputs = await group.wait()
    if (failure := _failure_response(outputs)) is not None:
        return failure
    texts = TokenTexts(tokenizer)
    choices = []
    for i, out in enumerate(outputs):
        reason, matched = finish_reason_of(out)
        logprobs = chat_logprobs(out, 0, texts) if req.logprobs else None
        text, reasoning_content = out.text, None
        if reasoning is not None:
            split = split_reasoning(reasoning, out.text)
            text, reasoning_content = split.content, split.reasoning or None
        message = ChatMessageOut(content=text, reasoning_content=reasoning_content)
        if plan.tools:
            # a forced call as its stream reads: one cut by max_tokens is still the call (finish_reason length)
            parsed = (read_reply(plan.parser, plan.tools, text, True) if plan.grammar is not None
                      else plan.parser.parse(text, plan.tools))
            if parsed.calls:
                calls = parsed.calls if req.parallel_tool_calls else parsed.calls[:1]
                message = ChatMessageOut(content=parsed.content, reasoning_content=reasoning_content,
                                         tool_calls=tool_calls_out(calls))
            reason = _chat_finish_reason(reason, bool(parsed.calls))
        choices.append(ChatCompletionChoice(index=i, message=message, logprobs=logprobs, finish_reason=reason, matched_stop=matched))
    response = ChatCompletionResponse(id=f"chatcmpl-{rid}", model=model, choices=choices, usage=_usage(outputs, req.n))
    return JSONResponse(response.model_dump(exclude_none=False))


def _chat_stream(group: RequestGroup, req: ChatCompletionRequest, response_id: str, model: str,
                 tokenizer: Any, plan: ToolPlan, reasoning: ReasoningFormat | None) -> AsyncIterator[str]:
    """Chat chunks; with `reasoning` (--reasoning-parser), text goes through a ReasoningSplitter per choice
    first and its reasoning is sent as delta.reasoning_content; with tools, the rest goes through a
    ToolCallStreamer per choice and each call is sent as OpenAI's delta.tool_calls: {index, id, type,
    function.name} first, then its argument text (as it is decoded for a forced call, in one piece once
    the call is complete otherwise)."""
    texts = TokenTexts(tokenizer)
    created = int(time.time())
    incremental = plan.grammar is not None  # a forced call is well-formed: stream its arguments as decoded
    streamers = ({i: ToolCallStreamer(plan.parser, plan.tools, incremental) for i in range(len(group.rids))}
                 if plan.tools else {})
    num_calls = dict.fromkeys(range(len(group.rids)), 0)
    skipping = dict.fromkeys(range(len(group.rids)), False)  # parallel_tool_calls false: a 2nd call is not sent
    splitters = ({i: ReasoningSplitter(reasoning, req.stream_reasoning) for i in range(len(group.rids))}
                 if reasoning is not None else {})

    def chunk(i: int, delta: ChatDelta, logprobs=None, reason=None, matched=None) -> str:
        choice = ChatStreamChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=reason, matched_stop=matched)
        return _chunk_event(ChatCompletionChunk(id=response_id, created=created, model=model, choices=[choice]))

    def pieces(i: int, events: list[StreamEvent], logprobs) -> list[str]:
        out: list[str] = []
        for event in events:
            if isinstance(event, Content):
                out.append(chunk(i, ChatDelta(content=event.text), logprobs))
                logprobs = None
            elif isinstance(event, CallStart):
                skipping[i] = not req.parallel_tool_calls and num_calls[i] >= 1
                if not skipping[i]:
                    num_calls[i] += 1
                    out.append(chunk(i, ChatDelta(tool_calls=[ToolCallDelta(
                        index=num_calls[i] - 1, id=f"call_{uuid.uuid4().hex[:24]}", type="function",
                        function=FunctionCall(name=event.name, arguments=""))])))
            elif not skipping[i]:
                out.append(chunk(i, ChatDelta(tool_calls=[ToolCallDelta(
                    index=num_calls[i] - 1, function=FunctionCall(arguments=event.text))])))
        if logprobs is not None:  # no text to carry them: a delta of their own
            out.insert(0, chunk(i, ChatDelta(), logprobs))
        return out

    def answer(i: int, text: str, logprobs) -> list[str]:
        if i not in streamers:
            return [chunk(i, ChatDelta(content=text), logprobs)] if text or logprobs is not None else []
        return pieces(i, streamers[i].feed(text), logprobs)

    def delta(i: int, out: StepOutput, text: str, logprobs) -> list[str]:
        if i not in splitters:
            return answer(i, text, logprobs)
        split = splitters[i].feed(text)
        events = [chunk(i, ChatDelta(reasoning_content=split.reasoning), logprobs)] if split.reasoning else []
        return events + answer(i, split.content, None if events else logprobs)

    def finish(i: int, out: StepOutput, reason: str | None, matched: Any) -> list[str]:
        events = []
        if i in splitters:  # the text held back in case it began a tag
            split = splitters[i].finish()
            if split.reasoning:
                events.append(chunk(i, ChatDelta(reasoning_content=split.reasoning)))
            if split.content:
                events += answer(i, split.content, None)
        if i in streamers:
            events += pieces(i, streamers[i].finish(), None)
        return events + [chunk(i, ChatDelta(), None, _chat_finish_reason(reason, num_calls[i] > 0), matched)]

    def logprobs_since(out: StepOutput, start: int) -> ChatLogprobs | None:
        return chat_logprobs(out, start, texts) if len(out.output_ids) > start else None

    return _stream_events(
        group, req,
        opening=[chunk(i, ChatDelta(role="assistant", content="")) for i in range(len(group.rids))],
        logprobs_since=logprobs_since if req.logprobs else None,
        delta=delta,
        finish=finish,
        usage=lambda usage: _chunk_event(ChatCompletionChunk(id=response_id, created=created, model=model, choices=[], usage=usage)),
    )
