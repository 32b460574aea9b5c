"""Model speed on the default model: prefill tokens/s and decode step latency, jaxserve vs transformers.

Both run the same work in the same process, float32 on CPU: a 512-token prefill, and one decode step
for a batch of B sequences that each have 512 tokens of KV cached (B = 1, 8, 32). Each number is the
median of --repeats timed runs after a warm-up run.

    python scripts/bench_model.py [--repeats 5] [--prompt-len 512] [--batch-sizes 1 8 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.model_runner import BatchEntry, ModelRunner
from jaxserve.model.loader import load_model
from jaxserve.model.tokenizer import DEFAULT_MODEL_GGUF, default_model_path
from jaxserve.pallas.reference import ragged_paged_attention_xla

PAGE_SIZE = 16


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def jax_runner(config, params, max_seqs: int, context: int) -> ModelRunner:
    num_pages = max_seqs * (context // PAGE_SIZE + 1) + 1
    shape = (config.num_layers, num_pages, PAGE_SIZE, config.num_kv_heads, config.head_dim)
    return ModelRunner(
        config, params, jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
        attn_fn=ragged_paged_attention_xla, max_running_requests=max_seqs,
        max_extend_tokens=context, context_length=context + PAGE_SIZE,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    torch.set_num_threads(os.cpu_count() or 1)
    config, params = load_model("default", "float32")
    tmodel = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_model_path()), gguf_file=DEFAULT_MODEL_GGUF, dtype=torch.float32
    ).eval()
    rng = np.random.default_rng(0)
    n = args.prompt_len
    prompt = [int(x) for x in rng.integers(3, config.vocab_size, size=n)]
    max_b = max(args.batch_sizes)
    runner = jax_runner(config, params, max_b, n + PAGE_SIZE)
    pages_per_seq = n // PAGE_SIZE + 1

    def seq_pages(i):
        return list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq))

    rows = []
    jax_prefill = timed(lambda: runner.forward([BatchEntry(prompt, 0, seq_pages(0))]).block_until_ready(), args.repeats)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        torch_prefill = timed(lambda: tmodel(ids), args.repeats)
    rows.append((f"prefill {n} tokens (tokens/s)", n / jax_prefill, n / torch_prefill))

    for b in args.batch_sizes:
        for i in range(b):  # fill each sequence's KV once
            runner.forward([BatchEntry(prompt, 0, seq_pages(i))])
        entries = [BatchEntry([prompt[-1]], n, seq_pages(i)) for i in range(b)]
        jax_step = timed(lambda: runner.forward(entries).block_until_ready(), args.repeats)
        with torch.no_grad():
            cache = DynamicCache()
            tmodel(torch.tensor([prompt] * b), past_key_values=cache, use_cache=True)
            nxt = torch.tensor([[prompt[-1]]] * b)

            def torch_step():
                out = tmodel(nxt, past_key_values=cache, use_cache=True)
                cache.crop(-1)  # drop the new token: every repeat runs at the same context length
                return out

            torch_step_s = timed(torch_step, args.repeats)
        rows.append((f"decode step, batch {b} (ms)", jax_step * 1e3, torch_step_s * 1e3))

    print(f"\njax {jax.__version__} on {jax.default_backend()}, torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print("| measure | jaxserve | transformers | ratio (speed-up) |")
    print("|---|---|---|---|")
    for name, ours, ref in rows:
        speedup = ours / ref if "tokens/s" in name else ref / ours
        print(f"| {name} | {ours:.1f} | {ref:.1f} | {speedup:.2f}x |")


if __name__ == "__main__":
    main()
