"""OpenAI-compatible API: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.

Sampling fields map onto the engine's `SamplingParams` as SGLang's OpenAI layer maps them
(max_tokens / max_completion_tokens -> max_new_tokens, min_tokens -> min_new_tokens,
response_format -> json_schema, SGLang's extra fields as they are); a bad value is a 400 whose
`param` uses the OpenAI name. finish_reason is "stop" (EOS, stop token, stop string), "length", or
"abort" (cancelled through /abort_request); `matched_stop` says what stopped it (SGLang's field).
Streams send `data: {chunk}` events and end with `data: [DONE]`; with
`stream_options.include_usage` the last chunk before [DONE] has empty choices and the usage.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.engine import RequestError, StepOutput
from jaxserve.engine.request import SamplingParamsError
from jaxserve.server.engine_client import RequestGroup, abort_on_disconnect, preprocess
from jaxserve.server.errors import APIError, error_body, error_response, from_engine_error, parse_json_body
from jaxserve.server.native_api import failure_of
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
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    _OpenAISampling,
)
from jaxserve.server.metrics import mark_streaming
from jaxserve.server.sse import DONE, SSEResponse, sse_event

MAX_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# ---- request -> engine ----------------------------------------------------------------------------
def sampling_params_of(req: _OpenAISampling, max_new_tokens: int) -> dict[str, Any]:
    """The engine's sampling-params dict for an OpenAI request (absent fields keep their defaults)."""
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
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "seed": req.seed,
        "ignore_eos": req.ignore_eos,
        "no_stop_trim": req.no_stop_trim,
        "skip_special_tokens": req.skip_special_tokens,
        "regex": req.regex,
        "ebnf": req.ebnf,
        "json_schema": _json_schema_of(req),
    }
    return {k: v for k, v in d.items() if v is not None}


def _json_schema_of(req: _OpenAISampling) -> str | None:
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


def _check_unsupported(req: _OpenAISampling) -> None:
    if req.logit_bias:
        raise APIError("logit_bias is not supported", 400, param="logit_bias", code="unsupported_parameter")


def _renames(req: _OpenAISampling, prompt_field: str, max_field: str, top_field: str) -> dict[str, str]:
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


def _submit(group: RequestGroup, renames: dict[str, str], prompts: list[tuple[list[int], str | None, int]],
            req: _OpenAISampling, return_logprob: bool, top_logprobs_num: int) -> None:
    """Submit (token ids, rid, max_new_tokens) per prompt; a validation error aborts the ones before it."""
    try:
        for ids, rid, max_new_tokens in prompts:
            group.submit(ids, sampling_params_of(req, max_new_tokens), rid=rid,
                         return_logprob=return_logprob, top_logprobs_num=top_logprobs_num)
    except (SamplingParamsError, RequestError) as e:
        group.abort()
        raise from_engine_error(e, renames) from None
    except BaseException:
        group.abort()
        raise


def _tokenize(engine_loop, prompt: str | list[int], field: str) -> list[int]:
    try:
        return engine_loop.tokenize(prompt)
    except RequestError as e:
        raise from_engine_error(e, {"input_ids": field, "prompt": field}) from None


# ---- engine -> response ---------------------------------------------------------------------------
def finish_reason_of(out: StepOutput) -> tuple[str | None, int | str | None]:
    """(OpenAI finish_reason, matched stop) of a finished output; (None, None) while it runs."""
    reason = out.meta.finish_reason
    if not out.finished or reason is None:
        return None, None
    return reason.get("type"), reason.get("matched")


