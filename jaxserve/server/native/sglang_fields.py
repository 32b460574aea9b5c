"""SGLang's /generate request schema as data: every field of SGLang 0.5.23's `GenerateReqInput`
(sglang/srt/managers/io_struct.py), every field of its `SamplingParams`
(sglang/srt/sampling/sampling_params.py), the fields sglang-router 0.3.2 adds, and jaxserve's own
extensions, each with how jaxserve handles it.

Handling (`Handling`):
- IMPLEMENTED: the field works as in SGLang.
- METADATA: any value of the right type is accepted; it labels the request and changes nothing here
  (e.g. `routing_key`, `conversation_id`).
- NEUTRAL_ONLY: accepted at its neutral value (null, false, 0, empty, or the listed default); any
  other value is a 400 naming the field (code `unsupported_parameter`).
- REFUSED: a capability jaxserve does not have (images, disaggregation): accepted at its
  neutral value, otherwise a 400 naming the field with the reason.

A field in no row is a 400 too: it is passed on, and `GenerateRequest` (top level) or
`SamplingParams.from_dict` reports it as unknown, so that their hints for common mistakes apply. A new SGLang version is a diff of `REQUEST_FIELDS`
and `SAMPLING_FIELDS`; docs/api.md renders this table (tests/server/native/test_sglang_fields.py keeps the
two equal).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping

from jaxserve.server.errors import APIError


class Handling(enum.Enum):
    IMPLEMENTED = "implemented"
    METADATA = "accepted, no effect"
    NEUTRAL_ONLY = "neutral value only"
    REFUSED = "refused"


@dataclasses.dataclass(frozen=True)
class Field:
    """One row. `neutral`: values besides null that count as neutral (compared with their type, so
    `0` is not `false`); `types`: accepted JSON types of a METADATA field; `note`: the docs' text,
    for REFUSED rows also the 400's reason."""

    name: str
    handling: Handling
    source: str
    note: str = ""
    neutral: tuple[Any, ...] = ()
    types: tuple[type, ...] = ()


_IMPL, _META, _NEUTRAL, _REFUSED = Handling.IMPLEMENTED, Handling.METADATA, Handling.NEUTRAL_ONLY, Handling.REFUSED
_REQ, _SP, _ROUTER, _OURS = "GenerateReqInput", "SamplingParams", "sglang-router", "jaxserve"
_NO_MM = "jaxserve serves text-only models"
_NO_PD = "jaxserve has no prefill-decode disaggregation"
_EMPTY = (False, 0, "", (), frozenset())  # compared as [] and {} too, see `is_neutral`


def _impl(name: str, note: str = "", source: str = _REQ) -> Field:
    return Field(name, _IMPL, source, note)


def _meta(name: str, types: tuple[type, ...], note: str, source: str = _REQ) -> Field:
    return Field(name, _META, source, note, types=types)


def _neutral(name: str, note: str, neutral: tuple[Any, ...] = _EMPTY, source: str = _REQ) -> Field:
    return Field(name, _NEUTRAL, source, note, neutral)


def _refused(name: str, note: str, neutral: tuple[Any, ...] = _EMPTY, source: str = _REQ) -> Field:
    return Field(name, _REFUSED, source, note, neutral)


