"""Gemma 2 and Gemma 3 decoders as flax.nnx Modules, subclasses of the shared decoder (jaxserve/model/decoder.py).

The facts, from transformers' modeling_gemma2.py and modeling_gemma3.py:
- the token embedding is scaled by sqrt(hidden_size) (in the weights' dtype);
- RMSNorm multiplies by (1 + w) in float32 (the weights are stored zero-centred, as in HF checkpoints;
  llama.cpp's GGUF stores 1 + w, which the loader undoes as transformers does);
- each layer has four norms: before and after attention, before and after the MLP (sandwich norms);
- the MLP is GeGLU: down(gelu_tanh(gate x) * up x);
- queries are scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- Gemma 3 normalizes each query and key head ((1 + w) RMSNorm) before RoPE; its local (sliding-window)
  layers use their own RoPE base (`rope_local_theta`, 10000) and the global ones `rope_theta` (1e6),
  with a global layer every sixth (`layer_types`);
- Gemma 2 alternates local and global layers and soft-caps the attention scores and the final logits
  (cap * tanh(x / cap));
- the output head is tied to the embedding (262,144 rows for Gemma 3).

The params tree has Llama's names where the tensor means the same (`attention/wqkv`, `attention/wo`,
`mlp/w_gate_up`, `mlp/w_down`, `attn_norm`, `mlp_norm`), so the loader, the quantization
(`--quantization w8a8_int8`) and tensor parallelism treat both families alike, plus `post_attn_norm` and
`post_mlp_norm`. The functional boundary (`functional.forward`, `functional.embed_tokens`, ...) is shared:
`functional.model_defs` builds these Modules for a Gemma config (jaxserve.model.registry).

RoPE tables: `Gemma.embed_tokens` returns cos and sin as [R, T, D], one table per RoPE base the model
uses (R = 2 for Gemma 3: global, local; R = 1 for Gemma 2); each layer picks its own.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int32

from jaxserve.model import decoder
from jaxserve.model.config import ModelConfig
from jaxserve.model.forward_batch import ForwardBatch
from jaxserve.pallas.numerics import pairwise_sum


def gemma_rms_norm(
    x: Float[Array, "..."], weight: Float[Array, " E"], eps: float, axis: int = -1
) -> Float[Array, "..."]:
    """Gemma's RMSNorm over `axis`: x / rms(x) * (1 + w), all in float32, cast back to x's dtype at
    the end (transformers' Gemma3RMSNorm; Llama casts before the weight)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(pairwise_sum(x32 * x32, axis) * (1.0 / x.shape[axis]) + eps)
    shape = [1] * x.ndim
    shape[axis] = -1
    return (x32 * (1.0 + weight.astype(jnp.float32).reshape(shape))).astype(x.dtype)


def _rope_bases(config: ModelConfig) -> tuple[float, ...]:
    """The RoPE bases of the model's tables: (global,) or (global, local)."""
    if config.rope_local_theta is None or config.rope_local_theta == config.rope_theta:
        return (config.rope_theta,)
    return (config.rope_theta, config.rope_local_theta)


def _layer_table(config: ModelConfig) -> np.ndarray:
    """The RoPE table index of each layer [L] (1 for Gemma 3's local layers, else 0)."""
    if len(_rope_bases(config)) == 1:
        return np.zeros(config.num_layers, np.int32)
    return np.array([w is not None for w in config.layer_sliding_windows()], np.int32)


class GemmaAttention(decoder.Attention):
    """Llama's attention (fused QKV, paged K/V write, ragged attention, output projection) with Gemma's
    (1 + w) q/k norms (Gemma 3), query scale, per-layer RoPE table and window, and score soft-capping."""

    def norm_qk(self, q: Float[Array, "T H D"], k: Float[Array, "T KVH D"]) -> tuple[Float[Array, "T H D"], Float[Array, "T KVH D"]]:
        eps = self.config.rms_norm_eps
        return gemma_rms_norm(q, self.q_norm[...], eps), gemma_rms_norm(k, self.k_norm[...], eps)

    def layer_rope(self, cos: Float[Array, "R T D"], sin: Float[Array, "R T D"], layer: Int32[Array, ""]) -> tuple[Float[Array, "T D"], Float[Array, "T D"]]:
        """The table of this layer's RoPE base (Gemma 3's local layers have their own)."""
        table = jnp.asarray(_layer_table(self.config))[layer]
        return cos[table], sin[table]

    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.config.query_pre_attn_scalar or self.config.head_dim)

    def attention_options(self, layer: Int32[Array, ""]) -> dict:
        options = super().attention_options(layer)
        if self.config.attn_logit_softcapping is not None:
            options["logit_softcap"] = self.config.attn_logit_softcapping
        return options


