"""Loader errors, the architecture registry and the converted-weights cache."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxserve.model.config import ModelConfig
from jaxserve.model.gguf_header import read_gguf_header
from jaxserve.model.loader import load_model, read_gguf_tensors, read_model_config
from jaxserve.model.registry import get_model_class
from tests.conftest import make_hf_checkpoint
from tests.model.gguf_reference import assert_same_tensors, load_model_through_gguf_reader, reader_tensors

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
    with pytest.raises(ValueError, match="unsupported architecture .GPT2LMHeadModel.; supported: Gemma2ForCausalLM"):
        load_model(path, use_weights_cache=False)
    with pytest.raises(ValueError, match="MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def _write_header_only_gguf(path, raw, raw_dtype, context_length: int | None = 64) -> str:
    """A llama GGUF with the config keys and a `token_embd.weight` of 128 rows, no other tensor."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    keys = {"block_count": 1, "context_length": context_length, "embedding_length": 32, "feed_forward_length": 64,
            "attention.head_count": 2, "attention.layer_norm_rms_epsilon": 1e-5}
    for key, value in keys.items():
        if value is not None:
            add = w.add_uint32 if isinstance(value, int) else w.add_float32
            add(f"llama.{key}", value)
    w.add_tensor("token_embd.weight", raw, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_unsupported_gguf_quantization(tmp_path):
    gguf = pytest.importorskip("gguf")
    raw = np.zeros((128, 66), np.uint8)  # one IQ2_XXS block (66 bytes, 256 values) per row: a type we reject
    path = _write_header_only_gguf(tmp_path / "tiny.gguf", raw, gguf.GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(ValueError, match="unsupported GGUF quantization type IQ2_XXS"):
        load_model(path, use_weights_cache=False)


def _write_tensor_gguf(path, endianess: str = "little", alignment: int | None = None) -> str:
    """One tensor of each kind the loader meets: plain (F32 2-D and 1-D, F16, I32) and blocks of bytes
    (BF16, Q8_0, Q4_1 quantized from random values; Q4_K, Q6_K as raw blocks)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.LITTLE if endianess == "little" else gguf.GGUFEndian.BIG)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    values = rng.standard_normal((3, 256)).astype(np.float32)
    w.add_tensor("f32.weight", values)
    w.add_tensor("f32_1d.weight", values[0, :7].copy())
    w.add_tensor("f16.weight", values.astype(np.float16))
    w.add_tensor("i32.weight", np.arange(12, dtype=np.int32).reshape(3, 4))
    for q in (Q.BF16, Q.Q8_0, Q.Q4_1):
        w.add_tensor(f"{q.name.lower()}.weight", gguf.quants.quantize(values, q), raw_dtype=q)
    for q in (Q.Q4_K, Q.Q6_K):
        type_size = gguf.GGML_QUANT_SIZES[q][1]
        w.add_tensor(f"{q.name.lower()}.weight", rng.integers(0, 256, (3, type_size), dtype=np.uint8), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("endianess, alignment", [("little", None), ("big", None), ("little", 64), ("little", 1)])
def test_gguf_tensor_views_are_gguf_readers(tmp_path, endianess, alignment):
    """`read_gguf_tensors` gives what GGUFReader's `ReaderTensor.data` gave: dtype (byte order too),
    shape and bytes, wherever `general.alignment` and the byte order put them."""
    path = _write_tensor_gguf(tmp_path / "t.gguf", endianess, alignment)
    ours = list(read_gguf_tensors(path, read_gguf_header(path)))
    assert_same_tensors(ours, reader_tensors(path))
    assert ours[0][1].dtype == np.dtype(np.float32).newbyteorder("<" if endianess == "little" else ">")
    assert ours[4][1].shape == (3, 512) and ours[4][1].dtype == np.uint8  # BF16: two bytes a value


def test_truncated_gguf_tensor_data(tmp_path):
    import gguf

    data = open(_write_tensor_gguf(tmp_path / "t.gguf"), "rb").read()
    (tmp_path / "cut.gguf").write_bytes(data[:-40])  # past the padding after the last tensor
    path = str(tmp_path / "cut.gguf")
    with pytest.raises(ValueError, match="tensor q6_k.weight's data runs past the end of the file"):
        list(read_gguf_tensors(path, read_gguf_header(path)))
    with pytest.raises(ValueError):  # GGUFReader's own error (a reshape of the short view)
        gguf.GGUFReader(path)


@pytest.mark.slow
def test_the_default_models_params_are_what_gguf_reader_gave():
    """The converted params, bit for bit, from `read_gguf_tensors`' views and from GGUFReader's data."""
    from jaxserve.model.tokenizer import default_model_path

    path = default_model_path()
    assert_same_tensors(list(read_gguf_tensors(path, read_gguf_header(path))), reader_tensors(path))
    config, params = load_model(path, "float32", use_weights_cache=False)
    ref_config, ref = load_model_through_gguf_reader(path, "float32")
    assert config == ref_config and jax.tree.structure(params) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _refuse_weight_reads(monkeypatch) -> None:
    """Reading or dequantizing a tensor fails the test: the metadata-only path must not get there."""
    import gguf
    import safetensors

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)


@pytest.fixture
def no_weight_reads(monkeypatch):
    _refuse_weight_reads(monkeypatch)


def test_read_model_config_of_an_hf_directory_is_load_models_without_reading_weights(tmp_path, monkeypatch):
    from transformers import AutoConfig

    path = make_hf_checkpoint(tmp_path / "m", "LlamaForCausalLM", TINY)
    loaded, _ = load_model(path, use_weights_cache=False)
    _refuse_weight_reads(monkeypatch)
    config = read_model_config(path)
    assert config == loaded
    reference = AutoConfig.from_pretrained(path)  # transformers' own reading of config.json
    assert (config.max_position_embeddings, config.vocab_size, config.num_kv_heads) == (
        reference.max_position_embeddings, reference.vocab_size, reference.num_key_value_heads)


def test_read_model_config_of_a_gguf_reads_the_header_only(tmp_path, no_weight_reads):
    import gguf

    embed = np.zeros((128, 32), np.float32)
    config = read_model_config(_write_header_only_gguf(tmp_path / "m.gguf", embed, gguf.GGMLQuantizationType.F32))
    assert (config.architecture, config.vocab_size, config.hidden_size, config.num_layers) == (
        "LlamaForCausalLM", 128, 32, 1)
    assert config.max_position_embeddings == 64 and config.tie_word_embeddings  # no output.weight: tied
    no_length = _write_header_only_gguf(tmp_path / "n.gguf", embed, gguf.GGMLQuantizationType.F32,
                                        context_length=None)
    assert read_model_config(no_length).max_position_embeddings == 2048  # llama.cpp's default, as before


def test_read_model_config_of_the_default_model_gives_smollm2s_card(no_weight_reads):
    config = read_model_config("default")
    assert (config.max_position_embeddings, config.vocab_size, config.num_layers) == (8192, 49152, 30)
    assert config.hidden_size == 576 and config.num_heads == 9 and config.num_kv_heads == 3  # SmolLM2-135M's card


@pytest.mark.parametrize("name, error", [("nope", FileNotFoundError), ("weights.bin", ValueError)])
def test_read_model_config_errors(tmp_path, name, error):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(error):
        read_model_config(str(tmp_path / name))
    (tmp_path / "d").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_model_config(str(tmp_path / "d"))


def test_bad_dtype(tmp_path):
    path = make_hf_checkpoint(tmp_path / "m", "LlamaForCausalLM", TINY)
    with pytest.raises(ValueError, match="unsupported dtype 'float8'"):
        load_model(path, dtype="float8")


@pytest.mark.parametrize("arch,extra", [
    ("LlamaForCausalLM", {}),
    # a config with tuples (layer_types) and the window fields, and two more norms a layer
    ("Gemma3ForCausalLM", dict(num_hidden_layers=2, head_dim=16, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"])),
])
def test_weights_cache_roundtrip(tmp_path, arch, extra):
    path = make_hf_checkpoint(tmp_path / "m", arch, dict(TINY, **extra))
    cache = tmp_path / "cache"
    cfg1, p1 = load_model(path, "float32", weights_cache_dir=str(cache), use_weights_cache=True)
    assert any(cache.iterdir()), "first load writes the cache"
    cfg2, p2 = load_model(path, "float32", weights_cache_dir=str(cache), use_weights_cache=True)
    assert isinstance(cfg2, ModelConfig) and cfg1 == cfg2
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(p1) == jax.tree.structure(p2)


def test_two_processes_write_the_weights_cache_at_once(tmp_path):
    """The workers of --dp-size 2 convert the same checkpoint together. Before: both wrote into one
    "<key>.tmp" directory, each deleting the other's files (orbax ERROR tracebacks in the log, a cache
    that only one of them, if any, managed to write)."""
    import subprocess
    import sys

    path = make_hf_checkpoint(tmp_path / "m", "LlamaForCausalLM", TINY)
    cache = tmp_path / "cache"
    code = ("import logging, sys; logging.basicConfig(level=logging.WARNING); "
            "from jaxserve.model.loader import load_model; "
            f"load_model({path!r}, 'float32', weights_cache_dir={str(cache)!r}, use_weights_cache=True); print('loaded')")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0 and "loaded" in out, out
        assert "could not write weights cache" not in out and "Traceback" not in out, out
    entries = sorted(e.name for e in cache.iterdir())
    assert len(entries) == 1 and ".tmp" not in entries[0], entries  # one cache, no temporary left behind
    _, cached = load_model(path, "float32", weights_cache_dir=str(cache), use_weights_cache=True)
    _, fresh = load_model(path, "float32", use_weights_cache=False)
    for a, b in zip(jax.tree.leaves(cached), jax.tree.leaves(fresh)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
