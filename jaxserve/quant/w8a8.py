"""W8A8 int8 projections: SGLang's `--quantization w8a8_int8` on the engine's float weights.

Each projection weight W [..., out, in] is stored as int8 with one float32 scale per output row
(symmetric, max |w| / 127); at every step the activation x [in, T] is quantized the same way with one
scale per token and block of `ACT_BLOCK` input features, each block's product runs int8 x int8 ->
int32 (exact), and the blocks are rescaled to float32 and summed:

    y[o, t] = s_w[o] * sum_b s_x[b, t] * (sum_{i in b} q_w[o, i] q_x[i, t])

SGLang's W8A8Int8 takes one activation scale per token; on the default model that costs 13.7% relative
L2 error in the logits (outlier features), blocks of 64 everywhere (llama.cpp's Q8 activations use 32)
2.4%, the int8 weights alone 1.2%; but the blocks' partial sums made a 16-token verification 40%
slower, so only the output and down projections (the worst inputs) use blocks and the rest one scale
per token (`ACT_BLOCKS`): 2.1-3.9% (D-10). Applied at load time to any
checkpoint (GGUF is dequantized, safetensors read in float, then quantized). Embedding lookups, norms,
RoPE, attention and the KV pool stay in the model's dtype.

Why: at batch 1 a decode step streams the float32 projections (425 MB for the default model, plus the
113 MB tied output head); XLA:CPU's only narrow dot that reads weights at speed is YNNPACK's int8 x int8
-> int32. The weights are stored block-major, [in / ACT_BLOCK, out, ACT_BLOCK], so the blocked product
is one batched dot with the batch axis leading (the layout YNNPACK takes without a copy); YNNPACK takes
no dot with a vector operand, so a single-token product is padded to two columns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int8

QUANTIZATIONS = ("w8a8_int8",)
INT8_MAX = 127.0
ACT_BLOCK = 64  # input features per activation scale (a block that does not divide `in`: one per token)
# per projection: blocks of ACT_BLOCK, or None for one activation scale per token (a single dot, no
# per-block partial sums to rescale: cheaper from ~16 tokens on, where its inputs quantize well enough)
ACT_BLOCKS: dict[str, int | None] = {"wqkv": None, "wo": ACT_BLOCK, "w_gate_up": None, "w_down": ACT_BLOCK, "head": None}
# params dict paths of the quantized layer projections; each gets a float32 "<name>_scale" beside it
LAYER_PROJECTIONS = (("attention", "wqkv"), ("attention", "wo"), ("mlp", "w_gate_up"), ("mlp", "w_down"))


def act_block(in_features: int, block: int | None = ACT_BLOCK) -> int:
    """Input features per activation scale for a projection of `in_features` inputs: `block` where it
    divides them, else all of them (one scale per token)."""
    return block if block and in_features % block == 0 else in_features


def blocked_shape(shape: tuple[int, ...], block: int | None = ACT_BLOCK) -> tuple[int, int, int]:
    """The stored int8 shape of a float projection [..., out, in]: [in / B, prod(...) out, B] with
    B = `act_block(in, block)`."""
    out = 1
    for n in shape[:-1]:
        out *= n
    block = act_block(shape[-1], block)
    return shape[-1] // block, out, block


def quantize_rows(w: Float[Array, "... I"], block: int | None = ACT_BLOCK) -> tuple[Int8[Array, "nb O B"], Float[Array, " O"]]:
    """Symmetric int8 per row of W [..., O', I] (rows flattened to O): (q, scale) in the stored layout,
    q [I / B, O, B] block-major (B = `act_block(I, block)`), with W[o, b B + j] ~ q[b, o, j] * scale[o].

    scale = max |w| / 127 over the row (1 for an all-zero row); q = round(w / scale), in [-127, 127].
    """
    w = jnp.asarray(w, jnp.float32)
    w = w.reshape(-1, w.shape[-1])
    amax = jnp.max(jnp.abs(w), axis=-1)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(w / scale[:, None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    nb, out, block = blocked_shape(w.shape, block)
    return q.reshape(out, nb, block).transpose(1, 0, 2), scale


def int8_matmul(
    q: Int8[Array, "nb O B"], scale: Float[Array, " O"], x: Float[Array, "I T"]
) -> Float[Array, "O T"]:
    """W @ x for a row-quantized W (`quantize_rows`' layout) and x quantized per token and block of B
    input features at run time, in float32.

    Each block's int8 x int8 product accumulates in int32 (exact); the rounding is the two
    quantizations and the float32 rescale. A one-column x is padded to two (YNNPACK's dot rejects
    vectors, and XLA:CPU's own int8 loop is ~40x slower; D-10).
    """
    nb, _, block = q.shape
    num_cols = x.shape[1]
    xb = x.astype(jnp.float32).reshape(nb, block, num_cols)
    amax = jnp.max(jnp.abs(xb), axis=1)  # [nb, T]
    x_scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    xq = jnp.clip(jnp.round(xb / x_scale[:, None, :]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    if num_cols == 1:
        xq = jnp.concatenate([xq, xq], axis=2)
    acc = jax.lax.dot_general(q, xq, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.int32)
    acc = acc[:, :, :num_cols].astype(jnp.float32) * scale[None, :, None]  # [nb, O, T]
    # the weight scale goes in before the sum over blocks, so the result is a dot's output: XLA:CPU
    # contracts a multiply and an add in one fused loop into an FMA, and a last multiply would join the
    # caller's residual add in one loop at some T and not at others, so a token's bits would depend
    # on its step's shape
    return jnp.einsum("bot,bt->ot", acc, x_scale)


def quantize_params(config, params: dict[str, Any], quantization: str | None) -> tuple[Any, dict[str, Any]]:
    """(config, params) with the layer projections and the output head in int8 (`quantization`
    "w8a8_int8"), or both unchanged (`quantization` None).

    The result matches `functional.abstract_params(config with quantization set)`: each projection leaf
    becomes int8 in `quantize_rows`' layout with a float32 `<name>_scale` [rows] beside it, and the
    head (the untied `lm_head`, or a copy of the tied embedding) is `head_q` with `head_scale` [V];
    `lm_head` is dropped. Per-layer or stacked layers alike.

    Raises:
        ValueError: an unknown `quantization` (naming the flag and the choices).
    """
    if quantization is None:
        return config, params
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)} or leave it out")
    quantize = jax.jit(quantize_rows, static_argnums=1)
    stacked_quantize = jax.jit(jax.vmap(quantize_rows, in_axes=(0, None)), static_argnums=1)

    def layer(p: dict[str, Any], fn) -> dict[str, Any]:
        p = {k: dict(v) if isinstance(v, dict) else v for k, v in p.items()}
        for group, name in LAYER_PROJECTIONS:
            p[group][name], p[group][name + "_scale"] = fn(p[group][name], ACT_BLOCKS[name])
        return p

    layers = params["layers"]
    stacked = bool(layers) and not isinstance(next(iter(layers)), int)
    out = {k: v for k, v in params.items() if k not in ("layers", "lm_head")}
    out["layers"] = layer(layers, stacked_quantize) if stacked else {i: layer(p, quantize) for i, p in layers.items()}
    head = params.get("lm_head")
    out["head_q"], out["head_scale"] = quantize(params["embed"] if head is None else head, ACT_BLOCKS["head"])
    return dataclasses.replace(config, quantization=quantization), out
