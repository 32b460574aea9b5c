"""LoRA slots in the model runner against PEFT (torch CPU) on the tiny checkpoint, and adapter loading
errors."""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cache.kv_pool import PoolShape
from jaxserve.core.batch import BatchEntry
from jaxserve.model import lora as lora_lib
from jaxserve.model.loader import load_model
from jaxserve.pallas.reference import ragged_paged_attention_xla
from jaxserve.runner.model_runner import ModelRunner
from tests.model.lora_helpers import make_peft_adapter, peft_last_logits, peft_model

PAGE = 4


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_peft_adapter(tiny_model_dir, str(root / "a"), seed=1, rank=8, alpha=16),
        "b": make_peft_adapter(tiny_model_dir, str(root / "b"), seed=2, rank=4, alpha=8, use_rslora=True,
                               targets=("q_proj", "v_proj", "down_proj")),
    }


def make_runner(model_dir, lora, layer_loop="host"):
    config, params = load_model(model_dir, "float32", use_weights_cache=False)
    shape = PoolShape(config.num_layers, 64, PAGE, config.num_kv_heads, config.head_dim, "float32").shape
    runner = ModelRunner(config, params, jnp.zeros(shape), jnp.zeros(shape), attn_fn=ragged_paged_attention_xla,
                         max_running_requests=4, max_extend_tokens=64, context_length=128, layer_loop=layer_loop,
                         lora=lora)
    return config, runner


