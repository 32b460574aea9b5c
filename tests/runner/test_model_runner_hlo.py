"""The compiled step updates the KV pools in place in every bucket, the small-context ones included.

A bucket of at most one kv chunk (pages_per_seq <= 16 at page size 16: any context <= 256 tokens) once
compiled to a decode program that copied the whole V pool before each layer's K/V write: 50-100x slower
decode, with outputs unchanged (D-15). Checked on the compiled HLO of the tiny checkpoint's programs
(read by `jaxserve/runner/hlo_text.py`), so no timing is involved.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxserve.cache.kv_pool import PoolShape
from jaxserve.core.batch import BatchEntry
from jaxserve.model.loader import load_model
from jaxserve.pallas.reference import ragged_paged_attention_xla
from jaxserve.runner.hlo_text import aliased_params, pool_copies
from jaxserve.runner.model_runner import ModelRunner

PAGE_SIZE = 16
NUM_PAGES = 40


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, "float32", use_weights_cache=False)


def runner_for(tiny, context: int, layer_loop: str) -> ModelRunner:
    config, params = tiny
    shape = PoolShape(config.num_layers, NUM_PAGES, PAGE_SIZE, config.num_kv_heads, config.head_dim, "float32").shape
    return ModelRunner(config, params, jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
                       attn_fn=ragged_paged_attention_xla, max_running_requests=4, max_extend_tokens=256,
                       context_length=context, layer_loop=layer_loop)


def pool_program_text(runner: ModelRunner, entries: list[BatchEntry]) -> str:
    """Optimized HLO of the bucket's program that takes the pools: the host loop's layer group, or the
    scan loop's whole step."""
    batch, _ = runner.build_forward_batch(entries)
    part = "layer" if runner.layer_loop == "host" else "step"
    lowered = runner._lower_step(batch, False, ["layer"] if part == "layer" else ())[part]
    return lowered.compile().as_text()


@pytest.mark.parametrize("layer_loop", ["host", "scan"])
@pytest.mark.parametrize(
    "context,new_tokens,cached,bucket_pages",
    [(256, 1, 100, 16), (256, 3, 100, 16), (256, 40, 0, 16), (512, 1, 300, 32)],
    ids=["decode-16-pages", "verify-16-pages", "prefill-16-pages", "decode-32-pages"],
)
def test_pools_updated_in_place(tiny, layer_loop, context, new_tokens, cached, bucket_pages):
    """Context 256 (the test server's) gives 16-page buckets, the ones that regressed; 512 a 32-page one."""
    runner = runner_for(tiny, context, layer_loop)
    pages = list(range(1, -(-(cached + new_tokens) // PAGE_SIZE) + 1))
    entries = [BatchEntry(list(range(3, 3 + new_tokens)), cached, pages, num_logits=1)]
    assert runner.build_forward_batch(entries)[1].pages_per_seq == bucket_pages
    text = pool_program_text(runner, entries)
    assert pool_copies(text, runner.k_pool.shape) == []
    # both pools are donated and come back in the same buffers
    assert {name.split(".")[0] for name in aliased_params(text)} >= {"k_pool", "v_pool"}

