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
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.core.errors import RequestError, SamplingParamsError
from jaxserve.core.sampling_params import MAX_N, SamplingParams
from jaxserve.core.size_limits import check_request_id
from jaxserve.engine.outputs import LogprobKeys, StepOutput, meta_info
from jaxserve.engine.request_input import GenerateInput
from jaxserve.engine.validation.check import RequestChecker
from jaxserve.server.engine_client import RequestGroup, abort_on_disconnect, preprocess
from jaxserve.server.errors import APIError, error_body, error_response, from_engine_error, parse_json_body
from jaxserve.server.metrics import mark_streaming, mark_unlogged
from jaxserve.server.native.sglang_fields import SAMPLING_FIELD_NAMES, check_request, check_sampling_params
from jaxserve.server.protocol import GenerateRequest
from jaxserve.server.sse import DONE, SSEResponse, sse_event


def _per_prompt(name: str, value: Any, num: int, is_one: bool) -> list[Any]:
    """SGLang's per-prompt fields: one value for every prompt, or a list with one per prompt."""
    if is_one:
        return [value] * num
    if len(value) != num:
        raise APIError(f"{name} has {len(value)} entries for {num} prompts", 400, param=name, code="invalid_value")
    return list(value)


# SGLang's per-prompt fields of /generate, in the order they are checked: each one value for every prompt,
# or (a batch, or one prompt with n > 1) a list with one per prompt; token_ids_logprob's per-prompt form
# is a list of id lists
PER_PROMPT_FIELDS = ("rid", "return_logprob", "top_logprobs_num", "logprob_start_len", "cache_salt", "extra_key",
                     "lora_path", "sampling_params", "token_ids_logprob")


def _takes_lists(req: GenerateRequest, is_batch: bool) -> bool:
    """Whether the per-prompt fields may be lists: a batch, or one prompt with n > 1, which SGLang
    0.5.23 turns into a batch of one (`GenerateReqInput._handle_parallel_sampling`)."""
    sp = req.sampling_params
    first = sp[0] if isinstance(sp, list) and sp else sp
    n = first.get("n") if isinstance(first, dict) else None
    return is_batch or (isinstance(n, int) and not isinstance(n, bool) and n > 1)


def _is_per_prompt_list(name: str, value: Any) -> bool:
    """Whether `value` of field `name` is its per-prompt list form."""
    if name == "token_ids_logprob":
        return isinstance(value, list) and bool(value) and isinstance(value[0], list)
    return isinstance(value, list)


def _expand(req: GenerateRequest, think_end_ids: tuple[int, ...] = ()) -> tuple[list[GenerateInput], bool, str]:
    """The prompts of a request as `GenerateInput`s (their sampling params built once, here: the one check
    of their JSON types), whether it is a batch, and the name of its prompt field. `think_end_ids`: a grammar
    applies after these tokens (`require_reasoning`).

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
    given = {name: getattr(req, name) for name in PER_PROMPT_FIELDS}
    given["rid"] = [f"{req.rid}_{i}" for i in range(num)] if is_batch and isinstance(req.rid, str) else req.rid
    given["sampling_params"] = req.sampling_params or {}
    given["token_ids_logprob"] = req.token_ids_logprob or []
    if not _takes_lists(req, is_batch):
        for name, v in given.items():
            if _is_per_prompt_list(name, v):
                hint = ("must be a list of ids for a single prompt" if name == "token_ids_logprob" else
                        "must not be a list for a single prompt (one prompt with n > 1 takes a list of one, as a batch of one)")
                raise APIError(f"{name} {hint}", 400, param=name, code="invalid_value")
    cols = {name: _per_prompt(name, v, num, not _is_per_prompt_list(name, v)) for name, v in given.items()}
    first_of: dict[Any, int] = {}
    for i, r in enumerate(cols["rid"]):
        if r is not None and first_of.setdefault(r, i) != i:
            raise APIError(f"rid[{i}] {r!r} repeats rid[{first_of[r]}]: the prompts of a batch need different rids",
                           400, param=f"rid[{i}]", code="invalid_value")
    in_list = isinstance(req.sampling_params, list)
    return ([GenerateInput(
        prompt, _sampling_params_of(cols["sampling_params"][i], i if in_list else None), rid=cols["rid"][i],
        return_logprob=cols["return_logprob"][i],
        top_logprobs_num=cols["top_logprobs_num"][i] if cols["return_logprob"][i] else 0,
        logprob_start_len=cols["logprob_start_len"][i],
        token_ids_logprob=cols["token_ids_logprob"][i] if cols["return_logprob"][i] else [],
        namespace=None if cols["cache_salt"][i] is None and cols["extra_key"][i] is None
        else (cols["cache_salt"][i], cols["extra_key"][i]),
        think_end_ids=think_end_ids, lora_path=cols["lora_path"][i],
    ) for i, prompt in enumerate(prompts)], is_batch, field)


def sampling_param_path(name: str, index: int | None) -> str:
    """The `param` of an error in a sampling field of /generate: `sampling_params.top_p`, or
    `sampling_params[1].top_p` in the second entry of a list of them."""
    return f"sampling_params.{name}" if index is None else f"sampling_params[{index}].{name}"


def _in_sampling_params(e: APIError, index: int | None) -> APIError:
    """`e`, a 400 about a sampling field, with `param` the field's path (`sampling_param_path`)."""
    if e.param is not None:
        e.param = sampling_param_path(e.param, index)
    return e


