"""Extract a JSON record from free text, constrained by a JSON schema, for a batch of inputs.

    python examples/json_extract.py
    python examples/json_extract.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json

from jaxserve.lang import assistant, function, gen, set_default_backend, user

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}

TEXTS = [
    "Maria is 34 and has lived in Lisbon since she finished university.",
    "At 71, retired teacher John Okafor still cycles around Leeds every morning.",
    "The new intern, Wei, turned 22 last week; she moved to Toronto for the job.",
]


@function
def extract_person(s, text):
    s += user(
        "Extract the person's name, age and city from this text as JSON.\n\n"
        f"Text: {text}\n\nSchema: {json.dumps(PERSON_SCHEMA)}"
    )
    s += assistant(gen("person", max_tokens=64, json_schema=PERSON_SCHEMA))


def make_backend(url: str | None, api_key: str | None = None):
    """A RuntimeEndpoint for `url`, else the default model in-process (SmolLM2-135M-Instruct)."""
    if url:
        from jaxserve.lang import RuntimeEndpoint

        return RuntimeEndpoint(url, api_key=api_key)
    from jaxserve import Engine
    from jaxserve.lang import EngineBackend

    return EngineBackend(Engine(model_path="default", context_length=2048, disable_precompile=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a jaxserve/SGLang server; default: run the model in this process")
    parser.add_argument("--api-key", help="the server's --api-key, sent as 'Authorization: Bearer KEY' (with --url)")
    args = parser.parse_args()
    set_default_backend(make_backend(args.url, args.api_key))
    states = extract_person.run_batch([{"text": t} for t in TEXTS], temperature=0)
    for text, state in zip(TEXTS, states):
        raw = state["person"]
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:  # max_tokens ran out before the object closed
            record = {"unparsed": raw}
        print(f"{text}\n  -> {record}")


if __name__ == "__main__":
    main()
