"""The small-context decode cliff (docs/benchmarks.md, "Sixth pass: the small-context decode cliff").

Times batch-1 steps of the default model on the host layer loop (`scripts/bench_verify.py`'s
`runner_with`) with the engine's `ragged_paged_attention_xla` against a baseline version of it loaded
from a file (e.g. the one before the fix: `git show 94ace41:jaxserve/pallas/reference.py > /tmp/ref.py`).
For each --prompt-lens n: a decode step (1 token after n cached), a K=2 verification (3 tokens after n)
and a prefill of the n tokens, the two variants' timed calls alternating in one invocation, so drift in
the machine's speed hits them alike. Also counts, in each variant's compiled layer-group program, the
copies of a pool-shaped buffer (the cliff's cause: one copy of the V pool per layer), and checks
that both variants give the same logits.

    python scripts/bench_small_context.py --baseline-file /tmp/ref.py [--prompt-lens 100 200 232 512]
                                          [--repeats 5] [--stat min|median]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics

import numpy as np

import bench_model
from bench_verify import runner_with
from jaxserve.runner.hlo_text import pool_copies
from jaxserve.runner.model_runner import BatchEntry
from jaxserve.model.loader import load_model
from jaxserve.pallas.reference import ragged_paged_attention_xla


def num_pool_copies(runner, entries) -> int:
    """Copies of a pool-shaped buffer in the compiled layer-group program of `entries`' bucket
    (`hlo_text.pool_copies`, the reader the regression test asserts on)."""
    batch, _ = runner.build_forward_batch(entries)
    text = runner._lower_step(batch, False, ["layer"])["layer"].compile().as_text()
    return len(pool_copies(text, runner.k_pool.shape))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-file", required=True, help="a reference.py holding the baseline attention")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[100, 200, 232, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("baseline_reference", args.baseline_file)
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    variants = {"baseline": baseline.ragged_paged_attention_xla, "engine": ragged_paged_attention_xla}
    config, params = load_model("default", "float32")
    stat = min if args.stat == "min" else statistics.median
    print("| cached tokens | step | bucket pages | baseline (ms) | engine (ms) | baseline / engine "
          "| pool copies baseline / engine |")
    print("|---|---|---|---|---|---|---|")
    for n in args.prompt_lens:
        prompt = [int(x) for x in np.random.default_rng(0).integers(3, config.vocab_size, size=n)]
        pages = list(range(1, n // bench_model.PAGE_SIZE + 3))
        cases = {"decode": [BatchEntry([prompt[-1]], n, pages, num_logits=1)],
                 "verify K=2": [BatchEntry(prompt[-3:], n, pages, num_logits=3)],
                 f"prefill {n}": [BatchEntry(prompt, 0, pages, num_logits=1)]}
        runners = {v: runner_with(config, params, fn, 64, n + 2 * bench_model.PAGE_SIZE) for v, fn in variants.items()}
        for c, e in cases.items():  # the fix changes no output: same logits, so the same greedy tokens
            a, b = (np.asarray(r.forward(e))[: e[0].num_logits] for r in runners.values())
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
            assert (a.argmax(-1) == b.argmax(-1)).all(), c
        copies = {(v, c): num_pool_copies(r, e) for v, r in runners.items() for c, e in cases.items()}
        fns = {(v, c): (lambda r=r, e=e: r.forward(e).block_until_ready())
               for v, r in runners.items() for c, e in cases.items()}
        times = bench_model.timed_alternating(fns, args.repeats, stat)
        for c, e in cases.items():
            key = runners["engine"].build_forward_batch(e)[1]
            b, f = times[("baseline", c)] * 1e3, times[("engine", c)] * 1e3
            print(f"| {n} | {c} | {key.pages_per_seq} | {b:.1f} | {f:.1f} | {b / f:.2f} "
                  f"| {copies[('baseline', c)]} / {copies[('engine', c)]} |", flush=True)
        del runners, fns
        gc.collect()


if __name__ == "__main__":
    main()
