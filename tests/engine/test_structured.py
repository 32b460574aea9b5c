"""Structured generation end to end on the default model (SmolLM2-135M-Instruct).

Regexes, JSON schemas and choices constrain real outputs (checked with `re` and `jsonschema`), mixed
batches of constrained and unconstrained requests stay batch invariant, jump-forward changes only the
number of sampled tokens, and invalid grammars fail at submit time or abort just their own request.

The default model decodes ~10 tokens/s per sequence on a loaded 2-core CPU, so requests are batched
together and kept short (strings bounded by maxLength, arrays by maxItems).
"""

from __future__ import annotations

import contextlib
import json
import re

import jsonschema
import pytest

from jaxserve.core.errors import RequestError, SamplingParamsError
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.engine import Engine
from jaxserve.engine.request_input import GenerateInput
from jaxserve.engine.validation.check import CheckedInput
from tests.constrained.random_walk import max_structural_whitespace_run

pytestmark = pytest.mark.slow

REPLACEMENT_CHAR = "\ufffd"
# llguidance allows one line break and up to 16 spaces or tabs between JSON tokens by default
# (DEFAULT_JSON_WHITESPACE_PATTERN); 20 leaves room for that and catches a model running on in blanks.
MAX_WHITESPACE_RUN = 20


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        model_path="default", max_total_tokens=16384, max_running_requests=32, chunked_prefill_size=256,
        context_length=1024, disable_precompile=True,
    )


def chat(engine: Engine, message: str) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )


longest_whitespace_run_outside_strings = max_structural_whitespace_run


@contextlib.contextmanager
def jump_forward_disabled(engine: Engine):
    engine.processor.disable_jump_forward = True  # --disable-jump-forward, without a new engine
    try:
        yield
    finally:
        engine.processor.disable_jump_forward = engine.args.disable_jump_forward


# ---- regex ---------------------------------------------------------------------------------------

OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
REGEX_CASES = [
    (rf"({OCTET}\.){{3}}{OCTET}", "What is the IP address of the local DNS server?"),
    (r"\d{4}-\d{2}-\d{2}", "When did the Berlin wall fall? Answer with a date."),
    ("(café|naïve|über)", "Give me a loanword used in English."),
    ("[a-zà-ÿ]{3,8}", "Say a French word."),
    (r"\(\d{3}\) \d{3}-\d{4}", "What is the phone number of the White House?"),
]


def test_regexes_fullmatch(engine):
    prompts = [chat(engine, message) for _, message in REGEX_CASES]
    params = [{"regex": pattern, "max_new_tokens": 32, "temperature": 0} for pattern, _ in REGEX_CASES]
    outs = engine.generate(prompts, params)
    for (pattern, _), out in zip(REGEX_CASES, outs):
        text = out["text"]
        assert re.fullmatch(pattern, text), (pattern, text)
        assert REPLACEMENT_CHAR not in text, (pattern, text)
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (pattern, out["meta_info"])
        # SGLang's FINISH_MATCHED_TOKEN(matched=output_ids[-1]) when the grammar ends the output
        assert out["meta_info"]["finish_reason"]["matched"] == out["output_ids"][-1], (pattern, out["meta_info"])


# ---- JSON schema ---------------------------------------------------------------------------------

ADDRESS_SCHEMA = {
    "type": "object",
    "$defs": {
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 16}, "city": {"type": "string", "maxLength": 12}},
            "required": ["street", "city"],
            "additionalProperties": False,
        }
    },
    "properties": {"name": {"type": "string", "maxLength": 16}, "home": {"$ref": "#/$defs/address"}},
    "required": ["name", "home"],
    "additionalProperties": False,
}
ENUM_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["small", "medium", "large"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["color", "size", "count"],
    "additionalProperties": False,
}
PATTERN_SCHEMA = {
    "type": "object",
    "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    },
    "required": ["zip", "code"],
    "additionalProperties": False,
}
ARRAY_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
ANY_OBJECT_SCHEMA = {"type": "object"}