@pytest.mark.parametrize("layer_loop", ["host", "scan"])
def test_mixed_batch_logits_match_peft(tiny_model_dir, adapters, layer_loop):
    """One step over base, adapter a and adapter b rows: each row's logits are PEFT's under its adapter."""
    lora = lora_lib.LoraConfig.of(num_slots=3, max_rank=8, target_modules=None)
    config, runner = make_runner(tiny_model_dir, lora, layer_loop)
    for slot, name in ((1, "a"), (2, "b")):
        runner.write_lora_slot(slot, lora_lib.load_adapter(adapters[name], config, lora))
    prompts = [[5, 17, 301, 42, 9], [5, 17, 301, 42, 9], [88, 7, 1200, 3, 3, 14, 60]]
    slots = [0, 1, 2]
    entries, page = [], 1
    for prompt, slot in zip(prompts, slots):
        n = -(-len(prompt) // PAGE)
        entries.append(BatchEntry(prompt, 0, list(range(page, page + n)), lora_slot=slot))
        page += n
    got = np.asarray(runner.forward(entries))
    ref = peft_model(tiny_model_dir, adapters)
    for row, (prompt, name) in enumerate(zip(prompts, [None, "a", "b"])):
        want = peft_last_logits(ref, name, prompt)
        np.testing.assert_allclose(got[row], want, atol=1e-4, rtol=0)
    # the adapters change the logits: a test of nothing would pass the same
    assert np.abs(got[0] - got[1]).max() > 1e-2


def test_slot_rewrite_and_clear(tiny_model_dir, adapters):
    """Writing another adapter into a slot replaces it; clearing it gives the base model again."""
    lora = lora_lib.LoraConfig.of(num_slots=2, max_rank=8, target_modules=None)
    config, runner = make_runner(tiny_model_dir, lora, "host")
    prompt = [5, 17, 301, 42, 9]
    ref = peft_model(tiny_model_dir, adapters)
    for adapter in ("a", "b", None):
        runner.write_lora_slot(1, None if adapter is None else lora_lib.load_adapter(adapters[adapter], config, lora))
        got = np.asarray(runner.forward([BatchEntry(prompt, 0, [1, 2], lora_slot=1)]))[0]
        np.testing.assert_allclose(got, peft_last_logits(ref, adapter, prompt), atol=1e-4, rtol=0)
    assert runner.num_compiles_after_warmup == 0 or not runner.warmed_up


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_load_errors(tiny_model_dir, adapters, tmp_path):
    config, _ = load_model(tiny_model_dir, "float32", use_weights_cache=False)
    lora = lora_lib.LoraConfig.of(num_slots=2, max_rank=8, target_modules=None)
    with pytest.raises(lora_lib.LoraError, match="exceeds --max-lora-rank 4"):
        lora_lib.load_adapter(adapters["a"], config, lora_lib.LoraConfig.of(2, 4, None))
    with pytest.raises(lora_lib.LoraError, match="not found"):
        lora_lib.load_adapter(str(tmp_path / "nope"), config, lora)
    no_weights = _copy(adapters["a"], tmp_path / "no_weights")
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    with pytest.raises(lora_lib.LoraError, match="no adapter_model.safetensors"):
        lora_lib.load_adapter(no_weights, config, lora)
    no_config = _copy(adapters["a"], tmp_path / "no_config")
    os.remove(os.path.join(no_config, "adapter_config.json"))
    with pytest.raises(lora_lib.LoraError, match="no adapter_config.json"):
        lora_lib.load_adapter(no_config, config, lora)
    with pytest.raises(lora_lib.LoraError, match="not in --lora-target-modules"):
        lora_lib.load_adapter(adapters["a"], config, lora_lib.LoraConfig.of(2, 8, ("q_proj", "v_proj")))
    # an adapter of another base model: hidden size 32
    import dataclasses

    small = dataclasses.replace(config, hidden_size=32)
    with pytest.raises(lora_lib.LoraError, match="expected .* for this base model"):
        lora_lib.load_adapter(adapters["a"], small, lora)
    dora = _copy(adapters["a"], tmp_path / "dora")
    cfg_path = os.path.join(dora, "adapter_config.json")
    cfg = json.load(open(cfg_path))
    cfg["use_dora"] = True
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(lora_lib.LoraError, match="use_dora"):
        lora_lib.load_adapter(dora, config, lora)


def test_unsupported_target(tiny_model_dir, tmp_path):
    config, _ = load_model(tiny_model_dir, "float32", use_weights_cache=False)
    path = make_peft_adapter(tiny_model_dir, str(tmp_path / "head"), seed=3, targets=("q_proj", "lm_head"))
    with pytest.raises(lora_lib.LoraError, match="lm_head"):
        lora_lib.load_adapter(path, config, lora_lib.LoraConfig.of(2, 8, None))


def test_lora_flags_in_sglang_forms():
    from jaxserve.server_args import ServerArgs

    args = ServerArgs.from_cli(["--lora-paths", "a=/x", "/y", '{"lora_name": "c", "lora_path": "/z", "pinned": true}',
                                "--lora-target-modules", "q_proj", "v_proj", "--max-loras-per-batch", "4"])
    assert args.lora_target_modules == ("q_proj", "v_proj") and args.max_loras_per_batch == 4
    assert lora_lib.parse_lora_paths(args.lora_paths) == [
        lora_lib.LoraSource("a", "/x"), lora_lib.LoraSource("/y", "/y"), lora_lib.LoraSource("c", "/z", True)]
    with pytest.raises(ValueError, match="twice"):
        lora_lib.parse_lora_paths(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="not supported"):
        lora_lib.LoraConfig.of(2, 8, ("lm_head",))


def test_kv_heads_replicated_for_tp_keep_the_adapter(tiny_model_dir, adapters):
    """With kv heads copied (tp above the kv-head count: loader.replicate_kv_heads), the adapter's k/v
    rows are copied the same way: logits still PEFT's."""
    from jaxserve.model.loader import replicate_kv_heads

    config, params = load_model(tiny_model_dir, "float32", use_weights_cache=False)
    config, params = replicate_kv_heads(config, params, 2)
    lora = lora_lib.LoraConfig.of(num_slots=2, max_rank=8, target_modules=None, kv_replicas=2)
    shape = PoolShape(config.num_layers, 16, PAGE, config.num_kv_heads, config.head_dim, "float32").shape
    runner = ModelRunner(config, params, jnp.zeros(shape), jnp.zeros(shape), attn_fn=ragged_paged_attention_xla,
                         max_running_requests=2, max_extend_tokens=16, context_length=32, layer_loop="host", lora=lora)
    runner.write_lora_slot(1, lora_lib.load_adapter(adapters["a"], config, lora))
    prompt = [5, 17, 301, 42, 9]
    got = np.asarray(runner.forward([BatchEntry(prompt, 0, [1, 2], lora_slot=1)]))[0]
    np.testing.assert_allclose(got, peft_last_logits(peft_model(tiny_model_dir, adapters), "a", prompt), atol=1e-4, rtol=0)
