"""The host loop's three programs for one 512-token prefill, Flax NNX model against the earlier jnp model.

    python scripts/bench_model_parts.py [--repeats 9] [--prompt-len 512]

Both models get the same weights (the jnp one converted to its layout) and the same bucket; each
program (a group of 5 layers, the head, the embedding) is compiled once and called alternately
between the models, `--repeats` times after a warm-up; the fastest call of each is printed (ms).
Temporary: it goes with `jaxserve/model/llama_jnp.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--prompt-len", type=int, default=512)
    args = ap.parse_args()
    import jax.numpy as jnp

    from jaxserve.engine.model_runner import BatchEntry, ModelRunner
    from jaxserve.model import llama, llama_jnp
    from jaxserve.model.loader import load_model
    from jaxserve.pallas.reference import ragged_paged_attention_xla

    config, params = load_model("default", "float32")
    n, page = args.prompt_len, 16
    shape = (config.num_layers, n // page + 8, page, config.num_kv_heads, config.head_dim)
    fns = {}
    for name, mod, p in (("flax", llama, params), ("jnp", llama_jnp, llama_jnp.from_flax_params(config, params))):
        r = ModelRunner(config, p, jnp.zeros(shape), jnp.zeros(shape), attn_fn=ragged_paged_attention_xla,
                        max_running_requests=1, max_extend_tokens=n, context_length=n + page, layer_loop="host",
                        model=mod)
        batch, key = r.build_forward_batch([BatchEntry([5] * n, 0, list(range(1, 1 + -(-n // page))))])
        exe = r._compile_step(key, batch)
        outer = mod.outer_params(r.params)
        (h, cos, sin), dbatch = exe.embed(outer, batch)
        group = mod.per_layer(r.params)[: r.layers_per_call]
        pools = {"k": r.k_pool, "v": r.v_pool}

        def layers(exe=exe, group=group, h=h, cos=cos, sin=sin, dbatch=dbatch, pools=pools):
            out, pools["k"], pools["v"] = exe.layers(group, h, pools["k"], pools["v"], exe.first_layer_ids[0],
                                                     dbatch, cos, sin)
            out.block_until_ready()

        fns[name] = {
            f"{r.layers_per_call} layers": layers,
            "head": lambda exe=exe, outer=outer, h=h, batch=batch: exe.head(outer, h, batch)[0].block_until_ready(),
            "embed": lambda exe=exe, outer=outer, batch=batch: exe.embed(outer, batch)[0][0].block_until_ready(),
        }
    print("| program | flax (ms) | jnp (ms) | flax / jnp |\n|---|---|---|---|")
    for part in fns["flax"]:
        times = {name: [] for name in fns}
        for name in fns:
            fns[name][part]()
        for _ in range(args.repeats):
            for name in fns:
                t0 = time.perf_counter()
                fns[name][part]()
                times[name].append(time.perf_counter() - t0)
        best = {name: min(ts) * 1e3 for name, ts in times.items()}
        print(f"| {part} | {best['flax']:.2f} | {best['jnp']:.2f} | {best['flax'] / best['jnp']:.3f} |")


if __name__ == "__main__":
    main()
