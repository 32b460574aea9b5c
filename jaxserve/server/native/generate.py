"""SGLang's native API: POST /generate.

    {"text": "Hello", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    -> {"text": "...", "output_ids": [...], "meta_info": {"id", "prompt_tokens", "completion_tokens",
        "cached_tokens", "finish_reason", "e2e_latency", ...}}

A list of texts (or of token-id lists) gives a list of outputs, `n` outputs per prompt in order; one
prompt with n > 1 also gives a list. With `"stream": true` every engine step sends an event per
sequence with the CUMULATIVE text and output_ids (SGLang's behaviour) and an `index`, then
`data: [DONE]`; `sampling_params.stream_interval: N` sends a sequence's event every N tokens instead
(and always its last one).

Every field of SGLang's request is accepted as `sglang_fields` says (implemented, accepted, neutral
value only, refused); the table there is the reference, docs/api.md renders it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.outputs import RequestError, StepOutput, sglang_cached_tokens_details, sglang_finish_reason
from jaxserve.engine.request import SamplingParamsError
from jaxserve.engine.request_input import GenerateInput
from jaxserve.engine.validation.field_types import SAMPLING_FIELD_TYPES, check_field_types
from jaxserve.engine.validation.sampling_params import MAX_N
from jaxserve.engine.validation.size_limits import check_request_id, check_stop_sizes
from jaxserve.server.engine_client import RequestGroup, abort_on_disconnect, preprocess
from jaxserve.server.errors import APIError, error_body, error_response, from_engine_error, parse_json_body
from jaxserve.server.metrics import mark_streaming, mark_unlogged
from jaxserve.server.native.sglang_fields import SAMPLING_FIELD_NAMES, check_request, check_sampling_params
from jaxserve.server.protocol import GenerateOutput, GenerateRequest, MetaInfo
from jaxserve.server.sse import DONE, SSEResponse, sse_event


def _per_prompt(name: str, value: Any, num: int, is_one: bool) -> list[Any]:
    """SGLang's per-prompt fields: one value for every prompt, or a list with one per prompt."""
    if is_one:
        return [value] * num
    if len(value) != num:
        raise APIError(f"{name} has {len(value)} entries for {num} prompts", 400, param=name, code="invalid_value")
    return list(value)


def _takes_lists(req: GenerateRequest, is_batch: bool) -> bool:
    """Whether the per-prompt fields may be lists: a batch, or one prompt with n > 1, which SGLang
    0.5.23 turns into a batch of one (`GenerateReqInput._handle_parallel_sampling`)."""
    sp = req.sampling_params
    first = sp[0] if isinstance(sp, list) and sp else sp
    n = first.get("n") if isinstance(first, dict) else None
    return is_batch or (isinstance(n, int) and not isinstance(n, bool) and n > 1)