# (schema, user message, temperature, seed). `{"type": "object"}` bounds nothing, so its prompts ask for
# small objects (the model's greedy and seeded outputs for these finish within 40 tokens).
JSON_CASES = [
    (ADDRESS_SCHEMA, "Describe a person and where they live as JSON.", 0.0, None),
    (ADDRESS_SCHEMA, "Give the name and home address of a fictional detective in JSON.", 0.7, 1),
    (ADDRESS_SCHEMA, "JSON for a customer record with a home address.", 0.0, None),
    (ADDRESS_SCHEMA, "Invent a character and their address. Reply in JSON.", 0.7, 2),
    (ADDRESS_SCHEMA, "Where does Santa Claus live? Answer as JSON.", 0.7, 3),
    (ENUM_SCHEMA, "Describe a t-shirt as JSON.", 0.0, None),
    (ENUM_SCHEMA, "Pick a color, a size and a count for an order, as JSON.", 0.7, 4),
    (ENUM_SCHEMA, "JSON please: the color and size of the sky.", 0.0, None),
    (ENUM_SCHEMA, "Describe a box of apples in JSON.", 0.7, 5),
    (PATTERN_SCHEMA, "Give a US zip code and a product code as JSON.", 0.0, None),
    (PATTERN_SCHEMA, "What is the zip code of Beverly Hills? Reply in JSON.", 0.7, 6),
    (PATTERN_SCHEMA, "Make up a shipping label in JSON.", 0.0, None),
    (PATTERN_SCHEMA, "Output a JSON record with zip and code.", 0.7, 7),
    (ARRAY_SCHEMA, "List some groceries with quantities as JSON.", 0.0, None),
    (ARRAY_SCHEMA, "What do I need to bake a cake? Answer as JSON.", 0.7, 8),
    (ARRAY_SCHEMA, "Inventory of a small shop in JSON.", 0.0, None),
    (ARRAY_SCHEMA, "List fruits and how many as JSON.", 0.7, 9),
    (ANY_OBJECT_SCHEMA, "Return a JSON object for a book: title and year.", 0.0, None),
    (ANY_OBJECT_SCHEMA, "Return a JSON object for a book: title and year.", 0.7, 7),
    (ANY_OBJECT_SCHEMA, "A JSON object mapping 'a' to 1 and 'b' to 2.", 0.0, None),
    (ANY_OBJECT_SCHEMA, "A JSON object mapping 'a' to 1 and 'b' to 2.", 0.7, 7),
]


def test_json_schemas_validate(engine):
    assert len(JSON_CASES) > 20
    prompts = [chat(engine, message) for _, message, _, _ in JSON_CASES]
    params = [
        {"json_schema": json.dumps(schema), "max_new_tokens": 80, "temperature": temperature, "seed": seed}
        for schema, _, temperature, seed in JSON_CASES
    ]
    outs = engine.generate(prompts, params)
    for (schema, message, temperature, _), out in zip(JSON_CASES, outs):
        text, meta = out["text"], out["meta_info"]
        case = (message, temperature, text)
        assert meta["finish_reason"]["type"] == "stop", (case, meta["finish_reason"])
        jsonschema.validate(json.loads(text), schema)
        assert REPLACEMENT_CHAR not in text, case
        assert longest_whitespace_run_outside_strings(text) <= MAX_WHITESPACE_RUN, case


def test_whitespace_run_counter():
    assert longest_whitespace_run_outside_strings('{"a": "x          y",\n   "b": 1}') == 4
    assert longest_whitespace_run_outside_strings('{"a\\"   ": 1}') == 1
    assert longest_whitespace_run_outside_strings("{" + " " * 25 + "}") == 25


# ---- batching ------------------------------------------------------------------------------------


