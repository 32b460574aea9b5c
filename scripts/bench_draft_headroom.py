"""How many verification steps better n-gram drafts could save: an upper bound for tree drafts (issue 20).

Runs the default model's greedy plain decoding (no speculation) on the copy-heavy workload (or the
random one) in-process, then replays each request's output as a sequence of verification steps:
at every position the draft is scored against the tokens greedy decoding really produced, a step
emits its accepted draft tokens plus one, and the next step starts after them. Compared per task
(rewrite, code-edit, extract; or random), for drafts of K tokens:

    latest     today's draft: the continuation of the latest longest match of the sequence's own
               suffix (`ngram.ngram_match`);
    best of B  an oracle that picks, after the fact, the best of B distinct candidate drafts: the
               latest one first, then the continuations of every other earlier match of the suffix,
               longest match first. A tree of B branches verifies all of them in one step, so
               `steps` at B is the fewest steps such a tree could take (its steps cost more tokens).

Decoding is greedy, so the replay is exact: a verification accepts a draft prefix if and only if it
equals the output there. Nothing here is timed; the step counts are what matters.

    python scripts/bench_draft_headroom.py [--dataset copy-heavy|random] [--num-prompts 9] [--branches 1 2 4 8]
"""

from __future__ import annotations

import argparse
import collections
import shlex
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_datasets import COPY_HEAVY_TASKS, PromptSampler, sample_copy_heavy_requests, sample_random_requests  # noqa: E402


def candidate_drafts(tokens: Sequence[int], num_draft: int, num_branches: int, max_match_len: int = 18) -> list[list[int]]:
    """Up to `num_branches` distinct drafts of `num_draft` tokens for what follows `tokens`: today's draft
    (`ngram_match`) first, then the continuation after every other earlier occurrence of the last
    token, ordered by the length of the suffix match there (longest first; among equals, the latest
    first). A continuation that runs into the end of `tokens` repeats with its period, as
    `ngram_match` does. Two drafts are distinct when they differ anywhere."""
    from jaxserve.speculative.ngram import ngram_match

    arr = np.asarray(tokens, dtype=np.int64)
    first = ngram_match(arr, num_draft, max_match_len).draft
    if not first:
        return []
    drafts, last = [first], len(arr) - 1
    matches = []
    for end in np.flatnonzero(arr[:last] == arr[last]):
        w = 1
        while w < max_match_len and end - w >= 0 and arr[end - w] == arr[last - w]:
            w += 1
        matches.append((w, int(end)))
    for _, end in sorted(matches, key=lambda m: (-m[0], -m[1])):
        if len(drafts) == num_branches:
            break
        period = last - end
        draft = [int(arr[end + 1 + j % period]) for j in range(num_draft)]
        if draft not in drafts:
            drafts.append(draft)
    return drafts


def accepted(draft: Sequence[int], truth: Sequence[int]) -> int:
    """Draft tokens a greedy verification accepts: the length of the common prefix with `truth`."""
    n = 0
    for a, b in zip(draft, truth):
        if a != b:
            break
        n += 1
    return n


def replay_steps(tokens: Sequence[int], prompt_len: int, num_draft: int, num_branches: int) -> int:
    """Verification steps to emit `tokens[prompt_len:]` when each step verifies the best of
    `candidate_drafts(..., num_branches)` and emits its accepted tokens plus one (a step with no draft
    is a decode step: one token)."""
    pos, steps = prompt_len, 0
    while pos < len(tokens):
        truth = tokens[pos : pos + num_draft]
        best = max((accepted(d, truth) for d in candidate_drafts(tokens[:pos], num_draft, num_branches)), default=0)
        pos += min(best + 1, len(tokens) - pos)
        steps += 1
    return steps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", choices=("copy-heavy", "random"), default="copy-heavy")
    p.add_argument("--num-prompts", type=int, default=9)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--draft-tokens", type=int, default=15, help="K (the NGRAM default: 15)")
    p.add_argument("--branches", type=int, nargs="+", default=[1, 2, 4, 8], help="B values; 1 is today's draft")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--flags", default="--max-total-tokens 16384", help="ServerArgs flags of the engine")
    args = p.parse_args(argv)

    from jaxserve.config import ServerArgs
    from jaxserve.engine.engine import Engine

    engine = Engine(ServerArgs.from_cli(shlex.split(args.flags)))
    rng = np.random.default_rng(args.seed)
    if args.dataset == "copy-heavy":
        rows = sample_copy_heavy_requests(engine.tokenizer, rng, args.num_prompts, 6, args.output_len)
        tasks = [COPY_HEAVY_TASKS[i % len(COPY_HEAVY_TASKS)] for i in range(len(rows))]
    else:
        rows = sample_random_requests(PromptSampler(engine.tokenizer, rng), args.num_prompts, 128, args.output_len, 0.0)
        tasks = ["random"] * len(rows)
    steps: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for task, row in zip(tasks, rows):
        prompt_ids = engine.tokenizer.encode(row.prompt)
        out = engine.generate(prompt_ids, {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True})
        tokens = prompt_ids + list(out["output_ids"])
        steps[task]["tokens"] += len(out["output_ids"])
        for b in args.branches:
            steps[task][b] += replay_steps(tokens, len(prompt_ids), args.draft_tokens, b)
    print(f"\n{args.dataset}, {args.num_prompts} prompts, seed {args.seed}, K = {args.draft_tokens}: steps to emit the outputs")
    print_table(steps, args.branches)


def print_table(steps: dict[str, collections.Counter], branches: Sequence[int]) -> None:
    """A row per task: output tokens, steps per B, and each B's steps over B = 1's (when 1 was run)."""
    others = [b for b in branches if b != 1] if 1 in branches else []
    header = ["task", "output tokens", *("latest (B = 1)" if b == 1 else f"best of {b}" for b in branches),
              *(f"B = {b} / B = 1" for b in others)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for task, c in steps.items():
        cells = [task, str(c["tokens"]), *(str(c[b]) for b in branches), *(f"{c[b] / c[1]:.3f}" for b in others)]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
