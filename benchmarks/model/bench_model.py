"""Model speed on the default model: prefill tokens/s and decode step latency, jaxserve vs transformers.

Both run the same work in the same process, float32 on CPU: a 512-token prefill, and one decode step
for a batch of B sequences that each have 512 tokens of KV cached (B = 1, 8, 32). Each number is the
median of --repeats timed runs after a warm-up run. jaxserve runs once per --layer-loops value (the
model runner's `layer_loop`: "host" calls a jitted group of layers from Python until all have run,
"host:G" the same with at most G layers per call, "scan" runs one executable with lax.scan over the
stacked layers); their timed runs alternate, so drift in the machine's speed hits them alike.
`--stat min` reports each variant's fastest run instead of the median (on a machine shared with other
jobs, the least disturbed run).

    python -m benchmarks.model.bench_model [--repeats 5] [--prompt-len 512] [--batch-sizes 1 8 32]
                                  [--layer-loops host scan host:1] [--skip-transformers]
                                  [--stat median|min]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache.kv_pool import PoolShape
from jaxserve.core.batch import BatchEntry
from jaxserve.model import functional
from jaxserve.model.loader import load_model
from jaxserve.model.tokenizer import DEFAULT_MODEL_GGUF, default_model_path
from jaxserve.pallas.reference import ragged_paged_attention_xla
from jaxserve.runner.buckets import MAX_LAYERS_PER_CALL
from jaxserve.runner.model_runner import ModelRunner

PAGE_SIZE = 16


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls after a warm-up call."""
    return timed_alternating({"fn": fn}, repeats)["fn"]


def timed_alternating(fns: dict, repeats: int, stat=statistics.median) -> dict:
    """Median (or `stat`) seconds of each of `fns` (name -> callable) after a warm-up call, the timed
    calls taken round-robin."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: stat(ts) for name, ts in times.items()}


def jax_runner(config, params, max_seqs: int, context: int, layer_loop: str) -> ModelRunner:
    """A runner for `layer_loop` ("scan", "host" or "host:G") with pools for `max_seqs` sequences."""
    loop, _, group = layer_loop.partition(":")
    num_pages = max_seqs * (context // PAGE_SIZE + 1) + 1
    shape = PoolShape(config.num_layers, num_pages, PAGE_SIZE, config.num_kv_heads, config.head_dim, "float32").shape
    return ModelRunner(
        config, params, jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
        attn_fn=ragged_paged_attention_xla, max_running_requests=max_seqs,
        max_extend_tokens=context, context_length=context + PAGE_SIZE, layer_loop=loop,
        max_layers_per_call=int(group or MAX_LAYERS_PER_CALL),
    )


def layer_loop_spec(value: str) -> str:
    loop, _, group = value.partition(":")
    if loop not in ("host", "scan") or (group and (loop != "host" or not group.isdigit() or int(group) < 1)):
        raise argparse.ArgumentTypeError(f"expected scan, host or host:G with G >= 1, got {value!r}")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--layer-loops", nargs="+", default=["host", "scan"], type=layer_loop_spec)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="min: the fastest run of each, less sensitive to other jobs on a shared machine")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    torch.set_num_threads(os.cpu_count() or 1)
    config, params = load_model("default", "float32")
    tmodel = None if args.skip_transformers else AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_model_path()), gguf_file=DEFAULT_MODEL_GGUF, dtype=torch.float32
    ).eval()
    rng = np.random.default_rng(0)
    n = args.prompt_len
    prompt = [int(x) for x in rng.integers(3, config.vocab_size, size=n)]
    max_b = max(args.batch_sizes)
    pages_per_seq = n // PAGE_SIZE + 1

    def seq_pages(i):
        return list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq))

    runners = {
        loop: jax_runner(config, params if loop.startswith("host") else functional.stack_layers(params), max_b,
                         n + PAGE_SIZE, loop)
        for loop in args.layer_loops
    }

    def step(runner, entries):
        return lambda: runner.forward(entries).block_until_ready()

    prefill = [BatchEntry(prompt, 0, seq_pages(0))]
    stat = min if args.stat == "min" else statistics.median
    ours = {loop: [n / t] for loop, t in timed_alternating(
        {loop: step(r, prefill) for loop, r in runners.items()}, args.repeats, stat).items()}
    for b in args.batch_sizes:
        for runner in runners.values():
            for i in range(b):  # fill each sequence's KV once
                runner.forward([BatchEntry(prompt, 0, seq_pages(i))])
        entries = [BatchEntry([prompt[-1]], n, seq_pages(i)) for i in range(b)]
        for loop, t in timed_alternating({loop: step(r, entries) for loop, r in runners.items()}, args.repeats, stat).items():
            ours[loop].append(t * 1e3)
    loops = list(runners)
    if args.skip_transformers:
        names = [f"prefill {n} tokens (tokens/s)"] + [f"decode step, batch {b} (ms)" for b in args.batch_sizes]
        print(f"\njax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPUs\n")
        columns = ["measure", *loops, *(f"{loops[0]} speed-up over {loop}" for loop in loops[1:])]
        print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
        for i, name in enumerate(names):
            rel = [(ours[loops[0]][i] / ours[loop][i]) if i == 0 else (ours[loop][i] / ours[loops[0]][i]) for loop in loops[1:]]
            print("| " + " | ".join([name, *(f"{ours[loop][i]:.1f}" for loop in loops), *(f"{r:.3f}" for r in rel)]) + " |")
        return
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = [n / timed(lambda: tmodel(ids), args.repeats)]
        for b in args.batch_sizes:
            cache = DynamicCache()
            tmodel(torch.tensor([prompt] * b), past_key_values=cache, use_cache=True)
            nxt = torch.tensor([[prompt[-1]]] * b)

            def torch_step():
                out = tmodel(nxt, past_key_values=cache, use_cache=True)
                cache.crop(-1)  # drop the new token: every repeat runs at the same context length
                return out

            ref.append(timed(torch_step, args.repeats) * 1e3)
    names = [f"prefill {n} tokens (tokens/s)"] + [f"decode step, batch {b} (ms)" for b in args.batch_sizes]

    print(f"\njax {jax.__version__} on {jax.default_backend()}, torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print("| measure | " + " | ".join(f"jaxserve ({loop})" for loop in loops) + " | transformers | "
          + " | ".join(f"speed-up ({loop})" for loop in loops) + " |")
    print("|---" * (2 + 2 * len(loops)) + "|")
    for i, name in enumerate(names):
        ups = [(ours[loop][i] / ref[i]) if i == 0 else (ref[i] / ours[loop][i]) for loop in loops]
        print(f"| {name} | " + " | ".join(f"{ours[loop][i]:.1f}" for loop in loops) + f" | {ref[i]:.1f} | "
              + " | ".join(f"{u:.2f}x" for u in ups) + " |")


if __name__ == "__main__":
    main()
