"""Random rank-8 PEFT adapters on the default model (SmolLM2-135M-Instruct): greedy ids as PeftModel
gives them, alone and in one mixed batch with the base model (the adapters' numerics on the real model;
tests/engine/test_lora_engine.py covers the rest on the tiny one)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxserve.engine.engine import Engine
from jaxserve.model.tokenizer import DEFAULT_MODEL_GGUF, default_model_path, load_tokenizer
from tests.model.lora_helpers import ALL_TARGETS

pytestmark = pytest.mark.slow

NEW = 8
TEXTS = ["The capital of France is", "def add(a, b):\n    return"]
NEAR_TIE = 1e-3  # a top-2 logit gap below this at the first divergence is a tie, not an error


def _hf_base():
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_model_path()), gguf_file=DEFAULT_MODEL_GGUF, dtype=torch.float32).eval()


def _make_adapter(out_dir: str, seed: int, use_rslora: bool) -> str:
    import peft
    import torch

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=ALL_TARGETS, use_rslora=use_rslora,
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(_hf_base(), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.05)  # PEFT's B starts at zero, which would test nothing
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("default_model_adapters")
    return {"a": _make_adapter(str(root / "a"), 21, False), "b": _make_adapter(str(root / "b"), 22, True)}


@pytest.fixture(scope="module")
def reference(adapters):
    import peft

    model = peft.PeftModel.from_pretrained(_hf_base(), adapters["a"], adapter_name="a").eval()
    model.load_adapter(adapters["b"], adapter_name="b")
    return model


def _reference_greedy(model, adapter, prompt):
    """(ids, logits [NEW, V]) of PEFT's greedy continuation under `adapter` (None: the base model)."""
    import contextlib

    import torch

    ids = list(prompt)
    logits = []
    context = model.disable_adapter() if adapter is None else contextlib.nullcontext()
    if adapter is not None:
        model.set_adapter(adapter)
    with torch.no_grad(), context:
        for _ in range(NEW):
            step = model(torch.tensor([ids])).logits[0, -1].numpy()
            logits.append(step)
            ids.append(int(step.argmax()))
    return ids[len(prompt):], np.stack(logits)


def _assert_same_or_near_tie(got, want, logits, where):
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            top2 = np.sort(logits[i])[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, (where, i, got, want, float(top2[1] - top2[0]))
            return  # past a near tie the continuations may differ
    assert len(got) == len(want), (where, got, want)


def test_default_model_adapters_match_peft_alone_and_mixed(adapters, reference):
    engine = Engine(model_path="default", enable_lora=True, max_lora_rank=8, max_total_tokens=1024,
                    context_length=256, disable_precompile=True,
                    lora_paths=tuple(f"{k}={v}" for k, v in adapters.items()))
    tokenizer = load_tokenizer("default")
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    greedy = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    names = [None, "a", "b"]
    cases = [(p, n) for p in prompts for n in names]
    mixed = engine.generate([p for p, _ in cases], greedy, lora_path=[n for _, n in cases])
    for (prompt, name), batched in zip(cases, mixed):
        want, logits = _reference_greedy(reference, name, prompt)
        alone = engine.generate(prompt, greedy, lora_path=name)["output_ids"]
        _assert_same_or_near_tie(alone, want, logits, (name, "alone"))
        _assert_same_or_near_tie(batched["output_ids"], want, logits, (name, "mixed batch"))
    # the adapters change the output (else this would pass on the base model alone)
    assert mixed[1]["output_ids"] != mixed[0]["output_ids"] and mixed[2]["output_ids"] != mixed[0]["output_ids"]


def test_default_model_logits_in_one_mixed_step_match_peft(adapters, reference):
    """One step over base, adapter a and adapter b rows of the default model: each row's last logits
    within 1e-4 relative L2 of PEFT's (the metric of the default model's own parity test)."""
    import jax.numpy as jnp

    from jaxserve.cache.kv_pool import PoolShape
    from jaxserve.core.batch import BatchEntry
    from jaxserve.model import lora as lora_lib
    from jaxserve.model.loader import load_model
    from jaxserve.pallas.reference import ragged_paged_attention_xla
    from jaxserve.runner.model_runner import ModelRunner
    from tests.model.lora_helpers import peft_last_logits

    page = 16
    config, params = load_model("default", "float32")
    shape = PoolShape(config.num_layers, 8, page, config.num_kv_heads, config.head_dim, "float32").shape
    lora = lora_lib.LoraConfig.of(num_slots=3, max_rank=8, target_modules=None)
    runner = ModelRunner(config, params, jnp.zeros(shape), jnp.zeros(shape), attn_fn=ragged_paged_attention_xla,
                         max_running_requests=4, max_extend_tokens=64, context_length=128, lora=lora)
    for slot, name in ((1, "a"), (2, "b")):
        runner.write_lora_slot(slot, lora_lib.load_adapter(adapters[name], config, lora))
    tokenizer = load_tokenizer("default")
    prompt = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    assert len(prompt) <= page
    got = np.asarray(runner.forward([BatchEntry(prompt, 0, [1 + slot], lora_slot=slot) for slot in range(3)]))
    for row, name in enumerate([None, "a", "b"]):
        want = peft_last_logits(reference, name, prompt)
        err = np.linalg.norm(got[row] - want) / np.linalg.norm(want)
        assert err <= 1e-4, (name, float(err))
    assert np.abs(got[0] - got[1]).max() > 1e-2  # the adapter changes the logits
