"""Probe: does glibc malloc's mmap threshold cost XLA:CPU steps page faults, and does turning it off help?

Each measurement runs in a fresh process with one malloc mode, applied by mallopt before jax loads:
- off: glibc's defaults (allocations above the dynamic mmap threshold, at most 32 MiB, get a fresh mmap);
- nommap: M_MMAP_MAX 0 (no mmap for the main arena) and M_TRIM_THRESHOLD 2**31 - 1 (freed heap stays);
- thresh: M_MMAP_THRESHOLD 32 MiB (the largest glibc takes) and the same trim threshold;
- arena1: nommap and M_ARENA_MAX 1 (every thread allocates from the main arena's heap).
The driver runs the modes' processes in ABBA order for --rounds rounds, so drift hits them alike,
and prints each measure's per-round ratio (mode / off). Times are the fastest of --repeats calls,
each right after an untimed decode forward (as in a step); minor page faults are per call.

    python scripts/probe_malloc.py --rounds 3 --modes off nommap
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import time

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -3, -4, -8
KEEP = 2**31 - 1


def apply_mode(mode: str) -> None:
    if mode == "off":
        return
    libc = ctypes.CDLL("libc.so.6")
    ok = libc.mallopt(M_TRIM_THRESHOLD, KEEP)
    ok &= libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) if mode == "thresh" else libc.mallopt(M_MMAP_MAX, 0)
    if mode == "arena1":
        ok &= libc.mallopt(M_ARENA_MAX, 1)
    if not ok:
        raise RuntimeError(f"mallopt refused mode {mode}")


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(fns: dict, before, repeats: int) -> dict:
    """{name: (min ms, median ms, faults per call)}; each call after an untimed `before()`."""
    for fn in fns.values():
        before()
        fn()
    times = {n: [] for n in fns}
    flt = {n: 0 for n in fns}
    for _ in range(repeats):
        for n, fn in fns.items():
            before()
            f0 = faults()
            t0 = time.perf_counter()
            fn()
            times[n].append(time.perf_counter() - t0)
            flt[n] += faults() - f0
    return {n: (min(ts) * 1e3, statistics.median(ts) * 1e3, flt[n] // repeats) for n, ts in times.items()}


def vm_status() -> dict:
    out = {}
    for line in open("/proc/self/status"):
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(line.split()[1]) // 1024
    return out


def child(args) -> dict:
    apply_mode(args.mode)
    import jax.numpy as jnp  # noqa: F401 - after mallopt, as a server start would be

    from benchmarks.model.bench_model import PAGE_SIZE, jax_runner
    from benchmarks.model.bench_sampler import decode_entry, model_path, sampler_inputs
    from jaxserve.model.loader import load_model
    from jaxserve.runner.model_runner import BatchEntry

    res = {}
    if "gemma" in args.parts:
        config, params = load_model(model_path("gemma3"), "float32")
        b, ctx = 16, 512
        runner = jax_runner(config, params, b, ctx + PAGE_SIZE, "host")
        pps = ctx // PAGE_SIZE + 1
        entries = [decode_entry(i, pps, ctx) for i in range(b)]
        holder = {}

        def fwd():
            holder["logits"] = runner.forward(entries)
            holder["logits"].block_until_ready()

        fwd()
        history = list(range(3, 3 + ctx))
        greedy = sampler_inputs("greedy", b, holder["logits"].shape[0], config.vocab_size, history)
        top_p = sampler_inputs("temp+top-p", b, holder["logits"].shape[0], config.vocab_size, history)
        r = timed({"gemma decode b16": fwd,
                   "gemma greedy b16": lambda: runner.sample(holder["logits"], *greedy),
                   "gemma top-p b16": lambda: runner.sample(holder["logits"], *top_p)}, fwd, args.repeats)
        res.update(r)
        del runner, params, holder
    if "default" in args.parts:
        config, params = load_model("default", "float32")
        ctx, b = 512, 8
        dec = jax_runner(config, params, b, ctx + PAGE_SIZE, "host")
        pps = ctx // PAGE_SIZE + 1
        prompt = [int(t) % config.vocab_size for t in range(7, 7 + ctx)]
        for i in range(b):
            dec.forward([BatchEntry(prompt, 0, list(range(1 + i * pps, 1 + (i + 1) * pps)))]).block_until_ready()
        entries = [decode_entry(i, pps, ctx) for i in range(b)]

        def decode():
            dec.forward(entries).block_until_ready()

        fns = {"default decode b8": decode}
        for n in args.prefill_lens:
            pre = jax_runner(config, params, 1, n + PAGE_SIZE, "host")
            entry = [BatchEntry([int(t) % config.vocab_size for t in range(11, 11 + n)], 0,
                                list(range(1, 1 + n // PAGE_SIZE + 1)))]
            fns[f"default prefill {n}"] = lambda pre=pre, entry=entry: pre.forward(entry).block_until_ready()
        res.update(timed(fns, decode, args.repeats))
    if "default64" in args.parts:
        config, params = load_model("default", "float32")
        ctx = 512
        for b in (32, 64):
            runner = jax_runner(config, params, b, ctx + PAGE_SIZE, "host")
            entries = [decode_entry(i, ctx // PAGE_SIZE + 1, ctx) for i in range(b)]
            holder = {}

            def fwd(runner=runner, entries=entries, holder=holder):
                holder["logits"] = runner.forward(entries)
                holder["logits"].block_until_ready()

            fwd()
            history = list(range(3, 3 + ctx))
            greedy = sampler_inputs("greedy", b, holder["logits"].shape[0], config.vocab_size, history)
            top_p = sampler_inputs("temp+top-p", b, holder["logits"].shape[0], config.vocab_size, history)
            res.update(timed({f"default decode b{b}": fwd,
                              f"default greedy b{b}": lambda r=runner, h=holder, s=greedy: r.sample(h["logits"], *s),
                              f"default top-p b{b}": lambda r=runner, h=holder, s=top_p: r.sample(h["logits"], *s)},
                             fwd, args.repeats))
            del runner, holder
    res["vm"] = vm_status()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode")
    ap.add_argument("--modes", nargs="+", default=["off", "nommap"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--parts", nargs="+", default=["gemma", "default"])
    ap.add_argument("--prefill-lens", type=int, nargs="+", default=[2048, 4096])
    args = ap.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    print(f"uptime: {os.popen('uptime').read().strip()}", flush=True)
    runs = {m: [] for m in args.modes}
    for r in range(args.rounds):
        order = args.modes if r % 2 == 0 else args.modes[::-1]
        for mode in order:
            cmd = [sys.executable, __file__, "--mode", mode, "--repeats", str(args.repeats), "--parts", *args.parts,
                   "--prefill-lens", *map(str, args.prefill_lens)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            res = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            runs[mode].append(res)
            print(f"round {r} {mode}: " + "; ".join(
                f"{k} {v[0]:.2f}/{v[1]:.2f} ms {v[2]} flt" for k, v in res.items() if k != "vm")
                + f"; {res['vm']}", flush=True)
    print(f"uptime: {os.popen('uptime').read().strip()}")
    base = args.modes[0]
    for mode in args.modes[1:]:
        print(f"\n{mode} / {base}, per round (min-of-repeats ratio):")
        for k in runs[base][0]:
            if k == "vm":
                continue
            ratios = [runs[mode][i][k][0] / runs[base][i][k][0] for i in range(args.rounds)]
            print(f"  {k}: " + " ".join(f"{x:.3f}" for x in ratios)
                  + f"  (median {statistics.median(ratios):.3f}; {base} min {min(r[k][0] for r in runs[base]):.2f} ms,"
                  f" {mode} min {min(r[k][0] for r in runs[mode]):.2f} ms; faults {runs[base][0][k][2]} vs"
                  f" {runs[mode][0][k][2]})")


if __name__ == "__main__":
    main()
