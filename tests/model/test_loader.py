"""Loader errors, the architecture registry and the converted-weights cache."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.model.loader import load_model
from jaxserve.model.registry import get_forward
from tests.conftest import make_hf_checkpoint

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="model path does not exist"):
        load_model(str(tmp_path / "nope"))


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights in directory"):
        load_model(str(tmp_path))


def test_not_a_model_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="directory with safetensors or a .gguf file"):
        load_model(str(f))


def test_unsupported_architecture(tmp_path):
    path = make_hf_checkpoint(tmp_path / "m", "LlamaForCausalLM", TINY)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"):
        load_model(path, use_weights_cache=False)
    with pytest.raises(ValueError, match="MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        get_forward("GPT2LMHeadModel")


def test_unsupported_gguf_quantization(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
                       "attention.head_count": 2, "attention.layer_norm_rms_epsilon": 1e-5}.items():
        add = w.add_uint32 if isinstance(value, int) else w.add_float32
        add(f"llama.{key}", value)
    raw = np.zeros((128, 66), np.uint8)  # one IQ2_XXS block (66 bytes, 256 values) per row: a type we reject
    w.add_tensor("token_embd.weight", raw, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF quantization type IQ2_XXS"):
        load_model(str(path), use_weights_cache=False)


def test_bad_dtype(tmp_path):
    path = make_hf_checkpoint(tmp_path / "m", "LlamaForCausalLM", TINY)
    with pytest.raises(ValueError, match="unsupported dtype 'float8'"):
        load_model(path, dtype="float8")


def test_weights_cache_roundtrip(tmp_path):
    path = make_hf_checkpoint(tmp_path / "m", "LlamaForCausalLM", TINY)
    cache = tmp_path / "cache"
    cfg1, p1 = load_model(path, "float32", weights_cache_dir=str(cache))
    assert any(cache.iterdir()), "first load writes the cache"
    cfg2, p2 = load_model(path, "float32", weights_cache_dir=str(cache))
    assert isinstance(cfg2, ModelConfig) and cfg1 == cfg2
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(p1) == jax.tree.structure(p2)