def test_mixed_batch_matches_solo_runs(engine):
    """4 constrained + 4 unconstrained greedy requests: each gives the same tokens alone and together."""
    constraints = [
        {"regex": r"\d{4}-\d{2}-\d{2}"},
        {"choices": ["Paris", "London", "Berlin", "Madrid"]},
        {"json_schema": json.dumps(ENUM_SCHEMA)},
        {"regex": r"\(\d{3}\) \d{3}-\d{4}"},
    ]
    messages = [
        "When was the first moon landing?", "What is the capital of France?", "Describe a t-shirt as JSON.",
        "Give me a phone number.", "Write a haiku about the sea.", "What is 2 + 2?",
        "Name three colors.", "Tell me a joke.",
    ]
    prompts = [chat(engine, m) for m in messages]
    params = [{**c, "max_new_tokens": 8, "temperature": 0} for c in constraints] + [
        {"max_new_tokens": 8, "temperature": 0}
    ] * 4
    solo = [engine.generate(p, sp) for p, sp in zip(prompts, params)]
    together = engine.generate(prompts, params)
    for message, alone, batched in zip(messages, solo, together):
        assert batched["output_ids"] == alone["output_ids"], (message, alone["text"], batched["text"])
        assert batched["meta_info"]["finish_reason"] == alone["meta_info"]["finish_reason"], message


# ---- choices -------------------------------------------------------------------------------------


def test_choices(engine):
    cases = [
        (["yes", "no"], "Is the sky blue?"),
        (["New York", "New Delhi", "Newcastle", "Nairobi"], "Which city is the capital of India?"),
        (["positive", "negative", "neutral"], "Sentiment of 'I love this movie!'"),
        (["🍎 apple", "🍌 banana", "café au lait"], "What do you want for breakfast?"),
    ]
    prompts = [chat(engine, message) for _, message in cases]
    params = [{"choices": choices, "max_new_tokens": 16, "temperature": 0} for choices, _ in cases]
    outs = engine.generate(prompts, params)
    for (choices, _), out in zip(cases, outs):
        assert out["text"] in choices, (choices, out["text"])
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": out["output_ids"][-1]}, out["meta_info"]


def test_choices_seeded_sampling_stays_in_choices(engine):
    choices = ["red", "green", "blue", "yellow"]
    prompts = [chat(engine, "Pick a color.")] * 4
    params = [{"choices": choices, "max_new_tokens": 8, "temperature": 1.0, "seed": s} for s in range(4)]
    for out in engine.generate(prompts, params):
        assert out["text"] in choices, out["text"]


# ---- jump-forward --------------------------------------------------------------------------------

LONG_KEYS_SCHEMA = {
    "type": "object",
    "properties": {
        "the_customer_full_name": {"type": "string", "maxLength": 16},
        "the_customer_shipping_address_line": {"type": "string", "maxLength": 20},
    },
    "required": ["the_customer_full_name", "the_customer_shipping_address_line"],
    "additionalProperties": False,
}


def _finished(engine, prompts, params, **fields) -> list:
    """The final `StepOutput` of each prompt (their `meta` counts the forced tokens), in order."""
    rids = [engine.add_request(p, params, **fields)[0] for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.rid: o for o in engine.step() if o.finished})
    return [done[r] for r in rids]


def test_jump_forward_equals_sampling_every_token(engine):
    messages = ["Create a customer record as JSON.", "A JSON order record for Ada Lovelace."]
    prompts = [chat(engine, m) for m in messages]
    params = {"json_schema": json.dumps(LONG_KEYS_SCHEMA), "max_new_tokens": 80, "temperature": 0}
    with_jump = _finished(engine, prompts, params)
    with jump_forward_disabled(engine):
        without_jump = _finished(engine, prompts, params)
    for message, fast, slow in zip(messages, with_jump, without_jump):
        assert fast.text == slow.text, (message, fast.text, slow.text)
        jsonschema.validate(json.loads(fast.text), LONG_KEYS_SCHEMA)
        assert slow.meta.num_forced_tokens == 0
        assert fast.meta.num_forced_tokens > 0, fast.meta
        num_sampled = fast.meta.completion_tokens - fast.meta.num_forced_tokens
        assert num_sampled < slow.meta.completion_tokens, (fast.meta, slow.meta)


def test_constrained_logprobs_align_with_output_ids(engine):
    """Forced tokens have no logprobs, so a request that returns logprobs samples every token: one
    (logprob, token) pair per output token, and the same output as with jump-forward."""
    prompt = chat(engine, "Create a customer record as JSON.")
    params = {"json_schema": json.dumps(LONG_KEYS_SCHEMA), "max_new_tokens": 80, "temperature": 0}
    (plain,) = _finished(engine, [prompt], params)
    (with_logprobs,) = _finished(engine, [prompt], params, return_logprob=True)
    meta = with_logprobs.meta
    assert with_logprobs.output_ids == plain.output_ids
    assert meta.num_forced_tokens == 0
    assert [t for _, t in meta.output_token_logprobs] == with_logprobs.output_ids
    assert all(lp <= 0 for lp, _ in meta.output_token_logprobs)


