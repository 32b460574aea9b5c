"""Run the tiny checkpoints at several tp sizes in one process with forced host devices; print JSON.

A separate process because the number of host devices is fixed when jax starts:

    JAX_NUM_CPU_DEVICES=4 python -m tests.parallel.tp_worker MODEL_DIR... --tp 1 2 4 [--backend xla|pallas]
                                                             [--precompile] [--num-prompts N] [--lower-cuda]
                                                             [--retract] [--disable-radix-cache]
                                                             [--kv-cache-dtype int8|fp8_e4m3|...]

For each tp size: greedy outputs of 16 mixed-length requests through the Engine (radix cache, chunked
prefill, the release policy aggressive with soft release and coalescing), compiles after warm-up, free
pages after a flush, the host tier's use, and the logits of one prefill through a ModelRunner.
`--lower-cuda` instead lowers the tp-sharded scan step with the Pallas (Triton) backend for "cuda".
`--retract` instead runs the 16 requests with long outputs on a pool too small for them, so decodes
retract requests and resume them: greedy outputs, the retraction count and the free pages after a flush.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

AGGRESSIVE = dict(
    release_conservative_batch_size=0, release_aggressive_batch_size=0, enable_hierarchical_cache=True,
    radix_cache_soft_free_threshold=0.0, radix_cache_evict_threshold=0.0, enable_auto_merge=True,
    merge_max_suffix_tokens=15, merge_min_shared_ratio=0.0,
    prefill_decode_itl_ratio=0,  # no time-based prefill budget: the schedule (and so retractions, recalls) must not depend on load
)


def prompts(vocab_size: int) -> list[list[int]]:
    """16 prompts of 4 to 94 tokens; half share a 44-token prefix (radix hits; at page size 8 the match
    ends inside a page, so coalescing copies it on write)."""
    rng = np.random.default_rng(0)
    system = [int(x) for x in rng.integers(3, vocab_size, 44)]
    out = []
    for i in range(16):
        tail = [int(x) for x in rng.integers(3, vocab_size, int(rng.integers(3, 50)))]
        out.append(system + tail if i % 2 else tail)
    return out


def run(model_dir: str, tp: int, backend: str, precompile: bool, num_prompts: int, disable_radix_cache: bool = False,
        hybrid: bool = False, kv_cache_dtype: str = "auto") -> dict:
    """`hybrid`: no host tier, so a sliding-window model gets the hybrid window pool (D-46). `kv_cache_dtype`:
    a compressed pool's values and scales are both split over kv heads (`pool_sharding` lists each leaf's)."""
    import jax

    from jaxserve.core.batch import BatchEntry
    from jaxserve.engine.engine import Engine

    engine = Engine(
        model_path=model_dir, tp_size=tp, attention_backend=backend, max_total_tokens=1024,
        max_running_requests=8, chunked_prefill_size=32, context_length=128, page_size=8,
        disable_precompile=not precompile, disable_radix_cache=disable_radix_cache, kv_cache_dtype=kv_cache_dtype,
        **({} if disable_radix_cache else dict(AGGRESSIVE, enable_hierarchical_cache=not hybrid)),
    )
    ps = prompts(engine.runner.model_config.vocab_size)[:num_prompts]
    greedy = {"max_new_tokens": 6, "temperature": 0}
    seeded = {"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "seed": 7}
    half = len(ps) // 2
    outputs = [o["output_ids"] for o in engine.generate(ps[:half], greedy)]
    engine.step()  # an idle tick: the policy soft-releases the unlocked prefixes
    outputs += [o["output_ids"] for o in engine.generate(ps[half:], greedy)]
    compiles = engine.runner.num_compiles_after_warmup
    sampled = [o["output_ids"] for o in engine.generate(ps[:2], seeded)]  # compiles its sampler variant
    engine.cache.check_integrity([])
    stats = engine.radix_cache_stats() if not disable_radix_cache else None
    engine.flush_cache()
    runner = engine.runner
    prefill = ps[1][:30]  # one chunk
    pages = engine.cache.allocator.allocate(-(-len(prefill) // 8))
    logits = np.asarray(runner.forward([BatchEntry(prefill, 0, pages)]))[0]
    engine.cache.allocator.free(pages)
    return {
        "tp": tp,
        "devices": engine.devices,
        "num_kv_heads": engine.runner.model_config.num_kv_heads,
        "pool_sharding": " ".join(str(leaf.sharding.spec) if hasattr(leaf.sharding, "spec") else ""
                                  for leaf in jax.tree.leaves(runner.k_pool)),
        "outputs": outputs,
        "sampled": sampled,
        "compiles_after_warmup": compiles if precompile else None,
        "flat_pages": engine.runner.window_layout.num_flat_pages if engine.runner.window_layout is not None else None,
        "free_pages": engine.cache.allocator.num_free,
        "usable_pages": engine.cache.allocator.num_usable,
        "num_recalls": stats.num_recalls if stats else 0,
        "cow_hit_tokens": stats.cow_hit_tokens if stats else 0,
        "logits": logits.tolist(),
        "jax_devices": len(jax.devices()),
    }


def run_retract(model_dir: str, tp: int, backend: str) -> dict:
    """16 greedy requests of 32 new tokens on a 192-token pool (24 pages of 8) with the radix cache on:
    the running decodes outgrow the pool, so the scheduler retracts requests (their pages go back, their
    output so far is kept) and re-admits them later."""
    from jaxserve.engine.engine import Engine

    engine = Engine(
        model_path=model_dir, tp_size=tp, attention_backend=backend, max_total_tokens=192,
        max_running_requests=8, chunked_prefill_size=32, context_length=128, page_size=8,
        disable_precompile=True,
    )
    outputs = [o["output_ids"] for o in engine.generate(prompts(engine.runner.model_config.vocab_size),
                                                       {"max_new_tokens": 32, "temperature": 0})]
    engine.cache.check_integrity([])
    engine.flush_cache()
    return {
        "tp": tp, "outputs": outputs, "num_retractions": engine.scheduler.num_retractions,
        "flat_pages": engine.runner.window_layout.num_flat_pages if engine.runner.window_layout is not None else None,
        "free_pages": engine.cache.allocator.num_free, "usable_pages": engine.cache.allocator.num_usable,
    }


def lower_cuda(model_dir: str, tp: int, hybrid: bool = False) -> dict:
    """Lower the scan-loop step of the tp-sharded model with the Pallas backend for "cuda"; count the
    Triton kernels and the all-reduces in the lowered module. `hybrid`: over the hybrid sliding-window
    pool (D-46), with a page that lost its window part in the batch."""
    import functools

    import jax.numpy as jnp

    from jaxserve import parallel
    from jaxserve.cache.kv_pool import PoolShape
    from jaxserve.core.batch import BatchEntry
    from jaxserve.model import functional
    from jaxserve.model.loader import load_model, replicate_kv_heads
    from jaxserve.pallas.ragged_paged_attention import ragged_paged_attention
    from jaxserve.runner.model_runner import ModelRunner

    config, params = load_model(model_dir, "bfloat16", use_weights_cache=False)
    config, params = replicate_kv_heads(config, params, parallel.plan_tensor_parallel(config, tp).kv_replicas)
    mesh = parallel.make_mesh(tp)
    window_pages, pages = None, [1, 2]
    shape = PoolShape(config.num_layers, 9, 8, config.num_kv_heads, config.head_dim, "float32").shape
    if hybrid:
        from jaxserve.cache.window_pool import HybridPageAllocator, plan_window_layout

        window_pages = HybridPageAllocator(plan_window_layout(config.layer_sliding_windows(), 9, 0.5))
        pages = window_pages.allocate(2)
        window_pages.drop_window(pages[:1])
        shape = (1, window_pages.layout.num_flat_pages) + shape[2:]
    backend = functools.partial(ragged_paged_attention, interpret=False)
    runner = ModelRunner(config, functional.stack_layers(params), jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16),
                         attn_fn=backend, max_running_requests=2, max_extend_tokens=16, context_length=64,
                         layer_loop="scan", mesh=mesh, allocator=window_pages)
    batch, _ = runner.build_forward_batch([BatchEntry([5] * 10, 0, pages)])
    lowered = runner._step_jit[False].trace(runner.params, runner.k_pool, runner.v_pool, batch).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text()
    return {"triton_kernels": text.count("triton"), "all_reduces": text.count("all_reduce"),
            "num_sharding_annotations": text.count("sdy.sharding") + text.count("mhlo.sharding"),
            "manual_axes": text.count("sdy.manual_computation"), "tp": tp}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dirs", nargs="+")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--backend", default="xla")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--lower-cuda", action="store_true")
    ap.add_argument("--retract", action="store_true")
    ap.add_argument("--disable-radix-cache", action="store_true")
    ap.add_argument("--hybrid", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto")
    args = ap.parse_args()
    if args.lower_cuda:
        results = [lower_cuda(d, tp, args.hybrid) for d in args.model_dirs for tp in args.tp]
    elif args.retract:
        results = [run_retract(d, tp, args.backend) for d in args.model_dirs for tp in args.tp]
    else:
        results = [
            {"model_dir": d, **run(d, tp, args.backend, args.precompile, args.num_prompts, args.disable_radix_cache,
                                   args.hybrid, args.kv_cache_dtype)}
            for d in args.model_dirs for tp in args.tp
        ]
    sys.stdout.write("\nRESULT " + json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
