"""Offline throughput: N prompts of random lengths through `Engine.generate` vs transformers' batched
`generate`, same prompts, same process, greedy, float32 on CPU.

Also measures the machine's ceiling in the same run: a large float32 matmul's FLOP/s (numpy / XLA) and
a weight-streaming bandwidth (GB/s, a matrix-vector product over a weight-sized matrix), and reports
what share of each the engine reaches (model FLOPs = 2 x params per token).

    python -m benchmarks.offline.bench_offline --num-prompts 64 --input-len 128 --output-len 64 [--batch-1]

`--batch-1` adds the single-request decode comparison: one prompt, decode time per token (ITL) with the
prefill excluded, (t(--output-len tokens) - t(1 token)) / (--output-len - 1), in both engines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cases import with_case
from jaxserve.engine.engine import Engine
from jaxserve.model.tokenizer import DEFAULT_MODEL_GGUF, default_model_path

CASES = Path(__file__).resolve().parent / "cases"


def machine_ceiling() -> tuple[float, float]:
    """(matmul GFLOP/s, weight-streaming GB/s), measured with XLA on this CPU."""
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(5):
        f(a).block_until_ready()
    gflops = 5 * 2 * n**3 / (time.perf_counter() - t0) / 1e9
    w = jnp.ones((8192, 8192), jnp.float32)  # 256 MiB, far beyond the caches
    v = jnp.ones((8192,), jnp.float32)
    g = jax.jit(lambda w, v: w @ v)
    g(w, v).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(5):
        g(w, v).block_until_ready()
    gbs = 5 * w.nbytes / (time.perf_counter() - t0) / 1e9
    return gflops, gbs


def decode_itl(seconds, n: int, repeats: int = 3) -> float:
    """Batch-1 decode time per token (ITL), prefill excluded: (t(n tokens) - t(1 token)) / (n - 1), each
    the median of `repeats` runs. `seconds(k)` generates k tokens for one prompt and returns the time."""
    t1 = statistics.median(seconds(1) for _ in range(repeats))
    tn = statistics.median(seconds(n) for _ in range(repeats))
    return (tn - t1) / (n - 1)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128, help="max prompt length; lengths uniform in [len/4, len]")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch-1", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    return ap


def main(argv=None) -> None:
    ap = build_parser()
    args = ap.parse_args(with_case(ap, argv, CASES, "benchmarks.offline.bench_offline"))

    rng = np.random.default_rng(0)
    engine = Engine(model_path="default", max_running_requests=max(64, args.num_prompts), chunked_prefill_size=512,
                    context_length=1024, max_total_tokens=args.num_prompts * (args.input_len + args.output_len + 32))
    vocab = engine.runner.model_config.vocab_size
    prompts = [list(map(int, rng.integers(3, vocab, size=int(rng.integers(args.input_len // 4, args.input_len + 1)))))
               for _ in range(args.num_prompts)]
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    num_params = sum(x.size for x in jax.tree.leaves(engine.runner.params))
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.runner.params))

    rows = []
    engine.generate(prompts[:2], {**params, "max_new_tokens": 4})  # warm-up
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    ours = time.perf_counter() - t0
    n_in = sum(map(len, prompts))
    n_out = sum(len(o["output_ids"]) for o in outs)
    rows.append(("jaxserve", args.num_prompts, n_in / ours, n_out / ours, ours))

    single = None
    if args.batch_1:

        def ours_seconds(n: int) -> float:
            engine.flush_cache()  # the prompt is prefilled every time, as in transformers' generate
            t0 = time.perf_counter()
            engine.generate(prompts[0], {**params, "max_new_tokens": n})
            return time.perf_counter() - t0

        ours_seconds(4)  # warm-up
        single = decode_itl(ours_seconds, args.output_len)
    ref_rows, ref_single = [], None
    if not args.skip_transformers:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(os.cpu_count() or 1)
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(default_model_path()), gguf_file=DEFAULT_MODEL_GGUF, dtype=torch.float32
        ).eval()
        pad = 2
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                           do_sample=False, pad_token_id=pad)
            ref = time.perf_counter() - t0
            ref_rows.append(("transformers", args.num_prompts, n_in / ref, args.num_prompts * args.output_len / ref, ref))
            if args.batch_1:
                one = torch.tensor([prompts[0]])

                def ref_seconds(n: int) -> float:
                    t0 = time.perf_counter()
                    model.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, pad_token_id=pad)
                    return time.perf_counter() - t0

                ref_seconds(4)  # warm-up
                ref_single = decode_itl(ref_seconds, args.output_len)

    gflops, gbs = machine_ceiling()
    print(f"\n{args.num_prompts} prompts, input {args.input_len // 4}..{args.input_len} tokens, output {args.output_len} tokens; "
          f"jax {jax.__version__}, {os.cpu_count()} CPUs; ceiling: matmul {gflops:.0f} GFLOP/s, streaming {gbs:.1f} GB/s\n")
    print("| engine | prompts | input tok/s | output tok/s | wall s | model GFLOP/s (share of matmul ceiling) |")
    print("|---|---|---|---|---|---|")
    for name, n, tin, tout, wall in rows + ref_rows:
        achieved = 2 * num_params * (tin + tout) / 1e9
        print(f"| {name} | {n} | {tin:.0f} | {tout:.1f} | {wall:.1f} | {achieved:.1f} ({achieved / gflops:.0%}) |")
    if ref_rows:
        print(f"\noutput throughput ratio jaxserve / transformers: {rows[0][3] / ref_rows[0][3]:.2f}x")
    if single is not None:
        stream = weight_bytes / single / 1e9
        print(f"batch-1 decode (ITL, prefill excluded, prompt of {len(prompts[0])} tokens): jaxserve {single * 1e3:.1f} ms/token ({stream:.1f} GB/s of weights, "
              f"{stream / gbs:.0%} of the streaming ceiling)", end="")
        if ref_single:
            print(f", transformers {ref_single * 1e3:.1f} ms/token, ratio {ref_single / single:.2f}x")
        else:
            print()


if __name__ == "__main__":
    main()
