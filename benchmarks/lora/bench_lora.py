"""Multi-LoRA throughput and adapter load cost, in one process (no HTTP).

Two `Engine`s on the same model: one without LoRA (the baseline) and one with `--enable-lora`
(`--max-loras-per-batch 4`). Each round runs the same batch of random prompts (greedy, `ignore_eos`,
fixed lengths) three ways, in an order that rotates between rounds: the baseline engine, the LoRA
engine with the batch spread over 4 adapters, and the LoRA engine with every request on the base model
(what the LoRA path costs a request that uses no adapter). Printed: output tok/s per run (mean over the
counted rounds, after one warm-up round that compiles) and the ratios to the baseline. Then the same
three as single compiled steps (`ModelRunner.forward`), interleaved `--step-repeats` times: a decode step
of `--batch` sequences and a prefill step of `--prefill-tokens` tokens, minimum and median step times
(the minimum is the steadier number on a shared machine). Also the cost of loading an adapter at run
time: reading the PEFT directory (`load_lora_adapter`) and writing its device
slot (`ModelRunner.write_lora_slot`), each the median of `--load-repeats` runs.

The adapters are random PEFT directories written here with numpy and safetensors (rank `--rank`, all
seven target projections), so no torch or peft is needed.

    python -m benchmarks.lora.bench_lora --batch 8 --input-len 128 --output-len 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np


def write_random_adapter(path: str, config, rank: int, seed: int) -> str:
    """A PEFT LoRA directory for `config`'s model (every target, A and B ~ N(0, 0.02))."""
    from safetensors.numpy import save_file

    from jaxserve.model.lora import TARGET_MODULES, target_shapes

    rng = np.random.default_rng(seed)
    shapes = target_shapes(config)
    tensors = {}
    for i in range(config.num_layers):
        for module, target in TARGET_MODULES.items():
            out_f, in_f = shapes[target]
            part = "self_attn" if target in ("q", "k", "v", "o") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.02, (rank, in_f)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.02, (out_f, rank)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES)}, f)
    return path


def run_batch(engine, prompts, output_len: int, lora_path) -> float:
    """Output tok/s of one `generate` over `prompts`."""
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(prompts, params, lora_path=lora_path)
    return sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - start)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="default")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="counted rounds, after one warm-up round")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--load-repeats", type=int, default=5)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--step-repeats", type=int, default=15)
    p.add_argument("--prefill-tokens", type=int, default=512)
    args = p.parse_args(argv)

    from jaxserve.engine.engine import Engine

    common = dict(model_path=args.model_path, max_total_tokens=args.max_total_tokens, disable_precompile=True,
                  disable_radix_cache=True, max_running_requests=max(8, args.batch), prefill_decode_itl_ratio=0)
    base = Engine(**common)
    lora = Engine(**common, enable_lora=True, max_loras_per_batch=args.num_adapters, max_lora_rank=args.rank)
    tmp = tempfile.mkdtemp(prefix="bench_lora_")
    names = [f"adapter{i}" for i in range(args.num_adapters)]
    for i, name in enumerate(names):
        lora.load_lora_adapter(name, write_random_adapter(os.path.join(tmp, name), lora.runner.model_config, args.rank, i))

    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(100, lora.runner.model_config.vocab_size - 100, args.input_len)]
               for _ in range(args.batch)]
    mixed = [names[i % len(names)] for i in range(args.batch)]
    runs = {
        "base model, no LoRA": lambda: run_batch(base, prompts, args.output_len, None),
        f"LoRA engine, {len(names)} adapters mixed": lambda: run_batch(lora, prompts, args.output_len, mixed),
        "LoRA engine, base requests": lambda: run_batch(lora, prompts, args.output_len, None),
    }
    keys = list(runs)
    results: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(args.rounds + 1):
        order = keys[r % len(keys):] + keys[: r % len(keys)]
        for k in order:
            tok_s = runs[k]()
            if r > 0:
                results[k].append(tok_s)
    baseline = statistics.mean(results[keys[0]])
    print(f"batch {args.batch}, input {args.input_len}, output {args.output_len}, rank {args.rank}, "
          f"{args.rounds} rounds, model {args.model_path}")
    for k in keys:
        mean = statistics.mean(results[k])
        print(f"  {k:32s} {mean:8.1f} output tok/s  ratio {mean / baseline:.2f}x  (runs: "
              f"{', '.join(f'{x:.1f}' for x in results[k])})")

    step_times(base, lora, args, keys)
    load_s, write_s = [], []
    extra = write_random_adapter(os.path.join(tmp, "extra"), lora.runner.model_config, args.rank, 99)
    for _ in range(args.load_repeats):
        start = time.perf_counter()
        lora.load_lora_adapter("extra", extra)
        load_s.append(time.perf_counter() - start)
        lora.unload_lora_adapter("extra")
    from jaxserve.model.lora import load_adapter

    adapter = load_adapter(extra, lora.runner.model_config, lora.runner.lora)
    lora.runner.write_lora_slot(1, adapter)  # compiles the slot write once (the slot is traced)
    for _ in range(args.load_repeats):
        start = time.perf_counter()
        lora.runner.write_lora_slot(1, adapter)
        jax_block(lora.runner.params)
        write_s.append(time.perf_counter() - start)
    mib = adapter.nbytes / 2**20
    print(f"adapter load (rank {args.rank}, {mib:.1f} MiB in slot layout): read from disk "
          f"{statistics.median(load_s) * 1e3:.1f} ms, device slot write {statistics.median(write_s) * 1e3:.1f} ms "
          f"(medians of {args.load_repeats})")


def step_times(base, lora, args, names) -> None:
    """Decode and prefill step times of the three configurations, interleaved (see the docstring)."""
    import dataclasses

    import jax

    from jaxserve.runner.buckets import BucketKey

    num_slots = lora.runner.lora.num_slots
    decode = lora.runner.bucket_for([1] * args.batch, 1)
    prefill = lora.runner.bucket_for([args.prefill_tokens // args.batch] * args.batch, 1)
    for key in (decode, prefill):
        key = BucketKey(key.num_tokens, key.num_seqs, max(key.pages_per_seq, 16), key.block_q)
        configs = [(base, 0), (lora, 1), (lora, 0)]  # (engine, whether the rows spread over the adapters' slots)

        def entries(engine, mixed):
            return [dataclasses.replace(e, lora_slot=(1 + i % (num_slots - 1)) if mixed else 0)
                    for i, e in enumerate(engine.runner.dummy_entries(key))]

        times = [[] for _ in configs]
        for rep in range(args.step_repeats + 2):
            for j, (engine, mixed) in enumerate(configs):
                batch = entries(engine, mixed)
                start = time.perf_counter()
                jax.block_until_ready(engine.runner.forward(batch))
                if rep >= 2:  # two warm-up repeats (compiles)
                    times[j].append(time.perf_counter() - start)
        what = "decode" if key.block_q == 1 else "prefill"
        print(f"{what} step, {key.num_tokens} tokens in {key.num_seqs} sequences:")
        best = min(times[0])
        for name, ts in zip(names, times):
            print(f"  {name:32s} min {min(ts) * 1e3:7.1f} ms  median {statistics.median(ts) * 1e3:7.1f} ms  "
                  f"ratio (min) {best / min(ts):.2f}x")


def jax_block(tree) -> None:
    import jax

    jax.block_until_ready(tree)


if __name__ == "__main__":
    main()
