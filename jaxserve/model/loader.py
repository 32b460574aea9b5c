"""Weight loading: HF safetensors directories and GGUF files -> (ModelConfig, params dict).

The params are the plain nested dict of `functional.abstract_params(config)` (the Flax model's
`nnx.to_pure_dict` form), filled by path: `params["layers"][i]["attention"]["wqkv"]` and so on.

A GGUF file is read without `gguf.GGUFReader` (which parses the tokenizer's arrays too: seconds for
Gemma 3's vocabulary): `gguf_header` reads the header, skipping the vocabulary, and `read_gguf_tensors`
views each tensor's bytes in a memory map; the `gguf` package dequantizes them. llama.cpp's converter
permutes the rows of Q and K of llama models so that RoPE pairs are interleaved (GGML's rope layout);
the loader undoes it to get HF's rotate-half layout (see `_unpermute_qk`). Qwen2/Qwen3 GGUFs are not
permuted.

A converted-weights cache (orbax-checkpoint; `use_weights_cache`, the server's `--weights-cache`) keeps the
params pytree in the chosen dtype, keyed by the source files' names, sizes and mtimes and the dtype, so
later starts skip parsing and dequantizing. It is off by default: a GGUF now converts faster than the
cache restores it (D-23).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from jaxserve.model import decoder, functional
from jaxserve.model.config import ModelConfig
from jaxserve.model.gguf_header import GGUFHeader, GGUFTensorInfo, read_gguf_header
from jaxserve.model.registry import get_model_class
from jaxserve.model.tokenizer import cache_root, resolve_model_path, source_fingerprint
from jaxserve.quant import formats

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# --quantization values that keep weights in block formats (jaxserve.quant.formats): "gguf" keeps a GGUF's
# own types (each weight's format from its tensors' types), "q8_0" and "q4_1" quantize any checkpoint at
# load (q4_1: the layer projections in 4 bits, the embedding and the head in q8_0)
BLOCK_QUANTIZATIONS = ("gguf", "q8_0", "q4_1")
# block-format weight name -> the HF tensors (their names' endings) it is built from
_BLOCK_WEIGHT_SOURCES = {
    "embed": ("model.embed_tokens.weight",),
    "lm_head": ("lm_head.weight",),
    "wqkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "wo": ("self_attn.o_proj.weight",),
    "w_gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "w_down": ("mlp.down_proj.weight",),
}


@dataclasses.dataclass(frozen=True)
class BlockTensor:
    """One checkpoint tensor kept in a block format: `fmt` and its arrays (rows flattened, [O, ...])."""

    fmt: str
    arrays: formats.QuantArrays

    def to_format(self, fmt: str) -> "BlockTensor":
        """This tensor in `fmt`: itself, or dequantized and packed again (q4_1 -> q8_0 is within half a
        q8_0 step; the other way is refused by the format choice, never done)."""
        if fmt == self.fmt:
            return self
        return BlockTensor(fmt, _PACK[fmt](formats.dequantize_numpy(self.fmt, self.arrays)))

    def map_rows(self, fn) -> "BlockTensor":
        """`fn` applied to every array (each [O, ...]), e.g. a row permutation."""
        return BlockTensor(self.fmt, {k: fn(v) for k, v in self.arrays.items()})


_PACK = {formats.Q8_0: formats.pack_q8_0, formats.Q4_1: formats.pack_q4_1, formats.Q5_0: formats.pack_q5_0}
_BLOCK_SOURCE_NAMES = tuple(n for sources in _BLOCK_WEIGHT_SOURCES.values() for n in sources)

# HF tensor name suffix -> HF projection name (weights stay in the checkpoint's [out, in] layout)
_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}
# Gemma 2/3 (four norms a layer): HF's post_attention_layernorm is the norm after attention there,
# where Llama's is the norm before the MLP
_HF_GEMMA_LAYER_NAMES = {
    **_HF_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}
# path of a layer param in the params dict -> the HF tensors it is built from (see `_layer_param`)
_LAYER_PATHS = {
    ("post_attn_norm",): ("post_attn_norm",),
    ("post_mlp_norm",): ("post_mlp_norm",),
    ("attn_norm",): ("attn_norm",),
    ("attention", "wqkv"): ("q_proj", "k_proj", "v_proj"),
    ("attention", "wo"): ("o_proj",),
    ("attention", "bqkv"): ("q_bias", "k_bias", "v_bias"),
    ("attention", "q_norm"): ("q_norm",),
    ("attention", "k_norm"): ("k_norm",),
    ("mlp_norm",): ("mlp_norm",),
    ("mlp", "w_gate_up"): ("gate_proj", "up_proj"),
    ("mlp", "w_down"): ("down_proj",),
}
# bumped whenever the params pytree's layout changes, so that stale converted-weights caches are rebuilt
PARAMS_LAYOUT_VERSION = 3
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GEMMA_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def resolve_dtype(dtype: str) -> jnp.dtype:
    """`auto` -> float32 on CPU (a bf16 scatter on XLA:CPU converts the whole pool), bfloat16 elsewhere.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    model_path: str,
    dtype: str = "auto",
    weights_cache_dir: str | None = None,
    use_weights_cache: bool = False,
    quantization: str | None = None,
) -> tuple[ModelConfig, decoder.Params]:
    """Load a checkpoint as (config, params dict on the default device, per-layer storage).

    Args:
        model_path: an HF directory with `config.json` and `*.safetensors`, a `.gguf` file, or "default".
        dtype: auto | float32 | bfloat16 | float16.
        weights_cache_dir: where converted params are cached (default `cache_root()/weights`).
        use_weights_cache: read and write that cache (off by default: converting a GGUF is as fast as
            restoring it, D-23; never with block formats, which convert without dequantizing).
        quantization: one of `BLOCK_QUANTIZATIONS` (the weights stay in block formats:
            `config.weight_formats` says which), or None for float weights in `dtype`.

    Raises:
        FileNotFoundError: the path does not exist, or a directory holds no safetensors weights.
        ValueError: an unsupported architecture, quantization type or dtype.
    """
    path = resolve_model_path(model_path)
    jdtype = resolve_dtype(dtype)
    if quantization is not None and quantization not in BLOCK_QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization!r} is not a block format: one of {', '.join(BLOCK_QUANTIZATIONS)}")
    if quantization == "gguf" and not path.endswith(".gguf"):
        raise ValueError(f"--quantization gguf needs a .gguf file; {path} is not one (give q8_0 or q4_1)")
    if use_weights_cache and quantization is not None:
        logger.info("--quantization %s converts without dequantizing: the converted-weights cache is not used",
                    quantization)
        use_weights_cache = False
    if os.path.isdir(path) and not glob.glob(os.path.join(path, "*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors weights in directory {path}")
    _check_model_path(path)
    if os.path.isdir(path):
        config = _config_from_hf_dir(path)
    else:
        config = None  # a GGUF's config comes from the reader that also yields its tensors

    cache_dir = None
    if use_weights_cache:
        key = source_fingerprint(path, extra=f"{jnp.dtype(jdtype).name}-layout{PARAMS_LAYOUT_VERSION}")
        cache_dir = Path(weights_cache_dir or cache_root() / "weights") / key
        if (cache_dir / "config.json").is_file():
            try:
                return _restore(cache_dir)
            except Exception as e:  # a stale or partial cache is rebuilt, never fatal
                logger.warning("weights cache %s unreadable (%s); reloading from source", cache_dir, e)

    if config is None:
        config, tensors = _read_gguf(path, keep_blocks=quantization == "gguf")
    else:
        tensors = _read_safetensors(path)
    if quantization is not None:
        config = dataclasses.replace(config, quantization=quantization,
                                     weight_formats=_weight_formats(config, quantization, path))
    get_model_class(config.architecture)  # an unsupported architecture fails before any weight is read
    # committed to the default device, as params restored from the cache are: jit keys its executables
    # (and the persistent compilation cache) on that, so both starts then share compiled programs
    params = jax.device_put(_assemble(config, tensors, jdtype), jax.local_devices()[0])
    if cache_dir is not None:
        try:
            _save(cache_dir, config, params)
        except Exception as e:
            logger.warning("could not write weights cache %s: %s", cache_dir, e)
    return config, params


def read_model_config(model_path: str) -> ModelConfig:
    """A checkpoint's ModelConfig from its metadata alone: an HF directory's config.json, or a GGUF
    file's key/value header and tensor infos (the vocabulary size is the shape of `token_embd.weight`).
    No weights are read, and neither is the tokenizer's part of the header: `gguf_header` skips the
    `tokenizer.ggml.*` arrays by their sizes (`gguf.GGUFReader` parses them into one numpy view per
    entry). Measured on the shared 2-core machine, fresh process: Gemma 3 270m's Q4_K_M file
    (262,144-entry vocabulary) 0.02 s with no lasting RSS (GGUFReader: 8.0 s, RSS +684 MB); the default
    model's 98 MB Q4_1 file 0.008 s (GGUFReader: 1.9 s, +159 MB); `load_model("default")` from the
    warm weights cache: RSS +540 to +680 MB. It is the same config `load_model` builds, so that a check made
    before the model loads (serve.py's --context-length against `max_position_embeddings`) sees what
    the engine will.

    Args:
        model_path: an HF directory with `config.json`, a `.gguf` file, or "default".

    Raises:
        FileNotFoundError: the path does not exist, or a directory has no config.json.
        ValueError: not a directory or a .gguf file, an unreadable GGUF header, or an unsupported
            architecture.
    """
    path = resolve_model_path(model_path)
    _check_model_path(path)
    if os.path.isdir(path):
        return _config_from_hf_dir(path)
    return _config_from_gguf(path)


def _check_model_path(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"no config.json in directory {path}")
    elif not path.endswith(".gguf"):
        raise ValueError(f"model path must be a directory with safetensors or a .gguf file: {path}")


def _config_from_hf_dir(path: str) -> ModelConfig:
    from transformers import AutoConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    get_model_class(config.architecture)  # an unsupported architecture fails before any weight is read
    return config


def _read_safetensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
    for name in files:
        with safe_open(os.path.join(path, name), framework="numpy") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def read_gguf_tensors(path: str, header: GGUFHeader) -> Iterator[tuple[GGUFTensorInfo, np.ndarray]]:
    """Each tensor's info and its data, in file order, as read-only views of a memory map (nothing is
    copied or decoded here). Each view is what `gguf.GGUFReader`'s `ReaderTensor.data` is, dtype
    (byte order included) and shape alike, so `gguf.quants.dequantize` takes it as before: the plain
    types (F32, F16, F64, I8 to I64) as their numpy dtype in numpy order `[..., ne0]`, every other type
    (the quantized ones, BF16) as uint8 rows of blocks `[..., ne0 / block_size * type_size]`.
    In place of GGUFReader, Gemma 3 270m's cold `load_model` (weights cache off, fresh process) took
    1.9-4.5 s instead of 15.5-23.1 s (shared 2-core machine, load average 5-6).

    Args:
        path: the `.gguf` file `header` was read from (`gguf_header.read_gguf_header`).

    Raises:
        ValueError: an unknown GGML type, a row that is not a whole number of blocks, or data past
            the end of the file.
    """
    import gguf

    plain = {
        gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
        gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
        gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
        gguf.GGMLQuantizationType.I64: np.int64,
    }
    data = np.memmap(path, mode="r")
    for t in header.tensors:
        try:
            ggml_type = gguf.GGMLQuantizationType(t.ggml_type)
        except ValueError:
            raise ValueError(f"{path}: tensor {t.name} has unknown GGML type {t.ggml_type}") from None
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        np_shape = tuple(reversed(t.shape))
        num_bytes = int(np.prod(t.shape, dtype=np.int64)) * type_size // block_size
        if ggml_type in plain:
            dtype = np.dtype(plain[ggml_type]).newbyteorder(header.byteorder)
        else:
            dtype = np.dtype(np.uint8)
            np_shape = gguf.quants.quant_shape_to_byte_shape(np_shape, ggml_type)
        start = header.data_offset + t.offset
        if start + num_bytes > len(data):
            raise ValueError(f"{path}: tensor {t.name}'s data runs past the end of the file (truncated GGUF)")
        yield t, data[start : start + num_bytes].view(dtype).reshape(np_shape)


def _weight_formats(config: ModelConfig, quantization: str, path: str) -> tuple[tuple[str, str], ...]:
    """Each block weight's format under `quantization` (a row length that is not a multiple of 32 stays
    float). "gguf": q4_1 where every tensor of the weight (in every layer) is a 4-bit type, q5_0 where every
    one is Q5_0, else q8_0 (formats.format_of_gguf_type, formats.common_format); "q8_0": every weight in q8_0; "q4_1": the layer projections in q4_1,
    the embedding and the head in q8_0."""
    in_features = {"embed": config.hidden_size, "lm_head": config.hidden_size, "wqkv": config.hidden_size,
                   "wo": config.num_heads * config.head_dim, "w_gate_up": config.hidden_size,
                   "w_down": config.intermediate_size}
    names = [n for n in _BLOCK_WEIGHT_SOURCES if n != "lm_head" or not config.tie_word_embeddings]
    if quantization == "gguf":
        gguf_types: dict[str, list[int]] = {}
        for t in read_gguf_header(path, keep_key=_is_config_key).tensors:
            hf_name = _gguf_to_hf_name(t.name, _GGUF_GEMMA_LAYER_NAMES if config.architecture in _GEMMA_ARCHITECTURES else _GGUF_LAYER_NAMES)
            for name, sources in _BLOCK_WEIGHT_SOURCES.items():
                if hf_name is not None and hf_name.endswith(sources):
                    gguf_types.setdefault(name, []).append(t.ggml_type)
        chosen = {n: formats.common_format([formats.format_of_gguf_type(k) for k in gguf_types.get(n, [])] or [formats.Q4_1])
                  for n in names}
    else:
        chosen = {n: formats.Q8_0 if quantization == "q8_0" or n in ("embed", "lm_head") else formats.Q4_1 for n in names}
    return tuple((n, fmt) for n, fmt in chosen.items() if in_features[n] % formats.BLOCK == 0)


def _read_gguf(path: str, keep_blocks: bool = False) -> tuple[ModelConfig, Iterator[tuple[str, np.ndarray | BlockTensor]]]:
    """The GGUF's config and its tensors by HF name: float32 arrays, or with `keep_blocks` the weights of
    `_BLOCK_WEIGHT_SOURCES` as `BlockTensor`s, never dequantized."""
    import gguf

    header = read_gguf_header(path, keep_key=_is_config_key)
    config = _config_from_gguf_header(header)
    arch = header.metadata["general.architecture"]

    supported = {
        gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16,
        gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
        gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q5_1, gguf.GGMLQuantizationType.Q4_K,
        gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.Q2_K,
        gguf.GGMLQuantizationType.Q3_K,
    }
    for t in header.tensors:
        if t.ggml_type not in supported:
            try:
                name = gguf.GGMLQuantizationType(t.ggml_type).name
            except ValueError:
                name = f"id {t.ggml_type}"
            raise ValueError(
                f"unsupported GGUF quantization type {name} (tensor {t.name}); "
                f"supported: {', '.join(sorted(q.name for q in supported))}"
            )

    is_gemma = config.architecture in _GEMMA_ARCHITECTURES

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for t, data in read_gguf_tensors(path, header):
            hf_name = _gguf_to_hf_name(t.name, _GGUF_GEMMA_LAYER_NAMES if is_gemma else _GGUF_LAYER_NAMES)
            if hf_name is None:
                continue
            if keep_blocks and hf_name.endswith(_BLOCK_SOURCE_NAMES):
                block = BlockTensor(*formats.from_gguf(data, t.ggml_type, tuple(int(d) for d in reversed(t.shape))))
                if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
                    heads = config.num_heads if "attn_q" in t.name else config.num_kv_heads
                    block = block.map_rows(lambda a: _unpermute_qk(a, heads))
                yield hf_name, block
                continue
            w = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(t.ggml_type))
            w = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
            if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = config.num_heads if "attn_q" in t.name else config.num_kv_heads
                w = _unpermute_qk(w, heads)
            if is_gemma and t.name.endswith("norm.weight"):
                # llama.cpp's converter stores Gemma's norm weights as 1 + w; undone as transformers does
                w = w - np.float32(1.0)
            yield hf_name, w

    return config, tensors()


