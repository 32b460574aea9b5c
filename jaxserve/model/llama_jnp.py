"""The Llama-family decoder as pure functions over a params pytree.

One definition covers LlamaForCausalLM (Llama 2/3.x, SmolLM2), MistralForCausalLM (same graph; sliding
windows are not applied), Qwen2ForCausalLM (q/k/v bias) and Qwen3ForCausalLM (RMSNorm on q and k per
head), switched by `ModelConfig` flags. The forward runs on the paged KV pool: each
layer scatters its new K/V into the pools and then attends through the attention backend given as a
static function. `forward` carries the pools through `lax.scan` over stacked layers; `embed_tokens`,
`decoder_layers` and `final_hidden` are its parts, which the model runner can also call a few layers at a
time.

Numerics follow transformers' modeling_llama.py: RMSNorm in float32, rotate-half RoPE, SiLU-gated MLP.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int32

from jaxserve.config import ModelConfig
from jaxserve.model.forward_batch import ForwardBatch
from jaxserve.pallas.reference import write_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """Weights of the decoder layers in the checkpoint's [out, in] layout (y = W @ x).

    Stacked on a leading layer axis L for `lax.scan` (shapes below); a tuple of per-layer LayerParams
    without that axis is also accepted by `forward` (the model runner's host layer loop uses one).
    Q, K and V are concatenated on the output axis (rows [0, HD) are Q, then K, then V), and so are the
    MLP's gate and up projections (gate first): one matmul each instead of three and two.
    Optional fields are None for architectures without them (fixed for a model's lifetime).
    """

    attn_norm: Float[Array, "L E"]
    wqkv: Float[Array, "L HD+2KD E"]
    wo: Float[Array, "L E HD"]
    mlp_norm: Float[Array, "L E"]
    w_gate_up: Float[Array, "L 2I E"]
    w_down: Float[Array, "L E I"]
    bqkv: Float[Array, "L HD+2KD"] | None = None
    q_norm: Float[Array, "L D"] | None = None
    k_norm: Float[Array, "L D"] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelParams:
    """All weights. `lm_head` ([V, E]) is None when the output projection is tied to `embed` ([V, E])."""

    embed: Float[Array, "V E"]
    layers: LayerParams | tuple[LayerParams, ...]
    final_norm: Float[Array, " E"]
    lm_head: Float[Array, "V E"] | None = None


AttentionFn = Callable[..., jax.Array]


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [D/2] (float64 numpy, a trace-time constant), with rope scaling applied.

    llama3 scaling follows Meta's Llama 3.1 reference (as in transformers' `_compute_llama3_parameters`):
    long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = config.rope_scaling
    if rs.kind == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs.kind == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq


def rms_norm(
    x: Float[Array, "..."], weight: Float[Array, " E"], eps: float, axis: int = -1
) -> Float[Array, "..."]:
    """RMSNorm (Zhang & Sennrich 2019) over `axis` (of size E), computed in float32 and cast back to x's
    dtype before the weight is applied."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
    shape = [1] * x.ndim
    shape[axis] = -1
    return weight.reshape(shape) * x32.astype(x.dtype)


def apply_rope(
    x: Float[Array, "T N D"], cos: Float[Array, "T D"], sin: Float[Array, "T D"]
) -> Float[Array, "T N D"]:
    """Rotate-half RoPE (Su et al. 2021, the layout of HF checkpoints)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def embed_tokens(
    params: ModelParams, batch: ForwardBatch, *, config: ModelConfig
) -> tuple[Float[Array, "E T"], Float[Array, "T D"], Float[Array, "T D"]]:
    """The residual stream's start, feature-major [E, T], and the RoPE tables cos, sin [T, D] of the
    batch's positions."""
    h = params.embed[batch.input_ids]  # [T, E]
    inv_freq = jnp.asarray(rope_inv_freq(config), jnp.float32)
    angles = batch.positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, D]
    return h.T, jnp.cos(angles).astype(h.dtype), jnp.sin(angles).astype(h.dtype)


def decoder_layer(
    p: LayerParams,
    h: Float[Array, "E T"],
    k_pool: Float[Array, "L N ps KVH D"],
    v_pool: Float[Array, "L N ps KVH D"],
    layer: Int32[Array, ""],
    batch: ForwardBatch,
    cos: Float[Array, "T D"],
    sin: Float[Array, "T D"],
    *,
    config: ModelConfig,
    attn_fn: AttentionFn,
) -> tuple[Float[Array, "E T"], Float[Array, "L N ps KVH D"], Float[Array, "L N ps KVH D"]]:
    """One decoder layer (weights `p` of one layer, no L axis): write the batch's K/V into layer `layer`
    of the pools, attend, run the MLP; returns the residual stream and the updated pools.

    The residual stream is feature-major, [E, T], so every projection is `W @ x` with W in the
    checkpoint's [out, in] layout. On XLA:CPU this runs decode batches (T = 2..64) 1.2-1.9x faster than
    x [T, E] @ W [in, out], and a 512-token chunk 6% slower (docs/benchmarks.md, "Projection layout").
    Per-token work (norms over heads, RoPE, attention) uses [T, ...].
    """
    num_tokens = h.shape[1]
    nh, nkv, hd = config.num_heads, config.num_kv_heads, config.head_dim

    with jax.named_scope("attention"):
        x = rms_norm(h, p.attn_norm, config.rms_norm_eps, axis=0)
        qkv = p.wqkv @ x  # [HD + 2 KD, T]
        if p.bqkv is not None:
            qkv = qkv + p.bqkv[:, None]
        qkv = qkv.T  # [T, HD + 2 KD]: the per-token layout attention reads
        q = qkv[:, : nh * hd].reshape(num_tokens, nh, hd)
        k = qkv[:, nh * hd : (nh + nkv) * hd].reshape(num_tokens, nkv, hd)
        v = qkv[:, (nh + nkv) * hd :].reshape(num_tokens, nkv, hd)
        if p.q_norm is not None:
            q = rms_norm(q, p.q_norm, config.rms_norm_eps)
            k = rms_norm(k, p.k_norm, config.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k_pool, v_pool = write_kv(k_pool, v_pool, layer, k, v, batch.slot_mapping)
        o = attn_fn(q, k_pool, v_pool, layer, batch.attn, 1.0 / math.sqrt(hd))  # [T, H, D]
        h = h + p.wo @ o.reshape(num_tokens, nh * hd).T

    with jax.named_scope("mlp"):
        x = rms_norm(h, p.mlp_norm, config.rms_norm_eps, axis=0)
        gate_up = p.w_gate_up @ x  # [2I, T]
        inter = gate_up.shape[0] // 2
        h = h + p.w_down @ (jax.nn.silu(gate_up[:inter]) * gate_up[inter:])
    return h, k_pool, v_pool


def decoder_layers(
    ps: tuple[LayerParams, ...],
    h: Float[Array, "E T"],
    k_pool: Float[Array, "L N ps KVH D"],
    v_pool: Float[Array, "L N ps KVH D"],
    first_layer: Int32[Array, ""],
    batch: ForwardBatch,
    cos: Float[Array, "T D"],
    sin: Float[Array, "T D"],
    *,
    config: ModelConfig,
    attn_fn: AttentionFn,
) -> tuple[Float[Array, "E T"], Float[Array, "L N ps KVH D"], Float[Array, "L N ps KVH D"]]:
    """Consecutive decoder layers `first_layer`, `first_layer + 1`, ... with per-layer weights `ps`
    (unrolled); `decoder_layer` for each in turn."""
    for i, p in enumerate(ps):
        h, k_pool, v_pool = decoder_layer(
            p, h, k_pool, v_pool, first_layer + i, batch, cos, sin, config=config, attn_fn=attn_fn
        )
    return h, k_pool, v_pool


def final_hidden(params: ModelParams, h: Float[Array, "E T"], *, config: ModelConfig) -> Float[Array, "T E"]:
    """The final RMSNorm, back in the token-major layout [T, E]."""
    return rms_norm(h.T, params.final_norm, config.rms_norm_eps)


def forward(
    params: ModelParams,
    k_pool: Float[Array, "L N ps KVH D"],
    v_pool: Float[Array, "L N ps KVH D"],
    batch: ForwardBatch,
    *,
    config: ModelConfig,
    attn_fn: AttentionFn,
) -> tuple[Float[Array, "T E"], Float[Array, "L N ps KVH D"], Float[Array, "L N ps KVH D"]]:
    """Run the decoder over a ragged batch: write every token's K/V into the pools and return the final
    (normed) hidden states [T, E] with the updated pools.

    Stacked `params.layers` run under `lax.scan` (one layer body in the compiled program); a tuple of
    per-layer LayerParams is unrolled (one body per layer: slower to compile). `config` and `attn_fn`
    are static (bind them with functools.partial before jit). The pools should be donated by the
    caller's jit so the per-layer scatters update them in place.
    """
    h, cos, sin = embed_tokens(params, batch, config=config)
    if isinstance(params.layers, LayerParams):

        def step(carry, p):
            h, k_pool, v_pool, layer = carry
            h, k_pool, v_pool = decoder_layer(
                p, h, k_pool, v_pool, layer, batch, cos, sin, config=config, attn_fn=attn_fn
            )
            return (h, k_pool, v_pool, layer + 1), None

        (h, k_pool, v_pool, _), _ = jax.lax.scan(step, (h, k_pool, v_pool, jnp.int32(0)), params.layers)
    else:
        h, k_pool, v_pool = decoder_layers(
            params.layers, h, k_pool, v_pool, jnp.int32(0), batch, cos, sin, config=config, attn_fn=attn_fn
        )
    return final_hidden(params, h, config=config), k_pool, v_pool


def compute_logits(params: ModelParams, hidden: Float[Array, "N E"], config=None) -> Float[Array, "N V"]:
    """Output projection in float32 (tied to the embedding when `lm_head` is None)."""
    head = params.embed if params.lm_head is None else params.lm_head
    return jnp.einsum("ne,ve->nv", hidden, head, preferred_element_type=jnp.float32)


def unstack_layers(params: ModelParams) -> ModelParams:
    """Split stacked [L, ...] layer weights into L per-layer LayerParams, each in its own buffers."""
    layers = params.layers
    if not isinstance(layers, LayerParams):
        return params
    num_layers = layers.attn_norm.shape[0]
    return dataclasses.replace(
        params, layers=tuple(jax.tree.map(lambda x, i=i: jnp.array(x[i]), layers) for i in range(num_layers))
    )


def outer_params(params: ModelParams) -> ModelParams:
    return dataclasses.replace(params, layers=())


def per_layer(params: ModelParams) -> tuple[LayerParams, ...]:
    return params.layers


def paged_attention(attention):
    return attention


def from_flax_params(config: ModelConfig, params: dict) -> ModelParams:
    """The Flax model's params dict in this model's layout (stacked layers, Q/K/V rows in HF order)."""
    nkv, g, d = config.num_kv_heads, config.group_size, config.head_dim

    def qkv_rows(x):  # [KVH, (G + 2) D, ...] -> [H D + 2 KVH D, ...]
        q, k, v = x[:, : g * d], x[:, g * d : (g + 1) * d], x[:, (g + 1) * d :]
        return jnp.concatenate([a.reshape(-1, *x.shape[2:]) for a in (q, k, v)], axis=0)

    def layer(p):
        a = p["attention"]
        return LayerParams(
            attn_norm=p["attn_norm"], wqkv=qkv_rows(a["wqkv"]), wo=a["wo"], mlp_norm=p["mlp_norm"],
            w_gate_up=p["mlp"]["w_gate_up"].reshape(-1, config.hidden_size), w_down=p["mlp"]["w_down"],
            bqkv=qkv_rows(a["bqkv"]) if "bqkv" in a else None, q_norm=a.get("q_norm"), k_norm=a.get("k_norm"),
        )

    layers = [layer(params["layers"][i]) for i in sorted(params["layers"])]
    return ModelParams(
        embed=params["embed"], layers=jax.tree.map(lambda *xs: jnp.stack(xs), *layers),
        final_norm=params["final_norm"], lm_head=params.get("lm_head"),
    )
