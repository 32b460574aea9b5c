"""The cost of prompt positions' logprobs on the default model.

One engine (radix cache off, so every request prefills its whole prompt), requests of one --prompt-len
token prompt and max_new_tokens 1, timed end to end (add_request to the finished output) in three
variants whose timed runs alternate in one invocation: no prompt logprobs (the plain step), prompt
token logprobs only (`logprob_start_len 0`: the step variant returning [T] logprobs), and also
`top_logprobs_num` 5 + 4 `token_ids_logprob` (the "full" variant: the log-softmax [T, V] to the host,
top-k and ids in numpy, jaxserve/engine/prompt_logprobs.py). Each is the median of --repeats runs
after a warm-up run (which compiles its variant).

    python -m benchmarks.model.bench_prompt_logprobs [--prompt-len 512] [--repeats 7]
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.model import bench_model
from jaxserve.engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    engine = Engine(model_path="default", max_total_tokens=4096, disable_radix_cache=True, disable_precompile=True,
                    chunked_prefill_size=args.prompt_len, context_length=2048)
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, engine.runner.model_config.vocab_size, size=args.prompt_len)]

    def run(**kwargs):
        engine.add_request(prompt, {"max_new_tokens": 1, "temperature": 0}, **kwargs)
        while engine.has_unfinished():
            engine.step()

    variants = {
        "none": lambda: run(),
        "token logprobs": lambda: run(return_logprob=True, logprob_start_len=0),
        "top-5 + 4 ids": lambda: run(return_logprob=True, logprob_start_len=0, top_logprobs_num=5,
                                     token_ids_logprob=[0, 7, 512, 40000]),
    }
    times = bench_model.timed_alternating(variants, args.repeats)
    base = times["none"]
    print(f"| variant (prompt {args.prompt_len} tokens, max_new_tokens 1) | ms per request | / none |")
    print("|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t * 1e3:.1f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
