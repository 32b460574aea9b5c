"""Speculative verification against a decode step, on the default model (issue 20).

One invocation, one process, runs alternating: the batch-1 decode step (1 token after --prompt-len
cached ones) and verification steps of 1 + K tokens (the last token + a K-token draft) for each K of
--draft-tokens, with logits at all 1 + K rows (what a speculative step runs) and at one row only (the
difference is the output projection's share). Each output projection layout of --logits-layouts is
its own model runner over the same weights; their timed runs alternate, so drift in the machine's
speed hits them alike. A layout is one of `jaxserve.model.llama.LOGITS_LAYOUTS`.

The break-even accept length of K is verify(K) / decode: speculation pays when the mean tokens
emitted per verification (`spec_accept_length`) exceeds it.

    python scripts/bench_verify.py [--draft-tokens 2 4 6 8 12 15] [--logits-layouts x_wt w_x]
                                   [--repeats 10] [--stat min|median] [--output-file F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import types

import jax
import numpy as np

import bench_model
from jaxserve.engine.model_runner import BatchEntry
from jaxserve.model import llama
from jaxserve.model.loader import load_model


def model_with_layout(layout: str) -> types.ModuleType:
    """`jaxserve.model.llama` with `compute_logits` bound to one output projection layout."""
    shim = types.ModuleType(f"llama_{layout}")
    shim.__dict__.update({k: v for k, v in vars(llama).items() if not k.startswith("__")})

    def compute_logits(params, hidden, *, config):
        return llama.compute_logits(params, hidden, config=config, layout=layout)

    shim.compute_logits = compute_logits
    return shim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 4, 6, 8, 12, 15])
    ap.add_argument("--logits-layouts", nargs="+", default=list(llama.LOGITS_LAYOUTS), choices=llama.LOGITS_LAYOUTS)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    ap.add_argument("--output-file", default=None, help="write the table as JSON rows")
    args = ap.parse_args()

    config, params = load_model("default", "float32")
    n = args.prompt_len
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, config.vocab_size, size=n)]
    pages = list(range(1, n // bench_model.PAGE_SIZE + 3))
    runners = {lay: bench_model.jax_runner(config, params, 16, n + 2 * bench_model.PAGE_SIZE, "host",
                                           model_with_layout(lay)) for lay in args.logits_layouts}
    for r in runners.values():
        r.forward([BatchEntry(prompt, 0, pages)])
    stat = min if args.stat == "min" else statistics.median

    def step(runner, tokens, num_logits):
        entries = [BatchEntry(tokens, n, pages, num_logits=num_logits)]
        return lambda: runner.forward(entries).block_until_ready()

    cases = [("decode", [prompt[-1]], 1)]
    for k in args.draft_tokens:
        cases += [(f"verify K={k}", prompt[-1 - k:], k + 1), (f"verify K={k}, 1 logits row", prompt[-1 - k:], 1)]
    fns = {(lay, name): step(r, toks, nl) for lay, r in runners.items() for name, toks, nl in cases}
    times = bench_model.timed_alternating(fns, args.repeats, stat)
    print(f"\njax {jax.__version__} on {jax.default_backend()}; batch 1, {n} tokens cached; {args.stat} of {args.repeats}\n")
    print("| step | " + " | ".join(f"{lay} (ms)" for lay in runners) + " | "
          + " | ".join(f"{lay} / its decode" for lay in runners) + " |")
    print("|---" * (1 + 2 * len(runners)) + "|")
    rows = []
    for name, _, _ in cases:
        ms = [times[(lay, name)] * 1e3 for lay in runners]
        rel = [times[(lay, name)] / times[(lay, "decode")] for lay in runners]
        print(f"| {name} | " + " | ".join(f"{m:.1f}" for m in ms) + " | " + " | ".join(f"{x:.2f}" for x in rel) + " |")
        rows.append({"step": name, **{f"{lay}_ms": m for lay, m in zip(runners, ms)}})
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
