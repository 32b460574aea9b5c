"""SGLang's tokenization routes: POST /tokenize and POST /detokenize (also under /v1/).

SGLang 0.5.23 serves them beside its OpenAI routes (entrypoints/openai/serving_tokenize.py); the
request and response fields are its own (protocol.py: TokenizeRequest, TokenizeResponse,
DetokenizeRequest, DetokenizeResponse):

- /tokenize: `prompt` (a text: `tokens` and `count` of it; a list of texts: a list of each) encoded
  with `add_special_tokens` (default true), or `messages` rendered through the chat template into the
  token ids /v1/chat/completions would submit for the same body. `max_model_len` is the tokenizer's
  `model_max_length`, or the served context length where the tokenizer has none (SGLang's rule).
  Nothing reaches the engine and, as in SGLang and vLLM, a prompt longer than the context is counted,
  not refused (the request body's bound, --max-request-body-bytes, bounds the work).
- /detokenize: `tokens` (a list of ids: one `text`; a list of lists: a list of texts), decoded with
  `skip_special_tokens` (default true). An id outside the tokenizer's vocabulary is a 400 naming it
  (`tokens[3]`, `tokens[1][0]`), where transformers would decode it to nothing or raise.

With `--skip-tokenizer-init` both routes refuse text, as the other routes do (SGLang then has no
tokenizer). Tokenizing and decoding run on the preprocessing thread, where every other route uses the tokenizer
(a fast tokenizer's settings must not change under a concurrent call). Every bad input is an APIError
(400) naming the field.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.core.field_types import OPENAI_FIELD_TYPES, check_field_types
from jaxserve.core.size_limits import check_request_sizes
from jaxserve.server.engine_client import preprocess
from jaxserve.server.errors import APIError, parse_json_body
from jaxserve.server.openai.chat_completions import chat_prompt_ids
from jaxserve.server.openai.checks import check_chat_messages, check_tokenizer_needed, check_tool_messages
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

# /tokenize's own fields: the rest of a body with `messages` is read as a chat request
_TOKENIZE_ONLY_FIELDS = ("prompt", "add_special_tokens")


def max_model_len(tokenizer: Any, context_length: int) -> int:
    """SGLang's `max_model_len` of a /tokenize reply: the tokenizer's `model_max_length` (tokens), or
    `context_length` where that is no integer a JSON reader takes as one (transformers' placeholder
    for "no limit" is 1e30)."""
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < 2**63:
        return limit
    return context_length


async def tokenize(request: Request) -> Response:
    """POST /tokenize."""
    body = parse_json_body(await request.body())
    req = TokenizeRequest.model_validate(body)
    if req.prompt is None and req.messages is None:
        raise APIError("prompt: give a prompt (a text or a list of texts) or messages", 400, param="prompt",
                       code="missing_required_parameter")
    if req.prompt is not None and req.messages is not None:
        raise APIError("messages: give either prompt or messages, not both", 400, param="messages", code="invalid_value")
    engine_loop = request.app.state.engine_loop
    check_tokenizer_needed(request, "prompt" if req.messages is None else "messages", True)
    if req.messages is not None:
        chat = _chat_request(body)
        # SGLang's rule: with add_generation_prompt given, the rendered text gets the tokenizer's special
        # tokens only when the request asks for them; without it, none (as a chat's prompt)
        add_special = (req.add_generation_prompt is not None and "add_special_tokens" in req.model_fields_set
                       and req.add_special_tokens)
        ids = await chat_prompt_ids(request, chat, add_special)
        tokens: list[int] | list[list[int]] = ids
        count: int | list[int] = len(ids)
    else:
        texts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt or [])
        tokenizer = engine_loop.engine.tokenizer
        encoded = await preprocess(request, lambda: [
            list(tokenizer.encode(text, add_special_tokens=req.add_special_tokens)) for text in texts])
        if isinstance(req.prompt, str):
            tokens, count = encoded[0], len(encoded[0])
        else:
            tokens, count = encoded, [len(ids) for ids in encoded]
    limit = max_model_len(engine_loop.engine.tokenizer, engine_loop.engine.limits.context_length)
    return JSONResponse(TokenizeResponse(tokens=tokens, count=count, max_model_len=limit).model_dump())


def _chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request a /tokenize body with `messages` renders as: its fields but /tokenize's own,
    checked as /v1/chat/completions checks them.

    Raises:
        APIError, RequestError: 400 naming the field.
    """
    chat_body = {k: v for k, v in body.items() if k not in _TOKENIZE_ONLY_FIELDS}
    check_field_types(chat_body, OPENAI_FIELD_TYPES)
    check_request_sizes(chat_body)
    chat = ChatCompletionRequest.model_validate(chat_body)
    check_tool_messages(chat)
    check_chat_messages(chat)
    return chat


async def detokenize(request: Request) -> Response:
    """POST /detokenize."""
    body = parse_json_body(await request.body())
    req = DetokenizeRequest.model_validate(body)
    engine_loop = request.app.state.engine_loop
    tokenizer = engine_loop.engine.tokenizer
    if tokenizer is None or request.app.state.server_args.skip_tokenizer_init:  # as its outputs carry no text
        raise APIError("tokens: the server runs with --skip-tokenizer-init, so it decodes no text", 400,
                       param="tokens", code="invalid_value")
    is_batch = bool(req.tokens) and isinstance(req.tokens[0], list)
    id_lists: list[list[int]] = req.tokens if is_batch else [req.tokens]  # type: ignore[assignment,list-item]
    vocab_size = len(tokenizer)
    for i, ids in enumerate(id_lists):
        check_token_ids(ids, vocab_size, f"tokens[{i}]" if is_batch else "tokens")
    texts = await preprocess(request, lambda: [
        tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens) for ids in id_lists])
    return JSONResponse(DetokenizeResponse(text=texts if is_batch else texts[0]).model_dump())


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    """Refuse a token id outside [0, vocab_size).

    Raises:
        APIError: 400 naming the first such id's place (`field[j]`).
    """
    if not ids or (0 <= min(ids) and max(ids) < vocab_size):
        return
    j = next(j for j, t in enumerate(ids) if not 0 <= t < vocab_size)
    raise APIError(f"{field}[{j}]: token id {ids[j]} is outside the vocabulary [0, {vocab_size})", 400,
                   param=f"{field}[{j}]", code="invalid_value")