class _TokenTexts:
    """Decoded text of single tokens, cached per response (logprob entries repeat tokens)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


def _completion_logprobs(out: StepOutput, start: int, texts: _TokenTexts, offset: int, k: int) -> CompletionLogprobs:
    pairs = (out.meta.output_token_logprobs or [])[start:]
    tops = (out.meta.output_top_logprobs or [])[start:]
    result = CompletionLogprobs()
    for i, (logprob, token_id) in enumerate(pairs):
        text = texts(token_id)
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append({texts(t): lp for lp, t in tops[i]} if k > 0 and i < len(tops) else None)
        result.text_offset.append(offset)
        offset += len(text)
    return result


def _chat_logprobs(out: StepOutput, start: int, texts: _TokenTexts) -> ChatLogprobs:
    pairs = (out.meta.output_token_logprobs or [])[start:]
    tops = (out.meta.output_top_logprobs or [])[start:]
    content = []
    for i, (logprob, token_id) in enumerate(pairs):
        text = texts(token_id)
        top = [TopLogprob(token=texts(t), logprob=lp, bytes=list(texts(t).encode())) for lp, t in (tops[i] if i < len(tops) else [])]
        content.append(TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


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
    for choice in payload["choices"]:
        if "delta" in choice:  # OpenAI sends only the delta fields that are set
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return sse_event(payload)


def _failure_response(outputs: list[StepOutput]) -> Response | None:
    for out in outputs:
        if (failure := failure_of(out)) is not None:
            return error_response(failure[1], failure[0], code="engine_error")
    return None


def _new_rid(req: _OpenAISampling) -> str:
    return req.rid or uuid.uuid4().hex


# ---- /v1/completions ------------------------------------------------------------------------------
def _completion_prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        return [[]]  # an empty prompt: reported by the engine's validation
    return list(prompt)


async def completions(request: Request) -> Response:
    """POST /v1/completions."""
    engine_loop = request.app.state.engine_loop
    req = CompletionRequest.model_validate(parse_json_body(await request.body()))
    _check_unsupported(req)
    if req.suffix:
        raise APIError("suffix is not supported", 400, param="suffix", code="unsupported_parameter")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise APIError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}", 400, param="logprobs", code="invalid_value")
    if req.echo and req.logprobs is not None:
        raise APIError("echo with logprobs is not supported (no prompt logprobs)", 400, param="echo", code="unsupported_parameter")
    rid = _new_rid(req)
    raw_prompts = _completion_prompts(req.prompt)
    group = RequestGroup(engine_loop)

    def prepare() -> None:  # on the preprocessing thread
        prompts = []
        for i, p in enumerate(raw_prompts):
            ids = _tokenize(engine_loop, p, "prompt")
            room = max(1, engine_loop.context_length - len(ids))
            max_new = req.max_tokens if req.max_tokens is not None else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
            prompts.append((ids, rid if len(raw_prompts) == 1 else f"{rid}-p{i}", max_new))
        _submit(group, _renames(req, "prompt", "max_tokens", "logprobs"), prompts, req,
                req.logprobs is not None, req.logprobs or 0)

    await preprocess(request, prepare)
    tokenizer = engine_loop.tokenizer
    echoes = [(p if isinstance(p, str) else tokenizer.decode(p)) if req.echo else "" for p in raw_prompts]
    model = request.app.state.model_name
    if req.stream:
        mark_streaming(request, group.rids)
        return SSEResponse(_completion_stream(group, req, f"cmpl-{rid}", model, echoes, tokenizer))
    async with abort_on_disconnect(request, group):
        outputs = await group.wait()
    if (failure := _failure_response(outputs)) is not None:
        return failure
    texts = _TokenTexts(tokenizer)
    choices = []
    for i, out in enumerate(outputs):
        echo = echoes[i // req.n]
        reason, matched = finish_reason_of(out)
        logprobs = _completion_logprobs(out, 0, texts, len(echo), req.logprobs) if req.logprobs is not None else None
        choices.append(CompletionChoice(index=i, text=echo + out.text, logprobs=logprobs, finish_reason=reason, matched_stop=matched))
    response = CompletionResponse(id=f"cmpl-{rid}", model=model, choices=choices, usage=_usage(outputs, req.n))
    return JSONResponse(response.model_dump())


def _completion_stream(group: RequestGroup, req: CompletionRequest, response_id: str, model: str,
                       echoes: list[str], tokenizer: Any) -> AsyncIterator[str]:
    index = {rid: i for i, rid in enumerate(group.rids)}
    offsets = {rid: len(echoes[index[rid] // req.n]) for rid in group.rids}  # text offset of the next token
    texts = _TokenTexts(tokenizer)
    created = int(time.time())

    def chunk(i: int, text: str, logprobs=None, reason=None, matched=None) -> str:
        choice = CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=reason, matched_stop=matched)
        return _chunk_event(CompletionChunk(id=response_id, created=created, model=model, choices=[choice]))

    def logprobs_since(out: StepOutput, start: int) -> CompletionLogprobs:
        logprobs = _completion_logprobs(out, start, texts, offsets[out.rid], req.logprobs)
        offsets[out.rid] += sum(len(t) for t in logprobs.tokens)
        return logprobs

    return _stream_events(
        group, req,
        opening=[chunk(i, echoes[i // req.n]) for i in index.values()] if req.echo else [],
        logprobs_since=logprobs_since if req.logprobs is not None else None,
        delta=chunk,
        finish=lambda i, reason, matched: chunk(i, "", None, reason, matched),
        usage=lambda usage: _chunk_event(CompletionChunk(id=response_id, created=created, model=model, choices=[], usage=usage)),
    )


async def _stream_events(
    group: RequestGroup,
    req: _OpenAISampling,
    *,
    opening: list[str],
    logprobs_since: Callable[[StepOutput, int], Any] | None,
    delta: Callable[[int, str, Any], str],
    finish: Callable[[int, str | None, Any], str],
    usage: Callable[[UsageInfo], str],
) -> AsyncIterator[str]:
    """The SSE events of one streamed OpenAI request group, shared by completions and chat.

    `opening` events go first; then, per engine output, a `delta` event for new text or logprobs (from
    `logprobs_since(out, first new token)`, None when logprobs were not asked for) and a `finish` event
    when a choice ends; then the `usage` event if `stream_options.include_usage`, and `[DONE]`. Leaving
    the stream early (client gone) aborts the group's requests.
    """
    index = {rid: i for i, rid in enumerate(group.rids)}
    sent = dict.fromkeys(group.rids, 0)  # output tokens whose logprobs were sent
    try:
        for event in opening:
            yield event
        async for out in group:
            i = index[out.rid]
            if (failure := failure_of(out)) is not None:
                yield sse_event(error_body(failure[1], failure[0], code="engine_error"))
                continue
            logprobs = None
            if logprobs_since is not None and len(out.output_ids) > sent[out.rid]:
                logprobs = logprobs_since(out, sent[out.rid])
                sent[out.rid] = len(out.output_ids)
            if out.text_delta or logprobs is not None:
                yield delta(i, out.text_delta, logprobs)
            if out.finished:
                yield finish(i, *finish_reason_of(out))
        if req.stream_options is not None and req.stream_options.include_usage:
            yield usage(_usage([group.final[r] for r in group.rids], req.n))
        yield DONE
    finally:
        group.abort()


# ---- /v1/chat/completions -------------------------------------------------------------------------
def _chat_prompt(tokenizer: Any, req: ChatCompletionRequest) -> str:
    if not req.messages:
        raise APIError("messages must contain at least one message", 400, param="messages", code="invalid_value")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(f"content parts of type {part.type!r} are not supported (text only)", 400,
                                   param=f"messages[{i}].content", code="unsupported_parameter")
                parts.append(part.text)
            content = "\n".join(parts)
        messages.append({"role": m.role, "content": content or ""})
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError("the model has no chat template; use /v1/completions", 400, param="messages", code="invalid_value")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template rejects the conversation (roles out of order, ...)
        raise APIError(f"the chat template rejected the messages: {e}", 400, param="messages", code="invalid_value") from None


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions."""
    engine_loop = request.app.state.engine_loop
    req = ChatCompletionRequest.model_validate(parse_json_body(await request.body()))
    _check_unsupported(req)
    if req.tools:
        raise APIError("tools are not supported", 400, param="tools", code="unsupported_parameter")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", 400, param="top_logprobs", code="invalid_value")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}", 400,
                           param="top_logprobs", code="invalid_value")
    max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    tokenizer = engine_loop.tokenizer
    rid = _new_rid(req)
    group = RequestGroup(engine_loop)

    def prepare() -> None:  # on the preprocessing thread
        ids = _tokenize(engine_loop, _chat_prompt(tokenizer, req), "messages")
        max_new = max_tokens if max_tokens is not None else max(1, engine_loop.context_length - len(ids))
        _submit(group, _renames(req, "messages", max_field, "top_logprobs"), [(ids, rid, max_new)], req,
                req.logprobs, req.top_logprobs or 0)

    await preprocess(request, prepare)
    model = request.app.state.model_name
    if req.stream:
        mark_streaming(request, group.rids)
        return SSEResponse(_chat_stream(group, req, f"chatcmpl-{rid}", model, tokenizer))
    async with abort_on_disconnect(request, group):
        outputs = await group.wait()
    if (failure := _failure_response(outputs)) is not None:
        return failure
    texts = _TokenTexts(tokenizer)
    choices = []
    for i, out in enumerate(outputs):
        reason, matched = finish_reason_of(out)
        logprobs = _chat_logprobs(out, 0, texts) if req.logprobs else None
        choices.append(ChatCompletionChoice(index=i, message=ChatMessageOut(content=out.text), logprobs=logprobs,
                                            finish_reason=reason, matched_stop=matched))
    response = ChatCompletionResponse(id=f"chatcmpl-{rid}", model=model, choices=choices, usage=_usage(outputs, req.n))
    return JSONResponse(response.model_dump())