REQUEST_FIELDS: tuple[Field, ...] = (
    _impl("rid", "request id(s), for /abort_request; a batch's string rid becomes `<rid>_<i>`"),
    _meta("session_id", (str,), "a session label; no session state is kept"),
    _impl("text", "the prompt(s)"),
    _impl("input_ids", "token ids instead of text"),
    _refused("input_embeds", "prompts are text or token ids; input embeddings are not supported"),
    _refused("image_data", _NO_MM),
    _refused("video_data", _NO_MM),
    _refused("audio_data", _NO_MM),
    _refused("mm_hashes", _NO_MM),
    _refused("mm_content_hashes", _NO_MM),
    _refused("use_audio_in_video", _NO_MM),
    _refused("video_config", _NO_MM),
    _impl("sampling_params", "an object, or a list of them (one per prompt)"),
    _refused("watermark", "watermarking is not supported"),
    _impl("return_logprob", "output token logprobs in meta_info (one value, or one per prompt)"),
    _impl("logprob_start_len", "prompt logprobs from this position on (-1: none; one value, or one per prompt)"),
    _impl("top_logprobs_num", "alternatives per output token and prompt position, 0..20 (one value, or one per prompt)"),
    _impl("token_ids_logprob", "logprobs of these token ids at every output position (and prompt position, with logprob_start_len)"),
    _neutral("return_sampling_mask", "sampling-support masks are not returned"),
    _neutral("sampling_logprobs_mode", "logprobs are of the raw logits only"),
    _impl("return_text_in_logprobs", "token text as the third element of each logprob entry"),
    _neutral("return_flat_raw_top_logprobs", "top logprobs come as nested lists only"),
    _neutral("return_flat_raw_output_top_logprobs", "top logprobs come as nested lists only"),
    _neutral("return_flat_raw_top_logprobs_b64", "top logprobs come as nested lists only"),
    _impl("stream", "server-sent events with cumulative text"),
    _impl("log_metrics", "false: the request is left out of the sglang:* request metrics"),
    _neutral("return_hidden_states", "hidden states are not returned"),
    _neutral("return_routed_experts", "no mixture-of-experts models"),
    _neutral("routed_experts_start_len", "no mixture-of-experts models"),
    _neutral("return_indexer_topk", "no sparse-attention indexer"),
    _refused("modalities", _NO_MM),
    _refused("session_params", "no sessions (continual prompting)"),
    _impl("lora_path", "a loaded LoRA adapter's name (one, or one per prompt; null: the base model); needs --enable-lora"),
    _neutral("lora_id", "SGLang-internal (the id of a loaded adapter); give lora_path"),
    _refused("custom_logit_processor", "custom logit processors are not supported"),
    _refused("positional_embed_overrides", "input embeddings are not supported"),
    _refused("bootstrap_host", _NO_PD),
    _refused("bootstrap_port", _NO_PD),
    _refused("bootstrap_room", _NO_PD),
    _refused("bootstrap_pair_key", _NO_PD),
    _refused("decode_tp_size", _NO_PD),
    _neutral("routed_dp_rank", "one data-parallel rank (0) per server; run more behind sglang-router"),
    _neutral("data_parallel_rank", "one data-parallel rank (0) per server; run more behind sglang-router"),
    _refused("disagg_prefill_dp_rank", _NO_PD),
    _meta("routing_key", (str,), "for a router's routing-key policy; no effect on one server"),
    _meta("conversation_id", (str,), "a tracking label"),
    _neutral("http_worker_ipc", "SGLang-internal (multi-tokenizer mode)"),
    _neutral("background", "no background responses"),
    _impl("require_reasoning", "with --reasoning-parser, a grammar applies only after the reasoning's end (</think>)"),
    _neutral("max_thinking_tokens", "no hybrid reasoning models"),
    _meta("priority", (int,), "no priority scheduling (as SGLang without --enable-priority-scheduling)"),
    _impl("extra_key", "a prefix-cache namespace, as cache_salt (one value, or one per prompt)"),
    _meta("no_logs", (bool,), "jaxserve never logs request contents"),
    _neutral("custom_labels", "no custom metric labels"),
    _neutral("return_bytes", "no image generation"),
    _neutral("return_entropy", "entropies are not returned"),
    _impl("return_prompt_token_ids", "the prompt's token ids as the output's `prompt_token_ids`"),
    _meta("external_trace_header", (dict,), "no tracing"),
    _meta("received_time", (int, float), "SGLang-internal timestamp"),
    _neutral("need_wait_for_mm_inputs", _NO_MM),
    _neutral("num_items_assigned", _NO_MM),
    _neutral("encoder_urls", _NO_MM),
    _refused("max_dynamic_patch", _NO_MM),
    _refused("min_dynamic_patch", _NO_MM),
    _refused("image_max_dynamic_patch", _NO_MM),
    _refused("video_max_dynamic_patch", _NO_MM),
    _refused("images_config", _NO_MM),
    _refused("mm_processor_kwargs", _NO_MM),
    _refused("multi_item_delimiter_indices", "no multi-item scoring"),
    _refused("token_indices_to_pool", "no pooling readout"),
    _impl("cache_salt", "requests share cached prefixes only with the same salt (and extra_key)"),
    _neutral("kv_hints", "no hierarchical-cache storage backends"),
    _meta("model", (str,), "the served model is used whatever the value", source=_ROUTER),
)