def _sampling_params_of(params: dict[str, Any], index: int | None) -> SamplingParams:
    """One `sampling_params` object as `SamplingParams` (`from_dict`: unknown fields and JSON types); a
    refusal names the field's path."""
    try:
        return SamplingParams.from_dict(params)
    except SamplingParamsError as e:
        raise _in_sampling_params(from_engine_error(e), index) from None


def _parse(body: dict[str, Any], skip_tokenizer_init: bool = False) -> GenerateRequest:
    """Validate a /generate body: SGLang's fields through the field table (the request's and each
    `sampling_params` object's accepted non-implemented fields dropped), then the request model. With
    `--skip-tokenizer-init` a text prompt is a 400 naming `text` (SGLang refuses text then)."""
    body = check_request(body)
    check_request_id(body.get("rid"))
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        body["sampling_params"] = [_check_field_table(x, i) for i, x in enumerate(sp)]
    else:
        body["sampling_params"] = _check_field_table(sp, None)
    req = GenerateRequest.model_validate(body)
    if skip_tokenizer_init and req.text is not None:
        raise APIError("text: the server runs with --skip-tokenizer-init, so prompts must be input_ids (token ids)",
                       400, param="text", code="invalid_value")
    return req


def _check_field_table(params: Any, index: int | None) -> Any:
    """One `sampling_params` object through SGLang's field table (`check_sampling_params`)."""
    if not isinstance(params, dict):
        return params  # the request model names a non-object
    try:
        return check_sampling_params(params)
    except APIError as e:
        raise _in_sampling_params(e, index) from None


@dataclasses.dataclass(frozen=True)
class _Sequence:
    """What the response needs of one submitted sequence: its stream interval in tokens, its
    prompt's token ids when `return_prompt_token_ids` asked for them, and its logprob keys (None:
    no logprobs asked for)."""

    stream_interval: int
    prompt_token_ids: list[int] | None
    logprobs: LogprobKeys | None = None