def _chat_stream(group: RequestGroup, req: ChatCompletionRequest, response_id: str, model: str,
                 tokenizer: Any) -> AsyncIterator[str]:
    texts = _TokenTexts(tokenizer)
    created = int(time.time())

    def chunk(i: int, delta: ChatDelta, logprobs=None, reason=None, matched=None) -> str:
        choice = ChatStreamChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=reason, matched_stop=matched)
        return _chunk_event(ChatCompletionChunk(id=response_id, created=created, model=model, choices=[choice]))

    return _stream_events(
        group, req,
        opening=[chunk(i, ChatDelta(role="assistant", content="")) for i in range(len(group.rids))],
        logprobs_since=(lambda out, start: _chat_logprobs(out, start, texts)) if req.logprobs else None,
        delta=lambda i, text, logprobs: chunk(i, ChatDelta(content=text), logprobs),
        finish=lambda i, reason, matched: chunk(i, ChatDelta(), None, reason, matched),
        usage=lambda usage: _chunk_event(ChatCompletionChunk(id=response_id, created=created, model=model, choices=[], usage=usage)),
    )


# ---- /v1/models -----------------------------------------------------------------------------------
async def models(request: Request) -> Response:
    """GET /v1/models: the one served model."""
    engine_loop = request.app.state.engine_loop
    card = ModelCard(id=request.app.state.model_name, root=engine_loop.model_path, max_model_len=engine_loop.context_length)
    return JSONResponse(ModelList(data=[card]).model_dump())