SAMPLING_FIELDS: tuple[Field, ...] = (
    _impl("max_new_tokens", source=_SP),
    _impl("stop", source=_SP),
    _impl("stop_token_ids", source=_SP),
    _impl("stop_regex", "a regex (or a list); the text is cut where the match starts", source=_SP),
    _impl("temperature", source=_SP),
    _impl("top_p", source=_SP),
    _impl("top_k", "-1 or any value >= the vocabulary disables it", source=_SP),
    _impl("min_p", source=_SP),
    _impl("frequency_penalty", source=_SP),
    _impl("presence_penalty", source=_SP),
    _impl("repetition_penalty", source=_SP),
    _impl("min_new_tokens", source=_SP),
    _impl("n", source=_SP),
    _neutral("beam_width", "no beam search (null, 0 or 1)", (0, 1), source=_SP),
    _impl("json_schema", source=_SP),
    _impl("regex", source=_SP),
    _impl("ebnf", source=_SP),
    _refused("structural_tag", "structural tags are not supported; use json_schema, regex or ebnf", source=_SP),
    _impl("ignore_eos", source=_SP),
    _impl("skip_special_tokens", source=_SP),
    _impl("spaces_between_special_tokens", "passed to the tokenizer's decode (fast tokenizers ignore it)", source=_SP),
    _impl("no_stop_trim", source=_SP),
    _impl("stream_interval", "a stream event every N tokens (and at the end)", source=_SP),
    _impl("logit_bias", "token id -> bias in [-100, 100]", source=_SP),
    _impl("sampling_seed", "SGLang's name of `seed`", source=_SP),
    _neutral("custom_params", "only read by a custom logit processor", source=_SP),
    _refused("watermark", "watermarking is not supported", source=_SP),
    _neutral("stop_strs", "SGLang-internal (filled from stop)", source=_SP),
    _neutral("stop_regex_strs", "SGLang-internal (filled from stop_regex)", source=_SP),
    _neutral("stop_str_max_len", "SGLang-internal", source=_SP),
    _neutral("stop_regex_max_len", "SGLang-internal", source=_SP),
    _neutral("is_normalized", "SGLang-internal", source=_SP),
    _neutral("ebnf_full_assistant", "SGLang-internal", source=_SP),
    _impl("seed", "the sampling seed; sequence i of n uses seed + i", source=_OURS),
    _impl("choices", "constrain the output to one of these strings", source=_OURS),
)

_REQUEST = {f.name: f for f in REQUEST_FIELDS}
_SAMPLING = {f.name: f for f in SAMPLING_FIELDS}
SAMPLING_FIELD_NAMES = frozenset(_SAMPLING)  # what an error inside sampling_params can name


def is_neutral(field: Field, value: Any) -> bool:
    """Null, a listed neutral value of the same type, an empty list or object, or a list of
    neutral values (a batch's per-prompt `lora_path: [null, null]`)."""
    if value is None:
        return True
    if isinstance(value, (list, dict)):
        return not value or (isinstance(value, list) and all(is_neutral(field, v) for v in value))
    return any(type(value) is type(n) and value == n for n in field.neutral)


def _has_type(field: Field, value: Any) -> bool:
    if isinstance(value, bool):  # JSON true is not a number
        return bool in field.types
    return isinstance(value, field.types)


def _check(fields: Mapping[str, Field], body: Mapping[str, Any]) -> dict[str, Any]:
    kept = {}
    for name, value in body.items():
        field = fields.get(name)
        if field is None or field.handling is Handling.IMPLEMENTED:
            kept[name] = value
        elif field.handling is Handling.METADATA:
            if value is not None and not _has_type(field, value):
                expected = " or ".join(t.__name__ for t in field.types)
                raise APIError(f"{name}: must be {expected}, got {type(value).__name__}", 400, param=name, code="invalid_type")
        elif not is_neutral(field, value):
            raise APIError(f"{name}: {field.note} (got {value!r:.80})", 400, param=name, code="unsupported_parameter")
    return kept


def check_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """A /generate body without its accepted non-implemented fields: each is checked against its row
    and dropped. Implemented and unknown fields are kept (the request model validates them).

    Raises:
        APIError: 400 naming the first field of the wrong type (METADATA) or not neutral
            (NEUTRAL_ONLY, REFUSED).
    """
    return _check(_REQUEST, body)


def check_sampling_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """One `sampling_params` object without its accepted non-implemented fields (as
    `check_request`; `SamplingParams.from_dict` validates the rest).

    Raises:
        APIError: as `check_request`; `param` is the bare field name (/generate prefixes its path).
    """
    return _check(_SAMPLING, params)
