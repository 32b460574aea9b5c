"""A multi-turn chat in the model's own chat template (SGLang's multi_turn_question example).

    python examples/multi_turn_chat.py                          # in-process, the default model
    python examples/multi_turn_chat.py --url http://127.0.0.1:30000
    python examples/multi_turn_chat.py --stream                 # print the answers as they are generated
"""

from __future__ import annotations

import argparse

from jaxserve.lang import assistant, function, gen, set_default_backend, system, user


@function
def multi_turn_question(s, question_1, question_2, max_tokens=48):
    s += system("You are a helpful assistant. Answer briefly.")
    s += user(question_1)
    s += assistant(gen("answer_1", max_tokens=max_tokens))
    s += user(question_2)
    s += assistant(gen("answer_2", max_tokens=max_tokens))


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
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    set_default_backend(make_backend(args.url, args.api_key))

    questions = dict(question_1="What is the capital of France?", question_2="Name two places to visit there.")
    if args.stream:
        state = multi_turn_question.run(**questions, temperature=0, stream=True)
        for name in ("answer_1", "answer_2"):
            print(f"{name}: ", end="", flush=True)
            for piece in state.text_iter(name):
                print(piece, end="", flush=True)
            print()
    else:
        state = multi_turn_question.run(**questions, temperature=0)
        for m in state.messages():
            print(f"{m['role']:>9}: {m['content']}")


if __name__ == "__main__":
    main()