def _expand(req: GenerateRequest, think_end_ids: tuple[int, ...] = ()) -> tuple[list[GenerateInput], bool, str]:
    """The prompts of a request, whether it is a batch, and the name of its prompt field.
    `think_end_ids`: a grammar applies after these tokens (`require_reasoning`).

    A string `rid` of a batch becomes `<rid>_<i>` per prompt (SGLang's `_normalize_rid`). One prompt
    takes no list for a per-prompt field (`sampling_params` included: SGLang fails on it), unless its n
    > 1 (`_takes_lists`). Without `return_logprob`, `top_logprobs_num` and `token_ids_logprob` are
    ignored, as SGLang ignores them."""
    if (req.text is None) == (req.input_ids is None):
        raise APIError("give exactly one of text and input_ids", 400, param="text", code="invalid_value")
    field = "text" if req.text is not None else "input_ids"
    value = req.text if req.text is not None else req.input_ids
    is_batch = isinstance(value, list) and (field == "text" or (bool(value) and isinstance(value[0], list)))
    prompts = list(value) if is_batch else [value]
    num = len(prompts)
    if not prompts:
        raise APIError(f"{field} is an empty batch", 400, param=field, code="invalid_value")
    rid = [f"{req.rid}_{i}" for i in range(num)] if is_batch and isinstance(req.rid, str) else req.rid
    fields = {"rid": rid, "return_logprob": req.return_logprob, "top_logprobs_num": req.top_logprobs_num,
              "logprob_start_len": req.logprob_start_len, "cache_salt": req.cache_salt, "extra_key": req.extra_key,
              "lora_path": req.lora_path, "sampling_params": req.sampling_params}
    if not _takes_lists(req, is_batch):
        for name, v in fields.items():
            if isinstance(v, list):
                raise APIError(f"{name} must not be a list for a single prompt (one prompt with n > 1 takes a list "
                               "of one, as a batch of one)", 400, param=name, code="invalid_value")
    del fields["sampling_params"]
    cols = {name: _per_prompt(name, v, num, not isinstance(v, list)) for name, v in fields.items()}
    first_of: dict[Any, int] = {}
    for i, r in enumerate(cols["rid"]):
        if r is not None and first_of.setdefault(r, i) != i:
            raise APIError(f"rid[{i}] {r!r} repeats rid[{first_of[r]}]: the prompts of a batch need different rids",
                           400, param=f"rid[{i}]", code="invalid_value")
    params = _per_prompt("sampling_params", req.sampling_params or {}, num, not isinstance(req.sampling_params, list))
    ids = req.token_ids_logprob or []
    if ids and isinstance(ids[0], list) and not _takes_lists(req, is_batch):
        raise APIError("token_ids_logprob must be a list of ids for a single prompt", 400, param="token_ids_logprob",
                       code="invalid_value")
    ids = _per_prompt("token_ids_logprob", ids, num, not (ids and isinstance(ids[0], list)))
    ids = [picked if asked else [] for picked, asked in zip(ids, cols["return_logprob"])]
    cols["top_logprobs_num"] = [k if asked else 0 for k, asked in zip(cols["top_logprobs_num"], cols["return_logprob"])]
    namespaces = [None if salt is None and key is None else (salt, key) for salt, key in zip(cols["cache_salt"], cols["extra_key"])]
    rows = zip(prompts, map(dict, params), cols["rid"], cols["return_logprob"], cols["top_logprobs_num"],
               cols["logprob_start_len"], ids, namespaces)
    return ([GenerateInput(*row, think_end_ids=think_end_ids, lora_path=lora) for row, lora in zip(rows, cols["lora_path"])],
            is_batch, field)


def sampling_param_path(name: str, index: int | None) -> str:
    """The `param` of an error in a sampling field of /generate: `sampling_params.top_p`, or
    `sampling_params[1].top_p` in the second entry of a list of them."""
    return f"sampling_params.{name}" if index is None else f"sampling_params[{index}].{name}"


def _in_sampling_params(e: APIError, index: int | None) -> APIError:
    """`e`, a 400 about a sampling field, with `param` the field's path (`sampling_param_path`)."""
    if e.param is not None:
        e.param = sampling_param_path(e.param, index)
    return e


def _check_sampling(params: Any, index: int | None) -> Any:
    """One `sampling_params` object through the field table and the JSON types (before the request
    model, whose wording for a wrong type is pydantic's)."""
    if not isinstance(params, dict):
        return params  # the request model names a non-object
    try:
        params = check_sampling_params(params)
        check_field_types(params, SAMPLING_FIELD_TYPES)
        check_stop_sizes(params.get("stop"))
    except APIError as e:
        raise _in_sampling_params(e, index) from None
    except SamplingParamsError as e:
        raise _in_sampling_params(from_engine_error(e), index) from None
    return params


def _parse(body: dict[str, Any], skip_tokenizer_init: bool = False) -> GenerateRequest:
    """Validate a /generate body: SGLang's fields through the field table, then the request model.
    With `--skip-tokenizer-init` a text prompt is a 400 naming `text` (SGLang refuses text then)."""
    body = check_request(body)
    check_request_id(body.get("rid"))
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        body["sampling_params"] = [_check_sampling(x, i) for i, x in enumerate(sp)]
    else:
        body["sampling_params"] = _check_sampling(sp, None)
    req = GenerateRequest.model_validate(body)
    if skip_tokenizer_init and req.text is not None:
        raise APIError("text: the server runs with --skip-tokenizer-init, so prompts must be input_ids (token ids)",
                       400, param="text", code="invalid_value")
    return req


@dataclasses.dataclass(frozen=True)
class LogprobKeys:
    """Which logprob keys a sequence's meta_info has (SGLang 0.5.23's rule, `protocol.MetaInfo`):
    `top` with top_logprobs_num > 0, `token_ids` with a non-empty token_ids_logprob."""

    top: bool
    token_ids: bool


@dataclasses.dataclass(frozen=True)
class _Sequence:
    """What the response needs of one submitted sequence: its stream interval in tokens, its
    prompt's token ids when `return_prompt_token_ids` asked for them, and its logprob keys (None:
    no logprobs asked for)."""

    stream_interval: int
    prompt_token_ids: list[int] | None
    logprobs: LogprobKeys | None = None


