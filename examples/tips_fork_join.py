"""Fork and join: expand several tips in parallel branches that share the prompt, then summarise
(SGLang's tip_suggestion example). The branches share the prompt's KV cache through the radix tree.

    python examples/tips_fork_join.py --width 4
    python examples/tips_fork_join.py --url http://127.0.0.1:30000 --width 16
"""

from __future__ import annotations

import argparse
import time

from jaxserve.lang import function, gen, set_default_backend

TIPS = [
    "Balanced diet", "Regular exercise", "Enough sleep", "Drink water", "Manage stress", "Limit sugar",
    "Walk every day", "Stretch in the morning", "Eat vegetables", "See friends", "Take breaks from screens",
    "Get sunlight", "Cook at home", "Avoid smoking", "Read before bed", "Keep a routine",
]

PREAMBLE = (
    "You are a careful health writer. Your readers are busy office workers who want advice they can "
    "follow today, without special equipment, expensive food or a gym membership. Every piece of advice "
    "must be concrete: say what to do, when to do it and for how long. Avoid medical claims, avoid "
    "jargon, and never recommend supplements or products. Keep each paragraph to two or three plain "
    "sentences, written in the second person, friendly but not chatty. Do not repeat the title of the "
    "tip, do not number sentences, and do not add a conclusion to a paragraph: the summary at the end "
    "ties the tips together. If a tip could be unsafe for some readers, add one short sentence telling "
    "them to ask their doctor first. Write in British English.\n\n"
)


@function
def tips(s, width=2, max_tokens=32):
    titles = TIPS[:width]
    s += PREAMBLE
    s += f"Here are {width} tips for staying healthy: " + "; ".join(f"{i + 1}. {t}" for i, t in enumerate(titles)) + ".\n\n"
    forks = s.fork(width)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i + 1} ({titles[i]}) into a paragraph:\n"
        f += gen("detail", max_tokens=max_tokens, stop="\n\n")
    for i, f in enumerate(forks):
        s += f"Tip {i + 1}:{f['detail']}\n"
    s += "\nIn summary," + gen("summary", max_tokens=max_tokens, stop="\n\n")


def make_backend(url: str | None, api_key: str | None = None, **engine_args):
    """A RuntimeEndpoint for `url`, else the default model in-process (SmolLM2-135M-Instruct)."""
    if url:
        from jaxserve.lang import RuntimeEndpoint

        return RuntimeEndpoint(url, api_key=api_key)
    from jaxserve import Engine
    from jaxserve.lang import EngineBackend

    return EngineBackend(Engine(model_path="default", context_length=2048, disable_precompile=True, **engine_args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a jaxserve/SGLang server; default: run the model in this process")
    parser.add_argument("--api-key", help="the server's --api-key, sent as 'Authorization: Bearer KEY' (with --url)")
    parser.add_argument("--width", type=int, default=4, help=f"number of tips expanded in parallel (1-{len(TIPS)})")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    set_default_backend(make_backend(args.url, args.api_key))
    start = time.perf_counter()
    state = tips.run(width=args.width, max_tokens=args.max_tokens, temperature=0)
    print(state.text()[len(PREAMBLE):])
    print(f"\n[{args.width} branches in {time.perf_counter() - start:.1f} s]")


if __name__ == "__main__":
    main()
