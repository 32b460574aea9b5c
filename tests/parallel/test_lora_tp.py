"""LoRA under tensor parallelism: tp 3 on three host devices gives the same greedy ids as tp 1 and as
PEFT for a batch mixing two adapters and the base model, with each adapter's A/B split like the weight
it adapts (column-parallel q/k/v/gate/up: B over its outputs; row-parallel o/down: A over its inputs)."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_LLAMA, make_hf_checkpoint
from tests.model.lora_helpers import make_peft_adapter, peft_greedy, peft_model
from tests.parallel.lora_tp_worker import NEW, PROMPTS
from tests.parallel.test_tensor_parallel import run_worker

# heads, kv heads and MLP units divisible by 3
TINY_LLAMA_TP3 = dict(TINY_LLAMA, hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=3)


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory, default_tokenizer):
    root = tmp_path_factory.mktemp("lora_tp")
    model = make_hf_checkpoint(root / "model", "LlamaForCausalLM", TINY_LLAMA_TP3, seed=4, tokenizer=default_tokenizer)
    return model, {
        "a": make_peft_adapter(model, str(root / "a"), seed=31, rank=8),
        "b": make_peft_adapter(model, str(root / "b"), seed=32, rank=4, targets=("k_proj", "o_proj", "up_proj")),
    }


def test_tp3_mixed_adapters_match_tp1_and_peft(model_and_adapters):
    model, adapters = model_and_adapters
    tp1, tp3 = run_worker(model, *(f"{k}={v}" for k, v in adapters.items()), "--tp", "1", "3", devices=3,
                          module="tests.parallel.lora_tp_worker")
    ref = peft_model(model, adapters)
    want = [peft_greedy(ref, name, p, NEW) for p in PROMPTS for name in (None, "a", "b")]
    assert tp1["outputs"] == want
    assert tp3["outputs"] == want
    specs = tp3["specs"]
    assert specs["qkv_b"] == "P('tensor', None, None, None)"  # over kv heads, as wqkv
    assert specs["gate_up_b"] == "P(None, 'tensor', None, None)"  # over I, as w_gate_up
    assert specs["o_a"] == specs["down_a"] == "P(None, None, 'tensor')"  # over their inputs, as wo and w_down
    assert "tensor" not in specs["qkv_a"] + specs["o_b"] + specs["down_b"]  # replicated: the embed axis is not split