def _submit(group: RequestGroup, req: GenerateRequest, prompts: list[GenerateInput], field: str,
            tokenize: Callable[[str | list[int]], list[int]], is_batch: bool = False) -> dict[str, _Sequence]:
    """Submit every prompt; returns what the response needs of each sequence, by rid. A bad prompt
    of a batch is named with its index (`text[1]`), as a bad `sampling_params[1]` is."""
    rename = {"prompt": field, "input_ids": field}
    sequences: dict[str, _Sequence] = {}
    num_submitted: list[int] = [0]  # prompts submitted: the next one is the bad one
    is_reserved = False  # an error before it is the whole batch's (queue room), not one prompt's
    try:
        with group.reserved(sum(_num_sequences(p.sampling_params) for p in prompts), field):
            is_reserved = True
            _submit_each(group, req, prompts, tokenize, sequences, num_submitted)
    except (SamplingParamsError, RequestError) as e:
        group.abort()  # the prompts of the batch submitted before the bad one
        err = from_engine_error(e, rename)
        if isinstance(e, SamplingParamsError) or e.field in SAMPLING_FIELD_NAMES:
            index = num_submitted[0] if isinstance(req.sampling_params, list) else None
            err = _in_sampling_params(err, index)
        elif is_batch and is_reserved and (err.param == field or _given_per_prompt(req, err.param)):
            err.param = f"{err.param}[{num_submitted[0]}]"
        raise err from None
    except BaseException:
        group.abort()
        raise
    return sequences


_PER_PROMPT_FIELDS = ("rid", "return_logprob", "top_logprobs_num", "logprob_start_len", "cache_salt", "extra_key",
                      "token_ids_logprob")


def _given_per_prompt(req: GenerateRequest, name: str | None) -> bool:
    """Whether the batch gave `name` as a list of per-prompt values (then an error in it is named with
    the prompt's index, `logprob_start_len[1]`)."""
    value = getattr(req, name, None) if name in _PER_PROMPT_FIELDS else None
    if name == "token_ids_logprob":
        return isinstance(value, list) and bool(value) and isinstance(value[0], list)
    return isinstance(value, list)


def _num_sequences(sampling_params: dict[str, Any]) -> int:
    """The sequences a prompt will submit (its `n`; an invalid n counts 1 and its submit refuses it)."""
    n = sampling_params.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1


def _submit_each(group: RequestGroup, req: GenerateRequest, prompts: list[GenerateInput],
                 tokenize: Callable[[str | list[int]], list[int]], sequences: dict[str, _Sequence],
                 num_submitted: list[int]) -> None:
    """Submit the prompts in order into the group's reservation, recording each sequence in `sequences`
    and counting the prompts in `num_submitted[0]`."""
    for p in prompts:
        if req.return_prompt_token_ids:  # tokenized once, here, when the response needs the ids
            p = dataclasses.replace(p, prompt=tokenize(p.prompt))
        rids = group.submit(p)
        keys = LogprobKeys(p.top_logprobs_num > 0, bool(p.token_ids_logprob))
        seq = _Sequence(p.sampling_params.get("stream_interval") or 1,
                        list(p.prompt) if req.return_prompt_token_ids else None,
                        keys if p.return_logprob else None)
        sequences.update(dict.fromkeys(rids, seq))
        num_submitted[0] += 1


