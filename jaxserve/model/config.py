"""The model's shape and numerics (`ModelConfig`), read from a transformers config (`from_hf`) or from GGUF
metadata (`from_gguf_metadata`); both produce the same fields, so the model code never looks at where the
weights came from. Frozen and hashable: it is a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxserve.model.architecture import GGUF_ARCHITECTURES, hf_architecture, unsupported_message


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    kind: "default" (none), "linear" (positions divided by `factor`) or "llama3" (the piecewise
    wavelength rescaling of Llama 3.1, see transformers' `_compute_llama3_parameters`).
    """

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Units: sizes are element counts; `rope_theta` is the RoPE base; `rms_norm_eps` the epsilon added to
    the mean square in RMSNorm.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # None: projections in the params' float dtype; "w8a8_int8": int8 weights with per-row scales and
    # per-token int8 activations (jaxserve.quant.w8a8, set by `w8a8.quantize_params` after loading)
    quantization: str | None = None
    # block-quantized weights kept compressed (jaxserve.quant.formats): each such weight's format by name
    # ("embed", "lm_head", "wqkv", "wo", "w_gate_up", "w_down"), the same in every layer; empty: none.
    # Set by the loader for `--quantization gguf` (from the file's types) and q8_0 / q4_1 (at load).
    weight_formats: tuple[tuple[str, str], ...] = ()
    # sliding-window attention (tokens): a query attends to the last `sliding_window` positions up to
    # its own, in the layers `layer_types` marks "sliding_attention" (every layer when `layer_types` is
    # empty: Mistral); None: no window anywhere
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Gemma 2/3 (jaxserve.model.gemma): the local (windowed) layers' RoPE base (Gemma 3; None: `rope_theta`),
    # the attention scale query_pre_attn_scalar ** -0.5, and soft-capping of attention scores and
    # final logits (Gemma 2: cap * tanh(x / cap); None: off)
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def weight_format(self, name: str) -> str | None:
        """The block format weight `name` is kept in (`weight_formats`), or None: float (or w8a8)."""
        return dict(self.weight_formats).get(name)

    @property
    def group_size(self) -> int:
        """Query heads per kv head (GQA group)."""
        return self.num_heads // self.num_kv_heads

    @property
    def has_sliding_window_layers(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return any(w is not None for w in self.layer_sliding_windows())

    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window in tokens (None: full attention)."""
        if self.sliding_window is None:
            return (None,) * self.num_layers
        if not self.layer_types:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @staticmethod
    def from_hf(hf_config: Any) -> "ModelConfig":
        """Build from a transformers `PretrainedConfig` (as returned by `AutoConfig`).

        Raises:
            ValueError: the architecture is not supported, or a field is missing.
        """
        arch = hf_architecture({"architectures": getattr(hf_config, "architectures", None),
                                "model_type": hf_config.model_type})
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rope_theta = getattr(hf_config, "rope_theta", None)
        rope_params = getattr(hf_config, "rope_parameters", None) or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        scaling = getattr(hf_config, "rope_scaling", None) or rope_params or None
        rope_local_theta = None
        if "full_attention" in rope_params:  # Gemma 3: RoPE parameters per layer type
            rope_theta = rope_params["full_attention"].get("rope_theta", 10000.0)
            scaling = rope_params["full_attention"]
            rope_local_theta = float(rope_params.get("sliding_attention", {}).get("rope_theta", rope_theta))
        layer_types = tuple(getattr(hf_config, "layer_types", None) or ())
        sliding_window = getattr(hf_config, "sliding_window", None)
        if "sliding_attention" not in layer_types:
            # Mistral windows every layer (it has no layer_types); Qwen2's layer_types say where it
            # uses its window (none unless use_sliding_window); Llama has no window
            layer_types = ()
            if arch != "MistralForCausalLM":
                sliding_window = None
        is_gemma = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
        return ModelConfig(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=_rope_scaling_from_dict(scaling),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 2048)),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
            sliding_window=int(sliding_window) if sliding_window is not None else None,
            layer_types=layer_types,
            rope_local_theta=rope_local_theta,
            query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar) if is_gemma else None,
            attn_logit_softcapping=_optional_float(getattr(hf_config, "attn_logit_softcapping", None)),
            final_logit_softcapping=_optional_float(getattr(hf_config, "final_logit_softcapping", None)),
        )

    @staticmethod
    def from_gguf_metadata(meta: Mapping[str, Any], vocab_size: int, tie_word_embeddings: bool) -> "ModelConfig":
        """Build from GGUF key/value metadata (keys like `llama.embedding_length`).

        `vocab_size` and `tie_word_embeddings` come from the tensors (a GGUF without `output.weight` ties
        the embeddings). Raises ValueError for a GGUF architecture not in `GGUF_ARCHITECTURES`.
        """
        arch = meta["general.architecture"]
        hf_arch = GGUF_ARCHITECTURES.get(arch)
        if hf_arch is None:
            raise ValueError(unsupported_message(arch, "GGUF"))
        num_heads = int(meta[f"{arch}.attention.head_count"])
        hidden = int(meta[f"{arch}.embedding_length"])
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
        scaling_type = meta.get(f"{arch}.rope.scaling.type")
        scaling = None
        if scaling_type == "linear":
            scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
        eos = meta.get("tokenizer.ggml.eos_token_id")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        num_layers = int(meta[f"{arch}.block_count"])
        sliding_window = meta.get(f"{arch}.attention.sliding_window")
        layer_types: tuple[str, ...] = ()
        gemma = {}
        if arch in ("gemma2", "gemma3"):
            # llama.cpp's layouts: Gemma 2 alternates local and global layers (local first), Gemma 3
            # has a global layer every sixth (llama.cpp's and transformers' default pattern); the local
            # RoPE base 10000 and query_pre_attn_scalar = head_dim are what both assume for these files
            period = 2 if arch == "gemma2" else 6
            layer_types = tuple("full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers))
            gemma = dict(
                query_pre_attn_scalar=float(head_dim),
                rope_local_theta=10000.0 if arch == "gemma3" else None,
                attn_logit_softcapping=_optional_float(meta.get(f"{arch}.attn_logit_softcapping")),
                final_logit_softcapping=_optional_float(meta.get(f"{arch}.final_logit_softcapping")),
            )
        return ModelConfig(
            architecture=hf_arch,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling_from_dict(scaling),
            rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "gemma3"),
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=(int(eos),) if eos is not None else (),
            sliding_window=int(sliding_window) if sliding_window is not None and layer_types else None,
            layer_types=layer_types,
            **gemma,
        )


def _optional_float(x) -> float | None:
    return None if x is None else float(x)


def _rope_scaling_from_dict(d: Mapping[str, Any] | None) -> RopeScaling:
    if not d:
        return RopeScaling()
    kind = d.get("rope_type", d.get("type", "default"))
    if kind in (None, "default"):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(d["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(d["factor"]),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
        )
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