class GemmaMLP(decoder.MLP):
    """GeGLU MLP: down(gelu_tanh(gate x) * up x). Params as `decoder.MLP`."""

    def activation(self, gate: Float[Array, "I T"]) -> Float[Array, "I T"]:
        return jax.nn.gelu(gate, approximate=True)


class GemmaDecoderLayer(nnx.Module):
    """Sandwich-norm residual block: x + post_attn_norm(attention(attn_norm(x))), then
    x + post_mlp_norm(mlp(mlp_norm(x))). Norm weights [E], zero-centred."""

    def __init__(self, config: ModelConfig, dtype=jnp.float32):
        e = config.hidden_size
        self.config = config
        self.attn_norm = decoder.new_param((e,), ("embed",), dtype)
        self.attention = GemmaAttention(config, dtype)
        self.post_attn_norm = decoder.new_param((e,), ("embed",), dtype)
        self.mlp_norm = decoder.new_param((e,), ("embed",), dtype)
        self.mlp = GemmaMLP(config, dtype)
        self.post_mlp_norm = decoder.new_param((e,), ("embed",), dtype)

    def __call__(
        self,
        h: Float[Array, "E T"],
        k_pool: Float[Array, "L N KVH ps D"],
        v_pool: Float[Array, "L N KVH ps D"],
        layer: Int32[Array, ""],
        batch: ForwardBatch,
        cos: Float[Array, "R T D"],
        sin: Float[Array, "R T D"],
        attn_fn: decoder.AttentionFn,
    ) -> tuple[Float[Array, "E T"], Float[Array, "L N KVH ps D"], Float[Array, "L N KVH ps D"]]:
        eps = self.config.rms_norm_eps
        with jax.named_scope("attention"):
            o, k_pool, v_pool = self.attention(
                gemma_rms_norm(h, self.attn_norm[...], eps, axis=0), k_pool, v_pool, layer, batch, cos, sin, attn_fn
            )
            h = h + gemma_rms_norm(o, self.post_attn_norm[...], eps, axis=0)
        with jax.named_scope("mlp"):
            o = self.mlp(gemma_rms_norm(h, self.mlp_norm[...], eps, axis=0))
            h = h + gemma_rms_norm(o, self.post_mlp_norm[...], eps, axis=0)
        return h, k_pool, v_pool


class Gemma(decoder.Decoder):
    """The Gemma 2/3 decoder: `decoder.Decoder`'s params (embedding, layers, final norm, tied or int8 head)
    with `GemmaDecoderLayer`s, the scaled embedding, per-base RoPE tables, the (1 + w) final norm and
    final-logit soft-capping."""

    layer_cls = GemmaDecoderLayer

    def embed_tokens(
        self, batch: ForwardBatch
    ) -> tuple[Float[Array, "E T"], Float[Array, "R T D"], Float[Array, "R T D"]]:
        """The residual stream's start [E, T] (embedding x sqrt(E), the factor in the weights' dtype as
        transformers rounds it) and the RoPE tables cos, sin [R, T, D], one per base."""
        rows = self.embed_rows(batch.input_ids)
        h = rows * jnp.asarray(math.sqrt(self.config.hidden_size), rows.dtype)  # [T, E]
        positions = batch.positions.astype(jnp.float32)[:, None]
        cos, sin = [], []
        for base in _rope_bases(self.config):
            inv_freq = jnp.asarray(decoder.rope_inv_freq(self.config, base), jnp.float32)
            angles = positions * inv_freq[None, :]
            angles = jnp.concatenate([angles, angles], axis=-1)  # [T, D]
            cos.append(jnp.cos(angles).astype(h.dtype))
            sin.append(jnp.sin(angles).astype(h.dtype))
        return h.T, jnp.stack(cos), jnp.stack(sin)

    def final_hidden(self, h: Float[Array, "E T"]) -> Float[Array, "T E"]:
        return gemma_rms_norm(h.T, self.final_norm[...], self.config.rms_norm_eps)

    def logits(self, hidden: Float[Array, "N E"], layout: str = decoder.DEFAULT_LOGITS_LAYOUT) -> Float[Array, "N V"]:
        logits = super().logits(hidden, layout)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)