# ---- invalid input -------------------------------------------------------------------------------


def test_the_check_rejects_an_invalid_regex(engine):
    with pytest.raises(RequestError, match=r"(?s)invalid regex.*unclosed group") as info:
        engine.checker.check(GenerateInput("Hello", SamplingParams(regex="(ab")))
    assert info.value.field == "regex"


@pytest.mark.parametrize(
    "schema,problem",
    [
        ("{not json", "not valid JSON"),
        ('{"type": "objekt"}', "objekt"),
        ('{"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}', "missing"),
        ("[1, 2]", "expected a JSON object"),
    ],
    ids=["not-json", "bad-type", "dangling-ref", "not-an-object"],
)
def test_the_check_rejects_an_invalid_json_schema(engine, schema, problem):
    with pytest.raises(RequestError, match=re.escape(problem)) as info:
        engine.checker.check(GenerateInput("Hello", SamplingParams(json_schema=schema)))
    assert "JSON schema" in str(info.value) and info.value.field == "json_schema"


def test_two_constraints_are_a_sampling_params_error(engine):
    both = {"regex": "[a-z]+", "json_schema": json.dumps(ENUM_SCHEMA), "max_new_tokens": 4}
    with pytest.raises(SamplingParamsError, match="only one of") as info:
        SamplingParams.from_dict(both).validate()
    assert info.value.field == "json_schema"
    with pytest.raises(SamplingParamsError):
        engine.add_request(chat(engine, "Hello"), both)
    assert not engine.has_unfinished()


def test_invalid_grammar_through_add_request_is_refused_and_the_engine_serves_on(engine):
    """In process, an invalid grammar is refused by the request's one check (naming the field); a checked
    request whose grammar still fails in the engine's compile queue (one built past the check) ends with an
    abort naming the grammar, and the others are served."""
    with pytest.raises(RequestError, match="unclosed group") as info:
        engine.generate(chat(engine, "Say hi."), {"regex": "(ab", "max_new_tokens": 8, "temperature": 0})
    assert info.value.field == "regex" and not engine.has_unfinished()
    ids = engine.checker.tokenize(chat(engine, "Say hi."), add_special_tokens=False)
    unchecked = CheckedInput(GenerateInput(ids, rid="past-the-check"), ids, SamplingParams(regex="(ab", max_new_tokens=8, temperature=0))
    engine.add_request(unchecked)
    bad = None
    while engine.has_unfinished():
        bad = next((o for o in engine.step() if o.finished), bad)
    reason = bad.meta.finish_reason
    assert reason.kind == "abort" and "grammar" in reason.message and "unclosed group" in reason.message, reason
    good = engine.generate(chat(engine, "What is the date today?"),
                           {"regex": r"\d{4}-\d{2}-\d{2}", "max_new_tokens": 16, "temperature": 0})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", good["text"]), good["text"]
    after = engine.generate(chat(engine, "Is water wet?"), {"choices": ["yes", "no"], "max_new_tokens": 4, "temperature": 0})
    assert after["text"] in ("yes", "no")
    assert not engine.has_unfinished()


def test_text_held_for_a_stop_regex_is_kept_when_the_grammar_ends(engine):
    """Before: a possible stop_regex match held back ("aaaa" could still become "(a|aa)+c") was dropped
    when the grammar ended the request: text "" for output "aaaa..." (a new user's break test)."""
    params = {"regex": "a{3,6}", "max_new_tokens": 8, "temperature": 0, "stop_regex": "(a|aa)+c"}
    (held,) = engine.generate([chat(engine, "Say a.")], [params])
    (plain,) = engine.generate([chat(engine, "Say a.")], [{k: v for k, v in params.items() if k != "stop_regex"}])
    assert held["output_ids"] == plain["output_ids"]
    assert held["text"] == plain["text"] and 3 <= len(held["text"]) <= 6 and set(held["text"]) == {"a"}, held
