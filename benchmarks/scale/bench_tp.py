"""Tensor-parallel step time: tp 1 against tp N in one invocation, on whatever devices exist.

    python -m benchmarks.scale.bench_tp --tp 2 [--model-path default] [--repeats 5] [--prompt-len 512]
                               [--batch-sizes 1 8 32] [--layer-loop host|scan] [--attention-backend xla|pallas]

Both runners hold the same weights; the tp N one shards them and the KV pool over N devices (the
mesh and rules of `jaxserve.parallel`). Timed: a `--prompt-len` prefill and one decode step for
batches of B sequences with `--prompt-len` tokens of KV each; medians of `--repeats` after a warm-up,
tp 1 and tp N alternating. The greedy token of every sequence is checked to be the same at both.

On CPU the N devices are host devices forced with JAX_NUM_CPU_DEVICES (set here before jax starts):
they share the same cores, so the numbers measure only the overhead of partitioning (collectives,
per-device dispatch), not a speed-up. Importing jaxserve.parallel sizes XLA:CPU's thread pool for
the forced devices (NPROC; without it, an all-reduce aborted in its rendezvous at tp 3 on 2 cores).
"""

from __future__ import annotations

import argparse
import os


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--layer-loop", choices=("host", "scan"), default=None, help="default: host on CPU, scan elsewhere")
    ap.add_argument("--attention-backend", choices=("xla", "pallas"), default=None)
    ap.add_argument("--dtype", default="auto")
    return ap.parse_args(argv)


def compare_tp(model_path: str, tp: int, *, prompt_len: int, batch_sizes, repeats: int,
               layer_loop: str | None = None, attention_backend: str | None = None, dtype: str = "auto") -> dict:
    """Time tp 1 and tp `tp` on the same work (see the module docstring). Returns {"rows": [(measure,
    tp1, tpN)], "same_tokens": bool, "devices": [...]}: prefill in tokens/s, decode steps in ms."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.model.bench_model import PAGE_SIZE, timed_alternating
    from jaxserve import parallel
    from jaxserve.cache.kv_pool import PoolShape
    from jaxserve.core.batch import BatchEntry
    from jaxserve.model import functional
    from jaxserve.model.loader import load_model, replicate_kv_heads
    from jaxserve.pallas import get_attention_backend
    from jaxserve.runner.model_runner import ModelRunner

    on_cpu = jax.default_backend() == "cpu"
    layer_loop = layer_loop or ("host" if on_cpu else "scan")
    backend = get_attention_backend(attention_backend or ("xla" if on_cpu else "pallas"))
    config, params = load_model(model_path, dtype)
    max_b = max(batch_sizes)
    pages_per_seq = prompt_len // PAGE_SIZE + 1
    runners = {}
    for t in (1, tp):
        cfg, p = replicate_kv_heads(config, params, parallel.plan_tensor_parallel(config, t).kv_replicas)
        shape = PoolShape(cfg.num_layers, max_b * pages_per_seq + 1, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim, "float32").shape
        dt = jax.tree.leaves(p)[0].dtype
        runners[t] = ModelRunner(
            cfg, p if layer_loop == "host" else functional.stack_layers(p), jnp.zeros(shape, dt), jnp.zeros(shape, dt),
            attn_fn=backend, max_running_requests=max_b, max_extend_tokens=prompt_len,
            context_length=prompt_len + PAGE_SIZE, layer_loop=layer_loop, mesh=parallel.make_mesh(t),
        )
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(3, config.vocab_size, size=prompt_len)]

    def pages(i):
        return list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq))

    def step(runner, entries):
        return lambda: runner.forward(entries).block_until_ready()

    prefill = [BatchEntry(prompt, 0, pages(0))]
    rows = []
    t = timed_alternating({k: step(r, prefill) for k, r in runners.items()}, repeats)
    rows.append((f"prefill {prompt_len} tokens (tokens/s)", prompt_len / t[1], prompt_len / t[tp]))
    same = True
    for b in batch_sizes:
        for r in runners.values():
            for i in range(b):
                r.forward([BatchEntry(prompt, 0, pages(i))])
        entries = [BatchEntry([prompt[-1]], prompt_len, pages(i)) for i in range(b)]
        tokens = {k: np.argmax(np.asarray(r.forward(entries))[:b], axis=-1) for k, r in runners.items()}
        same &= bool((tokens[1] == tokens[tp]).all())
        t = timed_alternating({k: step(r, entries) for k, r in runners.items()}, repeats)
        rows.append((f"decode step, batch {b} (ms)", t[1] * 1e3, t[tp] * 1e3))
    devices = [f"{d.platform}:{d.id}" for d in runners[tp].mesh.devices.flat] if runners[tp].mesh is not None else []
    return {"rows": rows, "same_tokens": same, "devices": devices, "layer_loop": layer_loop}


def print_table(result: dict, tp: int) -> None:
    print(f"| measure | tp 1 | tp {tp} | tp {tp} / tp 1 |")
    print("|---|---|---|---|")
    for i, (name, one, n) in enumerate(result["rows"]):
        ratio = (n / one) if i == 0 else (one / n)  # > 1: tp N faster
        print(f"| {name} | {one:.1f} | {n:.1f} | {ratio:.2f}x speed |")
    print(f"\ngreedy tokens equal at tp 1 and tp {tp}: {result['same_tokens']}; devices {result['devices']}")


def main() -> None:
    args = parse_args()
    # host devices must be forced before jax starts; harmless on GPU/TPU
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.tp))
    import jax

    result = compare_tp(args.model_path, args.tp, prompt_len=args.prompt_len, batch_sizes=args.batch_sizes,
                        repeats=args.repeats, layer_loop=args.layer_loop,
                        attention_backend=args.attention_backend, dtype=args.dtype)
    print(f"\njax {jax.__version__} on {jax.default_backend()}, {jax.device_count()} devices, "
          f"{os.cpu_count()} CPUs, layer loop {result['layer_loop']}\n")
    if jax.default_backend() == "cpu":
        print("(CPU host devices share the same cores: this measures partitioning overhead only)\n")
    print_table(result, args.tp)


if __name__ == "__main__":
    main()