def _config_from_gguf(path: str) -> ModelConfig:
    return _config_from_gguf_header(read_gguf_header(path, keep_key=_is_config_key))


def _config_from_gguf_header(header: GGUFHeader) -> ModelConfig:
    shapes = {t.name: t.shape for t in header.tensors}
    if "token_embd.weight" not in shapes:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    config = ModelConfig.from_gguf_metadata(
        header.metadata, int(shapes["token_embd.weight"][1]), tie_word_embeddings="output.weight" not in shapes)
    get_model_class(config.architecture)  # an unsupported architecture fails before any weight is read
    return config


def _is_config_key(key: str) -> bool:
    # the vocabulary, scores and merges are large, and the tokenizer's, not the model's
    return not key.startswith("tokenizer.ggml.") or key.endswith("_token_id")


def _gguf_to_hf_name(name: str, layer_names: dict[str, str]) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in layer_names:
            return f"model.layers.{idx}.{layer_names[rest]}"
    return None


def _unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows: [heads, 2, D/2] (HF) was stored as [heads, D/2, 2]."""
    out_dim = w.shape[0]
    return w.reshape(num_heads, out_dim // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _assemble(config: ModelConfig, tensors, dtype) -> decoder.Params:
    layers: dict[str, list] = {}
    globals_: dict[str, np.ndarray] = {}
    expected = sum(1 for _ in _expected_layer_tensors(config)) * config.num_layers
    # disable=None: no bar where stderr is no terminal, so a log file gets whole lines, not `\r` fragments
    bar = tqdm(total=expected + 2, desc="Loading weights", unit="tensor", leave=False, disable=None)
    layer_names = _HF_GEMMA_LAYER_NAMES if config.architecture in _GEMMA_ARCHITECTURES else _HF_LAYER_NAMES
    for name, w in tensors:
        if name.startswith("model.layers."):
            _, _, idx, rest = name.split(".", 3)
            if rest not in layer_names:
                continue
            layers.setdefault(layer_names[rest], [None] * config.num_layers)[int(idx)] = _to_numpy(w)
            bar.update()
        elif name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            globals_[name] = _to_numpy(w)
            bar.update()
    bar.close()
    missing = [f for f in _expected_layer_tensors(config) if f not in layers or any(x is None for x in layers[f])]
    if missing or "model.embed_tokens.weight" not in globals_ or "model.norm.weight" not in globals_:
        raise ValueError(f"checkpoint is missing weights: {missing or 'embed/norm'}")
    hf_globals = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    packed: dict[tuple, BlockTensor] = {}  # a block weight's path -> its arrays, each built once

    def fill(path: tuple, spec) -> jax.Array:
        block = _block_leaf(config, path)
        if block is not None:
            base, field = block
            if base not in packed:
                sources = ([layers[part][base[1]] for part in _LAYER_PATHS[base[2:]]] if base[0] == "layers"
                           else [globals_[hf_globals[base[0]]]])
                packed[base] = _block_param(config, base[-1], sources)
            value = packed[base].arrays[field]
            if value.shape != spec.shape or value.dtype != spec.dtype:
                raise ValueError(f"checkpoint tensor for {'/'.join(map(str, path))} is {value.dtype}{value.shape}, "
                                 f"expected {spec.dtype}{spec.shape}")
            return jnp.asarray(value)
        if path[0] == "layers":
            value = _layer_param(config, path[2:], [layers[part][path[1]] for part in _LAYER_PATHS[path[2:]]])
        else:
            value = globals_[hf_globals[path[0]]]
        if value.shape != spec.shape:
            raise ValueError(f"checkpoint tensor for {'/'.join(map(str, path))} has shape {value.shape}, expected {spec.shape}")
        return jnp.asarray(value, dtype=dtype)

    return _map_with_path(fill, functional.abstract_params(config, dtype))


def _block_leaf(config: ModelConfig, path: tuple) -> tuple[tuple, str] | None:
    """(the block weight's path, the field) of a params leaf that holds a block-format array, else None:
    `wqkv` is wqkv's qs, `wqkv_scale` its scale, `wqkv_min` its min."""
    name = path[-1]
    if not isinstance(name, str):
        return None
    for suffix, field in (("_scale", "scale"), ("_min", "min")):
        if name.endswith(suffix) and config.weight_format(name[: -len(suffix)]) is not None:
            return path[:-1] + (name[: -len(suffix)],), field
    return (path, "qs") if config.weight_format(name) is not None else None


def _block_param(config: ModelConfig, name: str, parts: list) -> BlockTensor:
    """Block weight `name` in `config.weight_format(name)` from its checkpoint tensors (float arrays or
    `BlockTensor`s): Q/K/V rows regrouped per kv head as `_layer_param` does, gate and up rows stacked."""
    fmt = config.weight_format(name)
    blocks = [p.to_format(fmt) if isinstance(p, BlockTensor) else BlockTensor(fmt, _PACK[fmt](p)) for p in parts]
    if name == "wqkv":
        nkv = config.num_kv_heads
        return BlockTensor(fmt, {
            field: np.concatenate([b.arrays[field].reshape(nkv, -1, b.arrays[field].shape[-1]) for b in blocks],
                                  axis=1).reshape(-1, blocks[0].arrays[field].shape[-1])
            for field in formats.FIELDS[fmt]
        })
    if name == "w_gate_up":
        return BlockTensor(fmt, {f: np.concatenate([b.arrays[f] for b in blocks]) for f in formats.FIELDS[fmt]})
    return blocks[0]


def _layer_param(config: ModelConfig, path: tuple, parts: list[np.ndarray]) -> np.ndarray:
    """One layer param from its HF tensors: Q/K/V (weights or biases) regrouped per kv head into
    [KVH, (G + 2) D, ...], gate/up stacked into [2, I, E], the rest as they are."""
    if path[-1] in ("wqkv", "bqkv"):
        nkv, d = config.num_kv_heads, config.head_dim
        q, k, v = (p.reshape(nkv, -1, *p.shape[1:]) for p in parts)  # [KVH, G D | D, ...]
        assert q.shape[1] == config.group_size * d and k.shape[1] == d, (q.shape, k.shape)
        return np.concatenate([q, k, v], axis=1)
    if path[-1] == "w_gate_up":
        return np.stack(parts)
    return parts[0]


def _map_with_path(fn, tree: dict, prefix: tuple = ()) -> dict:
    """`fn(path, leaf)` over a nested dict (the params' form), keeping None leaves."""
    return {
        k: (_map_with_path(fn, v, prefix + (k,)) if isinstance(v, dict) else (None if v is None else fn(prefix + (k,), v)))
        for k, v in tree.items()
    }


def replicate_kv_heads(config: ModelConfig, params: decoder.Params, factor: int) -> tuple[ModelConfig, decoder.Params]:
    """Copy each kv head `factor` times (tensor parallelism over more devices than kv heads): the config
    then has `num_kv_heads * factor` kv heads, each serving `group_size / factor` query heads, and the
    outputs are unchanged (query head h still reads the K/V of HF kv head h // group_size).

    Raises:
        ValueError: `factor` does not divide the GQA group size.
    """
    if factor == 1:
        return config, params
    g, d = config.group_size, config.head_dim
    if g % factor:
        raise ValueError(f"cannot replicate {config.num_kv_heads} kv heads {factor} times: {g} query heads per kv head")
    new = dataclasses.replace(config, num_kv_heads=config.num_kv_heads * factor)

    def regroup(x):  # [KVH, (G + 2) D, ...] -> [KVH f, (G / f + 2) D, ...]
        q, kv = x[:, : g * d], x[:, g * d :]
        q = q.reshape(new.num_kv_heads, (g // factor) * d, *x.shape[2:])
        return jnp.concatenate([q, jnp.repeat(kv, factor, axis=0)], axis=1)

    layers = {}
    for i, layer in params["layers"].items():
        attn = dict(layer["attention"])
        for name in ("wqkv", "bqkv"):
            if attn.get(name) is not None:
                attn[name] = regroup(attn[name])
        layers[i] = {**layer, "attention": attn}
    return new, {**params, "layers": layers}


def _expected_layer_tensors(config: ModelConfig):
    yield from ("attn_norm", "q_proj", "k_proj", "v_proj", "o_proj", "mlp_norm", "gate_proj", "up_proj", "down_proj")
    if config.attention_bias:
        yield from ("q_bias", "k_bias", "v_bias")
    if config.qk_norm:
        yield from ("q_norm", "k_norm")
    if config.architecture in _GEMMA_ARCHITECTURES:
        yield from ("post_attn_norm", "post_mlp_norm")


def _to_numpy(w) -> np.ndarray | BlockTensor:
    if isinstance(w, BlockTensor):
        return w
    w = np.asarray(w)
    if w.dtype == ml_dtypes.bfloat16 or w.dtype == np.float16:
        return w.astype(np.float32)
    return w


def _save(cache_dir: Path, config: ModelConfig, params: decoder.Params) -> None:
    import shutil

    import orbax.checkpoint as ocp

    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    # one temporary directory per process: the workers of --dp-size N convert the same checkpoint at the
    # same time, and a shared one had each delete and overwrite the other's files mid-write
    tmp = cache_dir.with_name(f"{cache_dir.name}.tmp-{os.getpid()}")
    for stale in cache_dir.parent.glob(f"{cache_dir.name}.tmp*"):
        if stale == tmp or not _pid_alive(stale.name.rpartition("-")[2]):
            shutil.rmtree(stale, ignore_errors=True)
    # orbax keys are strings: layer i is saved as "i"; None leaves (absent params) are left out
    tree = _drop_none({**params, "layers": {str(i): p for i, p in params["layers"].items()}})
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp.absolute() / "params", tree)
    (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
    try:
        tmp.rename(cache_dir)
    except OSError:  # another process saved the same weights first: theirs stays
        shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: str) -> bool:
    """Whether a process with this id (a decimal string; anything else: no) runs on this host."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _drop_none(tree: dict) -> dict:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in tree.items() if v is not None}


def _restore(cache_dir: Path) -> tuple[ModelConfig, decoder.Params]:
    import orbax.checkpoint as ocp

    from jaxserve.model.config import RopeScaling

    raw = json.loads((cache_dir / "config.json").read_text())
    raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
    raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
    raw["layer_types"] = tuple(raw.get("layer_types", ()))
    raw["weight_formats"] = tuple(tuple(pair) for pair in raw.get("weight_formats", ()))
    config = ModelConfig(**raw)
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(cache_dir.absolute() / "params")
    restored = {**restored, "layers": {int(i): p for i, p in restored["layers"].items()}}

    def fill(path: tuple, spec):
        node = restored
        for k in path:
            node = node[k]
        if node.shape != spec.shape:
            raise ValueError(f"cached {'/'.join(map(str, path))} has shape {node.shape}, expected {spec.shape}")
        return node

    return config, _map_with_path(fill, functional.abstract_params(config))
