"""SGLang's /generate schema: the field table against SGLang 0.5.23's own source and docs/api.md, and
each kind of handling through the real (tiny-checkpoint) server."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.server.errors import APIError
from jaxserve.server.native.sglang_fields import (
    REQUEST_FIELDS,
    SAMPLING_FIELDS,
    Handling,
    check_request,
    check_sampling_params,
)
from jaxserve.server.protocol import GenerateRequest

REPO = Path(__file__).resolve().parents[3]
GREEDY = {"max_new_tokens": 6, "temperature": 0}


def sglang_class_fields(relpath: str, class_name: str) -> list[str]:
    """The annotated fields of a class in the installed sglang package, read from its source (the
    modules cannot be imported without SGLang's GPU dependencies)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin, "sglang==0.5.23 (--no-deps) is a test dependency"
    tree = ast.parse((Path(spec.origin).parent / relpath).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]


def test_every_sglang_request_field_has_a_row():
    ours = [f.name for f in REQUEST_FIELDS if f.source == "GenerateReqInput"]
    assert ours == sglang_class_fields("srt/managers/io_struct.py", "GenerateReqInput")


def test_every_sglang_sampling_param_has_a_row():
    ours = [f.name for f in SAMPLING_FIELDS if f.source == "SamplingParams"]
    assert ours == sglang_class_fields("srt/sampling/sampling_params.py", "SamplingParams")


def test_router_fields_are_accepted():
    added_by_router = ["model", "stream", "log_metrics", "return_text_in_logprobs", "return_hidden_states",
                       "background", "no_logs", "return_bytes", "return_entropy"]
    rows = {f.name: f for f in REQUEST_FIELDS}
    assert all(rows[name].handling is not Handling.REFUSED for name in added_by_router)


def test_implemented_rows_are_implemented():
    model_fields = set(GenerateRequest.model_fields)
    assert {f.name for f in REQUEST_FIELDS if f.handling is Handling.IMPLEMENTED} <= model_fields
    params = {f.name for f in dataclasses.fields(SamplingParams)} | {"sampling_seed"}
    implemented = {f.name for f in SAMPLING_FIELDS if f.handling is Handling.IMPLEMENTED}
    assert implemented <= params
    # and nothing the engine implements is missing from the table
    assert params - {"sampling_seed"} <= implemented


def test_docs_table_equals_the_data():
    text = (REPO / "docs" / "api.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| ([\w-]+) \| ([\w ,]+) \| (.*) \|$", text, flags=re.M)
    documented = [(name, source, handling, note) for name, source, handling, note in rows
                  if source in {"GenerateReqInput", "SamplingParams", "sglang-router", "jaxserve"}]
    data = [(f.name, f.source, f.handling.value, f.note) for f in (*REQUEST_FIELDS, *SAMPLING_FIELDS)]
    assert documented == data


NON_NEUTRAL_ROWS = [
    pytest.param(f, check, id=f"{check.__name__}-{f.name}")
    for fields, check in ((REQUEST_FIELDS, check_request), (SAMPLING_FIELDS, check_sampling_params))
    for f in fields if f.handling in (Handling.NEUTRAL_ONLY, Handling.REFUSED)
]


def test_sglang_defaults_are_neutral():
    assert all(check_request({name: False}) == {} for name in ("return_hidden_states", "background", "return_bytes"))


@pytest.mark.parametrize("field, check", NON_NEUTRAL_ROWS)
def test_neutral_values_pass_and_others_are_400s(field, check):
    for neutral in (None, [], {}, [None, None], *field.neutral):
        assert check({field.name: neutral}) == {}
    for value in ("something", 7, True, ["a"], {"k": "v"}):
        if any(type(value) is type(n) and value == n for n in field.neutral):
            continue
        with pytest.raises(APIError) as info:
            check({field.name: value})
        assert info.value.status_code == 400 and info.value.param == field.name
        assert info.value.code == "unsupported_parameter" and field.note in info.value.message


def test_metadata_fields_check_their_type():
    assert check_request({"routing_key": "a", "no_logs": True, "priority": 3, "received_time": 1.5}) == {}
    for body in ({"no_logs": "yes"}, {"priority": True}, {"conversation_id": 3}):
        with pytest.raises(APIError) as info:
            check_request(body)
        assert info.value.param == next(iter(body)) and info.value.code == "invalid_type"


def test_unknown_and_implemented_fields_pass_through():
    body = {"text": "x", "not_a_field": 1, "lora_id": None}
    assert check_request(body) == {"text": "x", "not_a_field": 1}
    assert check_sampling_params({"temperature": 0, "bogus": 1, "custom_params": {}}) == {"temperature": 0, "bogus": 1}


# ---- through the server ---------------------------------------------------------------------------
def post(http, body):
    return http.post("/generate", json=body)


def test_all_neutral_values_in_one_request_match_a_plain_one(http):
    neutral_req = {f.name: None for f in REQUEST_FIELDS if f.handling is not Handling.IMPLEMENTED}
    neutral_sp = {f.name: None for f in SAMPLING_FIELDS if f.handling is not Handling.IMPLEMENTED}
    neutral_req.update(log_metrics=True, return_hidden_states=False, background=False, model="whatever",
                       lora_path=None, return_routed_experts=False, data_parallel_rank=0, session_id="s1")
    neutral_sp.update(spaces_between_special_tokens=True, custom_params={}, beam_width=1, stop_str_max_len=0)
    plain = post(http, {"text": "Hello there", "sampling_params": GREEDY})
    full = post(http, {**neutral_req, "text": "Hello there", "sampling_params": {**GREEDY, **neutral_sp}})
    assert plain.status_code == full.status_code == 200, full.text
    assert full.json()["output_ids"] == plain.json()["output_ids"]


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"image_data": "http://x/cat.png"}, "image_data", "unsupported_parameter"),
        ({"lora_id": "adapter-1"}, "lora_id", "unsupported_parameter"),
        ({"return_hidden_states": True}, "return_hidden_states", "unsupported_parameter"),
        ({"sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag", "unsupported_parameter"),
        ({"sampling_params": {"beam_width": 4}}, "sampling_params.beam_width", "unsupported_parameter"),
        ({"no_such_field": 1}, "no_such_field", "unknown_parameter"),
        ({"sampling_params": {"no_such_param": 1}}, "sampling_params.no_such_param", "unknown_parameter"),
        ({"sampling_params": {"stop_regex": "("}}, "sampling_params.stop_regex", "invalid_value"),
        ({"sampling_params": {"stop_regex": "a*"}}, "sampling_params.stop_regex", "invalid_value"),
        ({"sampling_params": {"stream_interval": 0}}, "sampling_params.stream_interval", "invalid_value"),
        ({"sampling_params": {"sampling_seed": 1, "seed": 2}}, "sampling_params.sampling_seed", "invalid_value"),
        ({"sampling_params": {"spaces_between_special_tokens": "no"}}, "sampling_params.spaces_between_special_tokens", "invalid_type"),
        ({"return_logprob": True, "token_ids_logprob": [10**6]}, "token_ids_logprob", "invalid_value"),
    ],
)
def test_refusals_are_400s_naming_the_field(http, body, param, code):
    r = post(http, {"text": "Hi", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err


def test_stop_regex_stops_and_trims(http, default_tokenizer):
    plain = post(http, {"text": "Count: 1 2 3", "sampling_params": {"max_new_tokens": 24, "temperature": 0}}).json()
    text = plain["text"]
    assert len(text) > 4
    pattern = re.escape(text[2:4])  # something the greedy output is known to contain
    r = post(http, {"text": "Count: 1 2 3", "sampling_params": {"max_new_tokens": 24, "temperature": 0, "stop_regex": [pattern]}})
    out = r.json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert out["text"] == text[: re.search(pattern, text).start()]
    assert plain["output_ids"][: len(out["output_ids"])] == out["output_ids"]


def test_sampling_seed_is_the_seed(http):
    params = {"max_new_tokens": 8, "temperature": 1.0}
    by_seed = post(http, {"text": "Once", "sampling_params": {**params, "seed": 1234}}).json()
    by_alias = post(http, {"text": "Once", "sampling_params": {**params, "sampling_seed": 1234}}).json()
    other = post(http, {"text": "Once", "sampling_params": {**params, "sampling_seed": 99}}).json()
    assert by_alias["output_ids"] == by_seed["output_ids"] != other["output_ids"]


def stream_events(http, body) -> list[dict]:
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_stream_interval_sends_every_nth_token(http):
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    every = stream_events(http, {"text": "Stream me", "sampling_params": params})
    third = stream_events(http, {"text": "Stream me", "sampling_params": {**params, "stream_interval": 3}})
    counts = [e["meta_info"]["completion_tokens"] for e in third]
    assert counts == [3, 6, 9, 10]
    assert third[-1]["text"] == every[-1]["text"] and third[-1]["output_ids"] == every[-1]["output_ids"]
    assert len(every) == 10


def test_token_ids_logprob_over_http(http):
    watched = [5, 100, 2000]
    r = post(http, {"text": "Hello", "sampling_params": {**GREEDY, "max_new_tokens": 3}, "return_logprob": True,
                    "return_text_in_logprobs": True, "top_logprobs_num": 1, "token_ids_logprob": watched})
    meta = r.json()["meta_info"]
    picked = meta["output_token_ids_logprobs"]
    assert len(picked) == 3 and all([e[1] for e in row] == watched for row in picked)
    assert all(isinstance(e[2], str) and e[0] <= 0 for row in picked for e in row)
    # the greedy token is the most likely one: no watched id beats its logprob
    for row, top in zip(picked, meta["output_top_logprobs"]):
        assert max(e[0] for e in row) <= top[0][0] + 1e-6


def test_per_prompt_logprob_fields_and_a_batch_rid_prefix(http):
    body = {"text": ["first prompt", "second prompt"], "sampling_params": {**GREEDY, "max_new_tokens": 2},
            "rid": "batch-7", "return_logprob": [True, False], "top_logprobs_num": [2, 0],
            "token_ids_logprob": [[5, 6], []]}
    first, second = post(http, body).json()
    assert [first["meta_info"]["id"], second["meta_info"]["id"]] == ["batch-7_0", "batch-7_1"]
    assert len(first["meta_info"]["output_top_logprobs"][0]) == 2
    assert [e[1] for e in first["meta_info"]["output_token_ids_logprobs"][0]] == [5, 6]
    assert "output_token_logprobs" not in second["meta_info"]
    bad = post(http, {**body, "return_logprob": [True]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_logprob"
    single = post(http, {"text": "one", "return_logprob": [True]})
    assert single.status_code == 400 and single.json()["error"]["param"] == "return_logprob"


def test_one_prompt_takes_lists_only_with_n_above_1_as_sglang(http):
    # SGLang 0.5.23 fails on a list of sampling_params for one prompt (it was accepted here, while
    # return_logprob: [true] was a 400); with n > 1 it makes the prompt a batch of one, lists included
    single = post(http, {"text": "one", "sampling_params": [{"max_new_tokens": 1}]})
    assert single.status_code == 400 and single.json()["error"]["param"] == "sampling_params", single.text
    body = {"text": "one", "sampling_params": [{**GREEDY, "max_new_tokens": 2, "n": 2}], "return_logprob": [True],
            "top_logprobs_num": [1]}
    outs = post(http, body).json()
    assert len(outs) == 2 and all(len(o["meta_info"]["output_top_logprobs"]) == 2 for o in outs), outs


def test_top_logprobs_num_without_return_logprob_returns_no_logprobs(http):
    # SGLang ignores top_logprobs_num and token_ids_logprob without return_logprob; they returned logprobs here
    out = post(http, {"text": "one", "sampling_params": {**GREEDY, "max_new_tokens": 2}, "top_logprobs_num": 2,
                      "token_ids_logprob": [5]}).json()
    assert not [k for k in out["meta_info"] if "logprob" in k], out["meta_info"]
    asked = post(http, {"text": "one", "sampling_params": {**GREEDY, "max_new_tokens": 2}, "top_logprobs_num": 2,
                        "return_logprob": True}).json()
    assert len(asked["meta_info"]["output_top_logprobs"][0]) == 2


def test_cache_salt_separates_cached_prefixes(http):
    prompt = "A long shared prefix for the cache-salt test, " * 4  # several pages of tokens
    params = {"max_new_tokens": 1, "temperature": 0}

    def cached(**fields) -> int:
        r = post(http, {"text": prompt, "sampling_params": params, **fields})
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    cached(cache_salt="tenant-a")
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-a", extra_key="k1") == 0
    assert cached(cache_salt="tenant-a", extra_key="k1") > 0
    plain = [cached(), cached()]
    assert plain[1] > 0
    assert cached(cache_salt="tenant-c") == 0


def test_return_prompt_token_ids(http, default_tokenizer):
    out = post(http, {"text": "Prompt ids please", "sampling_params": GREEDY, "return_prompt_token_ids": True}).json()
    assert out["prompt_token_ids"] == default_tokenizer.encode("Prompt ids please", add_special_tokens=False)
    assert "prompt_token_ids" not in post(http, {"text": "Prompt ids please", "sampling_params": GREEDY}).json()
    events = stream_events(http, {"input_ids": [5, 6, 7], "sampling_params": GREEDY, "return_prompt_token_ids": True})
    assert all(e["prompt_token_ids"] == [5, 6, 7] for e in events)