def _submit(group: RequestGroup, req: GenerateRequest, prompts: list[GenerateInput], field: str,
            checker: RequestChecker, is_batch: bool = False) -> dict[str, _Sequence]:
    """Check every prompt (`RequestChecker.check`), then submit them; returns what the response needs of
    each sequence, by rid. A bad prompt refuses the whole batch before any of it runs, named with its index
    (`text[1]`), as a bad `sampling_params[1]` is."""
    rename = {"prompt": field, "input_ids": field}
    sequences: dict[str, _Sequence] = {}
    num_checked: list[int] = [0]  # prompts checked: the next one is the bad one
    is_reserved = False  # an error before it is the whole batch's (queue room), not one prompt's
    try:
        with group.reserved(sum(_num_sequences(p.sampling_params) for p in prompts), field):
            is_reserved = True
            _submit_each(group, req, prompts, checker, sequences, num_checked)
    except (SamplingParamsError, RequestError) as e:
        group.abort()  # a batch refused by the queue or a rid in use after some prompts were submitted
        err = from_engine_error(e, rename)
        if isinstance(e, SamplingParamsError) or e.field in SAMPLING_FIELD_NAMES:
            index = num_checked[0] if isinstance(req.sampling_params, list) else None
            err = _in_sampling_params(err, index)
        elif is_batch and is_reserved and (err.param == field or _given_per_prompt(req, err.param)):
            err.param = f"{err.param}[{num_checked[0]}]"
        raise err from None
    except BaseException:
        group.abort()
        raise
    return sequences


def _given_per_prompt(req: GenerateRequest, name: str | None) -> bool:
    """Whether the batch gave `name` as a list of per-prompt values (then an error in it is named with
    the prompt's index, `logprob_start_len[1]`)."""
    return name in PER_PROMPT_FIELDS and _is_per_prompt_list(name, getattr(req, name, None))


def _num_sequences(params: SamplingParams) -> int:
    """The sequences a prompt will submit (its `n`; an invalid n counts 1 and its submit refuses it)."""
    n = params.n
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1


def _submit_each(group: RequestGroup, req: GenerateRequest, prompts: list[GenerateInput], checker: RequestChecker,
                 sequences: dict[str, _Sequence], num_checked: list[int]) -> None:
    """Check the prompts in order, counting them in `num_checked[0]`, then submit them into the group's
    reservation, recording each sequence in `sequences`."""
    checked = []
    for p in prompts:
        checked.append(checker.check(p))
        num_checked[0] += 1
    for c in checked:
        p = c.request
        rids = group.submit(c)
        seq = _Sequence(p.sampling_params.stream_interval or 1,
                        c.input_ids if req.return_prompt_token_ids else None,  # its ids, as the engine got them
                        LogprobKeys(p.top_logprobs_num > 0, bool(p.token_ids_logprob)) if p.return_logprob else None)
        sequences.update(dict.fromkeys(rids, seq))


def to_output(
    out: StepOutput, tokenizer: Any, with_text: bool, index: int | None = None, prompt_token_ids: list[int] | None = None,
    logprobs: LogprobKeys | None = None, with_output_text: bool = True,
) -> dict[str, Any]:
    """A StepOutput as SGLang's output dict: its meta_info from the engine's one builder (`outputs.meta_info`;
    `logprobs` says which logprob keys it has, None: none; `with_text` puts each token's text in its
    logprob triples); `prompt_token_ids` (SGLang's `return_prompt_token_ids`) is added at the top level
    when given. `with_output_text` False (`--skip-tokenizer-init`) leaves `text` out, as SGLang's outputs
    have only output_ids and meta_info then."""
    token_text = (lambda t: tokenizer.decode([t])) if with_text else None
    result: dict[str, Any] = {"text": out.text, "output_ids": out.output_ids,
                              "meta_info": meta_info(out.meta, logprobs, token_text)}
    if index is not None:
        result["index"] = index
    if not with_output_text:
        del result["text"]
    if prompt_token_ids is not None:
        result["prompt_token_ids"] = prompt_token_ids
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
        tuple(engine_loop.engine.tokenizer.encode(fmt.think_end, add_special_tokens=False))
    prompts, is_batch, field = _expand(req, think_end_ids)
    group = RequestGroup(engine_loop)
    sequences = await preprocess(request, lambda: _submit(group, req, prompts, field, engine_loop.engine.checker, is_batch))
    if not req.log_metrics:
        mark_unlogged(request, group.rids)
    tokenizer = engine_loop.engine.tokenizer
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
