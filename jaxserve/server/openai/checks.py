"""Request checks of the OpenAI routes (/v1/completions, /v1/chat/completions) made before a request is
prepared: OpenAI's own rules (`stream_options`, `best_of`, message `content`, `tool` messages) and
`--skip-tokenizer-init`. Each raises an `APIError` (400) naming the field. The values of the sampling fields (ranges, the seed's,
logit_bias keys) are the request's one check's (`SamplingParams.validate`, core/sampling_params.py).
"""

from __future__ import annotations

from starlette.requests import Request

from jaxserve.server.errors import APIError
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAISampling


def check_openai_request(req: OpenAISampling) -> None:
    """Checks made on both endpoints: `stream_options` only with `stream: true` (OpenAI's rule).

    Raises:
        APIError: 400 naming the field.
    """
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed when stream is true", 400, param="stream_options",
                       code="invalid_value")


def check_tokenizer_needed(request: Request, field: str, needs_tokenizer: bool) -> None:
    """`--skip-tokenizer-init` (SGLang's flag): a request that needs the tokenizer (a text prompt, a chat)
    is refused, as SGLang refuses text once it has no tokenizer.

    Raises:
        APIError: 400 naming `field`.
    """
    if needs_tokenizer and request.app.state.server_args.skip_tokenizer_init:
        raise APIError(f"{field}: the server runs with --skip-tokenizer-init, so it takes token ids only "
                       "(input_ids on /generate, a list of ids as the completions prompt)", 400, param=field,
                       code="invalid_value")


def check_best_of(req: CompletionRequest) -> None:
    """`best_of` on /v1/completions: OpenAI's rule best_of >= n (default n); generating best_of
    candidates and returning the n best (best_of > n) is not implemented, so only best_of == n passes.

    Raises:
        APIError: 400 naming best_of.
    """
    if req.best_of is None or req.best_of == req.n or not isinstance(req.n, int) or isinstance(req.n, bool):
        return  # a wrong type of n: the request's one check names it
    if req.best_of < req.n:
        raise APIError(f"best_of must be >= n, got best_of={req.best_of} and n={req.n}", 400, param="best_of",
                       code="invalid_value")
    raise APIError(f"best_of > n is not supported (got best_of={req.best_of}, n={req.n}); use n", 400,
                   param="best_of", code="unsupported_parameter")


def check_chat_messages(req: ChatCompletionRequest) -> None:
    """Every message has `content`, except an assistant message that carries `tool_calls` (OpenAI's rule);
    `best_of` is not a chat field.

    Raises:
        APIError: 400 naming `messages[i].content` or best_of.
    """
    if req.best_of is not None:
        raise APIError("best_of is not a parameter of chat completions (it is one of /v1/completions); use n",
                       400, param="best_of", code="unknown_parameter")
    for i, msg in enumerate(req.messages):
        if msg.content is None and not (msg.role == "assistant" and msg.tool_calls):
            raise APIError(f"messages[{i}].content: field required for {'an' if msg.role == 'assistant' else 'a'} {msg.role} message"
                           + (" (an assistant message may leave it out only with tool_calls)" if msg.role == "assistant" else ""),
                           400, param=f"messages[{i}].content", code="missing_required_parameter")


def check_tool_messages(req: ChatCompletionRequest) -> None:
    """Each `tool` message answers a call of the assistant message before it (OpenAI's rule: tool
    messages follow an assistant message with `tool_calls`, other tool messages between them), and
    its `tool_call_id`, when both sides carry ids, is one of that message's calls'.

    Raises:
        APIError: 400 naming `messages[i].role` (no call to answer) or `messages[i].tool_call_id`.
    """
    calls = None  # the tool_calls of the assistant message the tool messages so far answer
    for i, msg in enumerate(req.messages):
        if msg.role != "tool":
            calls = msg.tool_calls if msg.role == "assistant" else None
            continue
        if not calls:
            raise APIError(f"messages[{i}]: a message with role 'tool' must answer a preceding assistant message "
                           "with 'tool_calls' (only other tool messages may come between them)", 400,
                           param=f"messages[{i}].role", code="invalid_value")
        ids = [c.id for c in calls]
        if msg.tool_call_id is not None and None not in ids and msg.tool_call_id not in ids:
            raise APIError(f"messages[{i}].tool_call_id {msg.tool_call_id!r} is not the id of a tool call of the "
                           f"assistant message before it ({', '.join(map(repr, ids))})", 400,
                           param=f"messages[{i}].tool_call_id", code="invalid_value")