def to_output(
    out: StepOutput, tokenizer: Any, with_text: bool, index: int | None = None, prompt_token_ids: list[int] | None = None,
    logprobs: LogprobKeys | None = None, with_output_text: bool = True,
) -> dict[str, Any]:
    """A StepOutput as SGLang's output dict; logprobs become [logprob, token_id, text or None] and
    `logprobs` says which logprob keys meta_info has (`protocol.MetaInfo`; None: none);
    `prompt_token_ids` (SGLang's `return_prompt_token_ids`) is added at the top level when given.
    `with_output_text` False (`--skip-tokenizer-init`) leaves `text` out, as SGLang's outputs have
    only output_ids and meta_info then."""
    meta = out.meta

    def triple(logprob: float, token_id: int) -> list[Any]:
        return [logprob, token_id, tokenizer.decode([token_id]) if with_text else None]

    info = MetaInfo(
        id=meta.id,
        prompt_tokens=meta.prompt_tokens,
        completion_tokens=meta.completion_tokens,
        cached_tokens=meta.cached_tokens,
        finish_reason=sglang_finish_reason(meta.finish_reason),
        e2e_latency=meta.e2e_latency,
        cached_tokens_details=sglang_cached_tokens_details(meta.cached_tokens_details),
    )
    if logprobs is not None:
        output = [triple(lp, t) for lp, t in meta.output_token_logprobs or []]
        # SGLang's list is [] without prompt positions (logprob_start_len -1 or the prompt's length)
        prompt = [triple(lp, t) for lp, t in meta.input_token_logprobs or []]
        info.output_token_logprobs, info.output_token_logprobs_length = output, len(output)
        info.input_token_logprobs = prompt
        if logprobs.top:
            info.output_top_logprobs = [[triple(lp, t) for lp, t in top] for top in meta.output_top_logprobs or []]
            # per prompt position, as SGLang: null where no logprob (position 0), else the top-k triples
            info.input_top_logprobs = [None if top is None else [triple(lp, t) for lp, t in top]
                                       for top in meta.input_top_logprobs or []]
        if logprobs.token_ids:
            info.output_token_ids_logprobs = [[triple(lp, t) for lp, t in picked]
                                              for picked in meta.output_token_ids_logprobs or []]
            info.input_token_ids_logprobs = [None if picked is None else [triple(lp, t) for lp, t in picked]
                                             for picked in meta.input_token_ids_logprobs or []]
    result = GenerateOutput(text=out.text, output_ids=out.output_ids, meta_info=info, index=index).model_dump()
    if index is None:
        del result["index"]
    if not with_output_text:
        del result["text"]
    if prompt_token_ids is not None:
        result["prompt_token_ids"] = prompt_token_ids
    # SGLang's meta_info always has these two, null or not
    always = ("finish_reason", "cached_tokens_details")
    result["meta_info"] = {k: v for k, v in result["meta_info"].items() if v is not None or k in always}
    return result


def failure_of(out: StepOutput) -> tuple[int, str] | None:
    """(HTTP status, message) when the engine failed the request (an abort with a status_code);
    None for success and for an abort the client asked for."""
    reason = out.meta.finish_reason
    if reason is not None and reason.kind == "abort" and reason.status_code:
        return reason.status_code, reason.message if reason.message is not None else "the request failed"
    return None


async def generate(request: Request) -> Response:
    """POST /generate (see the module docstring)."""
    engine_loop = request.app.state.engine_loop
    skip_tokenizer = request.app.state.server_args.skip_tokenizer_init
    req = _parse(parse_json_body(await request.body()), skip_tokenizer)
    # SGLang's ReasonerGrammarBackend: with --reasoning-parser a reasoning request's grammar waits for </think>
    fmt = request.app.state.reasoning_format
    think_end_ids = () if not req.require_reasoning or fmt is None or skip_tokenizer else \
        tuple(engine_loop.tokenizer.encode(fmt.think_end, add_special_tokens=False))
    prompts, is_batch, field = _expand(req, think_end_ids)
    group = RequestGroup(engine_loop)
    sequences = await preprocess(request, lambda: _submit(group, req, prompts, field, engine_loop.tokenize, is_batch))
    if not req.log_metrics:
        mark_unlogged(request, group.rids)
    tokenizer = engine_loop.tokenizer
    with_text = req.return_text_in_logprobs and not skip_tokenizer
    if req.stream:
        mark_streaming(request, group.rids)
        return SSEResponse(_stream(group, tokenizer, with_text, sequences, not skip_tokenizer))
    async with abort_on_disconnect(request, group):
        outputs = await group.wait()
    for out in outputs:
        if (failure := failure_of(out)) is not None:
            return error_response(failure[1], failure[0], code="engine_error")
    results = [to_output(out, tokenizer, with_text, None, sequences[out.rid].prompt_token_ids,
                         sequences[out.rid].logprobs, not skip_tokenizer) for out in outputs]
    return JSONResponse(results if is_batch or len(results) > 1 else results[0])


async def _stream(group: RequestGroup, tokenizer: Any, with_text: bool, sequences: dict[str, _Sequence],
                  with_output_text: bool) -> AsyncIterator[str]:
    index = {rid: i for i, rid in enumerate(group.rids)}
    sent = dict.fromkeys(group.rids, 0)  # completion tokens in each sequence's last event
    try:
        async for out in group:
            if (failure := failure_of(out)) is not None:
                yield sse_event(error_body(failure[1], failure[0], code="engine_error"))
                continue
            num_tokens = out.meta.completion_tokens
            seq = sequences[out.rid]
            if not out.finished and num_tokens - sent[out.rid] < seq.stream_interval:
                continue  # events are cumulative, so a skipped one loses nothing
            sent[out.rid] = num_tokens
            yield sse_event(to_output(out, tokenizer, with_text, index[out.rid], seq.prompt_token_ids, seq.logprobs,
                                      with_output_text))
        yield DONE
    finally:
        group.abort()
