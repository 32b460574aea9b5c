"""The model runner: the only jit boundary of jaxserve.

It owns the params and the KV pools, pads each host-side batch to a power-of-two shape bucket, and
runs that bucket's compiled step: one executable with `lax.scan` over the layers (`layer_loop="scan"`,
`forward_step`), or embed, layer-group and head executables with the layer group (a few consecutive
layers) called from Python until all layers have run (`layer_loop="host"`, `HostLayerLoop`, the CPU
default). Executables are compiled ahead of time
(`precompile`, with a progress bar) and kept in a dict, so every compile is explicit and counted
(`num_compiles_after_warmup`).

Shape buckets: `jaxserve/runner/buckets.py`.
The argument pytrees (`ForwardBatch`, `SamplingBatch`) have one structure for the process's lifetime.

For research code: `forward_step` is the whole step as one pure function of plain arrays (the params
dict, the pools, a ForwardBatch; what the scan loop jits); call it under your own `jax.jit`, trace it or
inspect its jaxpr. The host loop computes the same step from its parts, `functional.embed_tokens`,
`functional.decoder_layers` and `head_step`. The Flax Modules are rebuilt (`nnx.merge`) only inside these
traced functions; no Module or nnx.State crosses the jit boundary.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Float
from tqdm.auto import tqdm

from jaxserve import parallel
from jaxserve.cache.kv_pool import PageAllocator, PoolShape
from jaxserve.cache.window_pool import HybridPageAllocator
from jaxserve.core.batch import BatchEntry, pow2_at_least
from jaxserve.model import decoder, functional
from jaxserve.model import lora as lora_lib
from jaxserve.model.config import ModelConfig
from jaxserve.model.forward_batch import ForwardBatch, WindowTables
from jaxserve.pallas import quantized_kv
from jaxserve.pallas.metadata import build_attention_metadata
from jaxserve.runner import sampler as sampler_lib
from jaxserve.runner.buckets import (
    EXTEND_BLOCK_Q,
    MAX_LAYERS_PER_CALL,
    MIN_PAGE_BUCKET_TOKENS,
    BucketKey,
    extend_token_buckets,
    layers_per_call,
    pow2_range,
)

logger = logging.getLogger(__name__)



def forward_step(
    params: decoder.Params,
    k_pool: Float[Array, "L N KVH ps D"],
    v_pool: Float[Array, "L N KVH ps D"],
    batch: ForwardBatch,
    *,
    config: ModelConfig,
    attn_fn: Callable,
    forward_fn: Callable = functional.forward,
    return_input_logprobs: bool = False,
) -> tuple[Float[Array, "S V"], Float[Array, " T"], Float[Array, "L N KVH ps D"], Float[Array, "L N KVH ps D"]]:
    """One engine step: write the batch's K/V into the pools and return float32 logits [S, V] at
    `batch.logits_idx`, the prompt logprobs [T] and the updated pools.

    Prompt logprobs (`return_input_logprobs`): log p(target_ids[t] | tokens up to t) for every packed
    token (0 where the target is -1); this needs logits at every row, so it is a separate variant.
    `attn_fn` is an attention backend (`jaxserve.pallas.get_attention_backend`) or the model's K/V
    write + attention (`functional.paged_attention(backend)`, what the runner passes). `params` is the Flax
    model's plain params dict (`jaxserve.model.loader.load_model`).
    Pure; `config`, `attn_fn`, `forward_fn` and `return_input_logprobs` are static. The engine runs this
    same computation either as one executable (`--layer-loop scan`) or split into `functional.embed_tokens`,
    `functional.decoder_layers` calls over groups of layers and `head_step` (`--layer-loop host`,
    `HostLayerLoop`).
    """
    hidden, k_pool, v_pool = forward_fn(params, k_pool, v_pool, batch, config=config, attn_fn=attn_fn)
    logits, input_logprobs = step_outputs(params, hidden, batch, return_input_logprobs, config=config)
    return logits, input_logprobs, k_pool, v_pool


def step_outputs(
    params: decoder.Params, hidden: Float[Array, "T E"], batch: ForwardBatch, return_input_logprobs: bool | str,
    *, config: ModelConfig,
) -> tuple[Float[Array, "S V"], Float[Array, " T"] | Float[Array, "T V"]]:
    """Logits [S, V] at `batch.logits_idx` and prompt logprobs [T] (zeros unless requested; "full":
    the log-softmax [T, V] of every token) from the final hidden states."""
    logits = functional.compute_logits(params, hidden[batch.logits_idx], config=config)
    if return_input_logprobs == "full":  # every token's log-softmax [T, V] (engine/prompt_logprobs.py)
        all_logits = functional.compute_logits(params, hidden, config=config)
        input_logprobs = all_logits - jax.nn.logsumexp(all_logits, axis=-1, keepdims=True)
    elif return_input_logprobs:
        all_logits = functional.compute_logits(params, hidden, config=config)  # [T, V]
        target = jnp.maximum(batch.target_ids, 0)
        picked = jnp.take_along_axis(all_logits, target[:, None], axis=-1)[:, 0]
        input_logprobs = jnp.where(batch.target_ids >= 0, picked - jax.nn.logsumexp(all_logits, axis=-1), 0.0)
    else:
        input_logprobs = jnp.zeros(batch.input_ids.shape, jnp.float32)
    return logits, input_logprobs


def head_step(
    params: decoder.Params, h: Float[Array, "E T"], batch: ForwardBatch, *, config: ModelConfig,
    return_input_logprobs: bool = False,
) -> tuple[Float[Array, "S V"], Float[Array, " T"]]:
    """The end of a host-loop step: final norm of the residual stream [E, T], then `step_outputs`."""
    hidden = functional.final_hidden(params, h, config=config)
    return step_outputs(params, hidden, batch, return_input_logprobs, config=config)


class HostLayerLoop:
    """One compiled step of a bucket as three executables run from Python: embed, a group of G
    consecutive decoder layers (called L / G times, with those layers' weights and the index of the
    first; the pools are donated, so each call updates them in place) and the head. Called like a
    compiled `forward_step`, with per-layer `params["layers"]`.

    Why: under `lax.scan` XLA:CPU copies each layer's slice of the stacked weights before its matmuls;
    separate per-layer buffers are read in place (D-05).
    """

    def __init__(
        self, embed: Callable, layers: Callable, head: Callable, first_layer_ids: Sequence[jax.Array]
    ):
        """`first_layer_ids`: the int32 device scalar of each group's first layer index (G apart), made
        once by the runner."""
        self.embed, self.layers, self.head, self.first_layer_ids = embed, layers, head, first_layer_ids

    def __call__(self, params: decoder.Params, k_pool, v_pool, batch: ForwardBatch):
        """`batch` may hold numpy arrays: the embed program hands it back on the device for the others."""
        outer = functional.outer_params(params)
        per_layer = functional.per_layer(params)
        group = len(per_layer) // len(self.first_layer_ids)
        (h, cos, sin), batch = self.embed(outer, batch)
        for i, first in enumerate(self.first_layer_ids):
            ps = per_layer[i * group : (i + 1) * group]
            h, k_pool, v_pool = self.layers(ps, h, k_pool, v_pool, first, batch, cos, sin)
        logits, input_logprobs = self.head(outer, h, batch)
        return logits, input_logprobs, k_pool, v_pool


def embed_step(
    params: decoder.Params, batch: ForwardBatch, *, config: ModelConfig
) -> tuple[tuple[Float[Array, "E T"], Float[Array, "T D"], Float[Array, "T D"]], ForwardBatch]:
    """The start of a host-loop step: `functional.embed_tokens` (residual stream [E, T], RoPE cos and sin
    [T, D]), and `batch` itself returned as device arrays for the step's other programs. The step's batch then crosses to the device once, as numpy
    arguments of this call: with a `jax.device_put` of its 12 arrays first, the call took 4-5x longer
    (jax 0.10.2, CPU; D-06)."""
    return functional.embed_tokens(params, batch, config=config), batch


# ---- whole-page copies of the device KV pools [L, N, KVH, ps, D]: the host tier's device <-> host
# copies and copy-on-write of a partly matched page (`KVPageIO`, jaxserve/cache/page_io.py). Page counts
# are padded to powers of two with the dummy page 0, so each count bucket compiles once; writes are
# donated updates of the pools.

class DevicePageRead:
    """A device -> host copy of K/V pages in flight (`PendingRead`)."""

    def __init__(self, k: jax.Array, v: jax.Array):
        self._k, self._v = k, v

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self._k), np.asarray(self._v)


def padded_page_ids(pages) -> np.ndarray:
    """`pages` as int32 ids padded with the dummy page 0 to a power of two (one compile per bucket)."""
    pages = np.asarray(pages, np.int32).reshape(-1)
    out = np.zeros(pow2_at_least(len(pages)), np.int32)
    out[: len(pages)] = pages
    return out


def _gather_pages(k_pool, v_pool, pages):
    # [L, N, KVH, ps, D] -> [L, n, KVH, ps, D]; a compressed pool's pages as the host keeps them (bytes)
    return tuple(quantized_kv.pack_pages(jax.tree.map(lambda x: x[:, pages], pool)) for pool in (k_pool, v_pool))


def _scatter_pages(k_pool, v_pool, pages, k, v):
    def scatter(pool, host):
        return jax.tree.map(lambda x, y: x.at[:, pages].set(y), pool, quantized_kv.unpack_pages(host, pool))

    return scatter(k_pool, k), scatter(v_pool, v)


def _copy_pages(k_pool, v_pool, src, dst):
    return tuple(jax.tree.map(lambda x: x.at[:, dst].set(x[:, src]), pool) for pool in (k_pool, v_pool))


# the page copies of a single-device pool (the results stay on its device)
PAGE_JITS: dict[str, Callable] = {
    "gather": jax.jit(_gather_pages),
    "scatter": jax.jit(_scatter_pages, donate_argnums=(0, 1)),
    "copy": jax.jit(_copy_pages, donate_argnums=(0, 1)),
}


def sharded_page_jits(rep, pool) -> dict[str, Callable]:
    """The page copies over a sharded pool: their results keep the pool's sharding (the compiled steps
    take exactly that), and pages read for the host come back whole."""
    return {
        "gather": jax.jit(_gather_pages, out_shardings=(rep, rep)),
        "scatter": jax.jit(_scatter_pages, donate_argnums=(0, 1), out_shardings=(pool, pool)),
        "copy": jax.jit(_copy_pages, donate_argnums=(0, 1), out_shardings=(pool, pool)),
    }


class ModelRunner:
    """Holds params + KV pools and runs bucketed, compiled forward and sampling steps."""

    def __init__(
        self,
        config: ModelConfig,
        params: decoder.Params,
        k_pool: jax.Array,
        v_pool: jax.Array,
        *,
        attn_fn: Callable,
        max_running_requests: int,
        max_extend_tokens: int,
        context_length: int,
        layer_loop: str = "scan",
        max_layers_per_call: int = MAX_LAYERS_PER_CALL,
        min_extend_tokens: int = EXTEND_BLOCK_Q,
        mesh: Mesh | None = None,
        lora: lora_lib.LoraConfig | None = None,
        allocator: PageAllocator | None = None,
        pool_shape: PoolShape | None = None,
        model_path: str | None = None,
    ):
        """`layer_loop`: "scan" compiles each bucket's step as one executable (`forward_step`); "host"
        runs it as a `HostLayerLoop`, with the layer weights split into per-layer buffers (stacked
        params are split here; per-layer params given to "scan" run unrolled, see `functional.forward`) and
        `layers_per_call(num_layers, max_layers_per_call)` layers per call. `attn_fn` is an attention
        backend (`jaxserve.pallas.get_attention_backend`). `mesh` (`jaxserve.parallel.make_mesh`, tensor parallelism): the params
        and pools are placed on it by the rules table, attention runs per device under shard_map, and
        every compiled program returns its pools and activations with fixed shardings (GSPMD inserts
        the all-reduces after the row-parallel projections). None (or a 1-device mesh): one device. `min_extend_tokens`: the
        smallest extend bucket (speculative verification adds 2, 4 and 8 tokens: a sequence's last
        token + its draft in one query block of the bucket's size; at batch 1 on CPU a verification costs
        1.25x (4-token bucket) to 2.1x (16-token bucket) a decode step, D-17;
        today's costs: docs/results.md, "Other current numbers"). `lora`: LoRA slots added to every
        layer's params (zeros; `write_lora_slot` fills them), and each batch carries its tokens' slots.
        `allocator`: the pool's page allocator (`runner/loader.py` makes it with the pool); a
        `HybridPageAllocator` (`jaxserve.cache.window_pool`; the pools are then `[1, F, KVH, ps, D]` in
        its layout) makes each batch carry the window layers' page tables, read from its
        `window_page_of` when the batch is built. `pool_shape` (the page space's shape) and `model_path`
        (the resolved checkpoint) are kept for the parts built after the runner (tests may leave them out).

        Raises:
            ValueError: `layer_loop` is neither "scan" nor "host"."""
        if layer_loop not in ("scan", "host"):
            raise ValueError(f"layer_loop must be 'scan' or 'host', got {layer_loop!r}")
        self.model_config = config
        self.model_path = model_path
        self.layer_loop = layer_loop
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        self.devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]  # one per tp shard
        self.tp_size = 1 if self.mesh is None else parallel.sharding.tp_size(self.mesh)
        self.lora = lora
        self.allocator = allocator
        self.pool_shape = pool_shape
        self.window_pages = allocator if isinstance(allocator, HybridPageAllocator) else None
        self.window_layout = None if self.window_pages is None else self.window_pages.layout
        self.context_length = context_length
        if self.window_layout is not None:
            layout = self.window_layout
            if k_pool.shape[:2] != (1, layout.num_flat_pages):
                raise ValueError(f"pool {k_pool.shape} does not hold the window layout {layout}")
            self._window_layer_maps = (layout.page_base(), layout.uses_window())
        if params is not None and lora is not None:
            if config.quantization is not None:
                raise ValueError("LoRA adapters are not supported with quantization")
            if functional.model_class(config).layer_cls is not decoder.DecoderLayer:
                raise ValueError(f"LoRA adapters are served for the Llama family only, not {config.architecture}")
            was_stacked = functional.is_stacked(params["layers"])
            params = lora_lib.with_lora_slots(functional.unstack_layers(params), config, lora)
            params = functional.stack_layers(params) if was_stacked else params
        if params is not None:
            params = functional.unstack_layers(params) if layer_loop == "host" else params
        attn_fn = functional.paged_attention(attn_fn)
        shardings: dict[str, object] = {}
        if self.mesh is not None:
            axes = functional.logical_axes(config)
            params = parallel.shard_params(params, lora_lib.with_lora_axes(axes, config, lora) if lora else axes, self.mesh)
            pool = parallel.pool_sharding(self.mesh, k_pool.shape[2])
            k_pool, v_pool = (jax.tree.map(lambda x: parallel.sharding.put(x, pool), p) for p in (k_pool, v_pool))
            attn_fn = parallel.shard_attention(attn_fn, self.mesh)
            rep, logits = parallel.replicated(self.mesh), parallel.vocab_sharding(self.mesh, config.vocab_size)
            shardings = dict(step=(logits, rep, pool, pool), embed=rep, layers=(rep, pool, pool), head=(logits, rep))
        self._page = sharded_page_jits(rep, pool) if self.mesh is not None else PAGE_JITS
        self._replicated = parallel.replicated(self.mesh) if self.mesh is not None else None
        self.params = params
        out = {name: {"out_shardings": sh} for name, sh in shardings.items()}
        self.k_pool = k_pool
        self.v_pool = v_pool
        self.page_size = k_pool.shape[3]
        self.max_seqs = pow2_at_least(max_running_requests)
        self.max_extend_tokens = pow2_at_least(max_extend_tokens, EXTEND_BLOCK_Q)
        self.extend_tokens = extend_token_buckets(min(min_extend_tokens, EXTEND_BLOCK_Q), self.max_extend_tokens)
        self.max_pages = pow2_at_least(-(-context_length // self.page_size))
        self.min_pages = min(self.max_pages, pow2_at_least(MIN_PAGE_BUCKET_TOKENS // self.page_size))
        self._step_jit = {
            flag: jax.jit(
                functools.partial(forward_step, config=config, attn_fn=attn_fn, return_input_logprobs=flag,
                                  forward_fn=functional.forward),
                donate_argnums=(1, 2), **out.get("step", {}),
            )
            for flag in (False, True, "full")
        }
        self._embed_jit = jax.jit(functools.partial(embed_step, config=config), **out.get("embed", {}))
        self._layers_jit = jax.jit(
            functools.partial(functional.decoder_layers, config=config, attn_fn=attn_fn), donate_argnums=(2, 3),
            **out.get("layers", {}),
        )
        self._head_jit = {
            flag: jax.jit(functools.partial(head_step, config=config, return_input_logprobs=flag),
                          **out.get("head", {}))
            for flag in (False, True, "full")
        }
        self.layers_per_call, self._first_layer_ids = None, []  # host loop only
        if layer_loop == "host":
            self.layers_per_call = layers_per_call(config.num_layers, max_layers_per_call)
            self._first_layer_ids = [jnp.int32(i) for i in range(0, config.num_layers, self.layers_per_call)]
            if jax.process_count() > 1 and self.mesh is not None:  # one process's scalar is no global input
                self._first_layer_ids = [parallel.sharding.put(np.int32(i), self._replicated)
                                         for i in range(0, config.num_layers, self.layers_per_call)]
        self._write_lora_jit = {}  # whether the layers are stacked -> the jitted slot write
        # several processes: rank 0 reads the sampled ids, so they must be whole on its devices
        multi = {"out_shardings": self._replicated} if jax.process_count() > 1 and self.mesh is not None else {}
        self._sample_jit = jax.jit(sampler_lib.sample, static_argnums=(2,), **multi)
        # rank 0 of several processes: a `jaxserve.parallel.distributed.StepChannel` that sends every
        # program's host inputs to the other ranks before it runs (None: one process, or a follower)
        self.channel = None
        self._step_exec: dict[tuple[BucketKey, bool], Callable] = {}
        self._sample_exec: dict[tuple, Callable] = {}
        self.warmed_up = False
        self.precompiled = False  # precompile() ran (False under --disable-precompile)
        self.num_compiles_after_warmup = 0
        self.compile_seconds = 0.0

    # ---- buckets -------------------------------------------------------------------------------
    def page_bucket(self, max_pages: int) -> int:
        return min(self.max_pages, pow2_at_least(max_pages, self.min_pages))

    def bucket_for(self, extend_lens: Sequence[int], max_pages: int) -> BucketKey:
        """Smallest bucket that fits a batch (raises ValueError when none does)."""
        num_seqs, num_tokens = len(extend_lens), sum(extend_lens)
        pages = self.page_bucket(max_pages)
        if max_pages > self.max_pages:
            raise ValueError(f"a sequence needs {max_pages} pages, the context allows {self.max_pages}")
        if all(n == 1 for n in extend_lens):
            s = pow2_at_least(num_seqs)
            if s > self.max_seqs:
                raise ValueError(f"{num_seqs} decodes exceed max_running_requests bucket {self.max_seqs}")
            return BucketKey(s, s, pages, 1)
        if num_tokens > self.max_extend_tokens:
            raise ValueError(f"{num_tokens} tokens exceed the extend bucket {self.max_extend_tokens}")
        t = next(t for t in self.extend_tokens if t >= num_tokens)
        s = min(t, self.max_seqs)
        if num_seqs > s:
            raise ValueError(f"{num_seqs} sequences exceed bucket {s}")
        return BucketKey(t, s, pages, self.extend_block_q(t))

    def extend_block_q(self, num_tokens: int) -> int:
        """Query-block rows of an extend bucket of `num_tokens` tokens: EXTEND_BLOCK_Q, or the bucket's
        tokens when fewer (the 2-, 4- and 8-token buckets of speculative verification). A block's rows
        are all computed, so a 3-token verification in a 16-row block paid for 16 rows: on CPU its
        attention took 11.5 against 20.4 ms over 30 layers in a 4-row block (D-17)."""
        return min(num_tokens, EXTEND_BLOCK_Q)

    def all_buckets(self) -> list[BucketKey]:
        pages = pow2_range(self.min_pages, self.max_pages)
        decode = [BucketKey(s, s, p, 1) for s in pow2_range(1, self.max_seqs) for p in pages]
        extend = [
            BucketKey(t, min(t, self.max_seqs), p, self.extend_block_q(t))
            for t in self.extend_tokens
            for p in pages
        ]
        return decode + extend

    # ---- host -> device batch ------------------------------------------------------------------
    def build_forward_batch(self, entries: Sequence[BatchEntry]) -> tuple[ForwardBatch, BucketKey]:
        """Pad a host batch to its bucket: a `ForwardBatch` of numpy arrays, and the bucket.

        It is passed to the compiled step as is: an executable converts numpy arguments in its call,
        much faster than a separate `jax.device_put` of the same arrays (see `embed_step`)."""
        extend_lens = [len(e.token_ids) for e in entries]
        max_pages = max(len(e.page_table) for e in entries)
        key = self.bucket_for(extend_lens, max_pages)
        t_pad, s_pad = key.num_tokens, key.num_seqs
        input_ids = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        slot_mapping = np.zeros(t_pad, np.int32)
        logits_idx = np.zeros(s_pad, np.int32)
        target_ids = np.full(t_pad, -1, np.int32)
        lora_ids = np.zeros(t_pad, np.int32) if self.lora is not None else None
        ps = self.page_size
        t = row = 0
        if sum(e.num_logits for e in entries) > s_pad:
            raise ValueError(f"{sum(e.num_logits for e in entries)} logits rows exceed the bucket's {s_pad}")
        for e in entries:
            n = len(e.token_ids)
            pos = np.arange(e.prefix_len, e.prefix_len + n)
            table = np.asarray(e.page_table, np.int32)
            input_ids[t : t + n] = e.token_ids
            positions[t : t + n] = pos
            slot_mapping[t : t + n] = table[pos // ps] * ps + pos % ps
            logits_idx[row : row + e.num_logits] = np.arange(t + n - e.num_logits, t + n)
            row += e.num_logits
            if e.target_ids is not None:
                target_ids[t : t + len(e.target_ids)] = e.target_ids
            if lora_ids is not None:
                lora_ids[t : t + n] = e.lora_slot
            elif e.lora_slot:
                raise ValueError("a LoRA slot was given, but the runner has no LoRA slots")
            t += n
        meta = build_attention_metadata(
            extend_lens,
            [e.prefix_len for e in entries],
            [e.page_table for e in entries],
            num_tokens=t_pad,
            num_seqs=s_pad,
            pages_per_seq=key.pages_per_seq,
            block_q=key.block_q,
        )
        window = None
        if self.window_pages is not None:
            window_page_of = self.window_pages.window_page_of
            window = WindowTables(
                *self._window_layer_maps,
                page_table=window_page_of[meta.page_table],
                slot_mapping=window_page_of[slot_mapping // ps] * ps + slot_mapping % ps,
            )
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            attn=meta.tree(),
            logits_idx=logits_idx,
            target_ids=target_ids,
            lora_ids=lora_ids,
            window=window,
        )
        return batch, key

    # ---- execution -----------------------------------------------------------------------------
    def forward(
        self, entries: Sequence[BatchEntry], input_logprobs: bool | str = False, input_ids: jax.Array | None = None
    ) -> jax.Array:
        """Run one step over `entries`; returns device logits [S_bucket, V]: `num_logits` rows per entry,
        in order (one row each by default); the rows after them are padding.

        With `input_logprobs`, returns (logits, prompt logprobs [T_bucket] as numpy) instead; with
        `input_logprobs="full"`, (logits, log-softmax [T_bucket, V] as numpy).
        `input_ids` (a decode-only batch, one device): the step's token ids [T_bucket] as a device array,
        in place of the entries' `token_ids` (the overlap schedule feeds the previous decode step's
        sampled tokens, `SampleOutput.next_tokens` of the same bucket, without reading them back).
        """
        batch, key = self.build_forward_batch(entries)
        if input_ids is not None:
            if input_ids.shape != batch.input_ids.shape or key.block_q != 1:
                raise ValueError(f"input_ids {input_ids.shape} do not fit the decode bucket {key}")
            batch = dataclasses.replace(batch, input_ids=input_ids)
        return self.run_batch(batch, key, input_logprobs)

    def run_batch(self, batch: ForwardBatch, key: BucketKey, input_logprobs: bool | str = False):
        """The compiled step of bucket `key` over a padded host batch (`build_forward_batch`); returns
        what `forward` returns. The unit the other ranks of a multi-host server replay."""
        with self._routed("run_batch", batch, key, input_logprobs):
            exe = self._step_exec.get((key, input_logprobs))
            if exe is None:
                exe = self._compile_step(key, batch, input_logprobs)
            logits, prompt_logprobs, self.k_pool, self.v_pool = exe(self.params, self.k_pool, self.v_pool, batch)
            if input_logprobs:
                return logits, np.asarray(prompt_logprobs)
            return logits

    def _routed(self, op: str, *args):
        """Around a method that runs a device program: on rank 0 of several processes, first send
        `op(*args)` to the other ranks (`StepChannel.step`); a no-op in one process."""
        return contextlib.nullcontext() if self.channel is None else self.channel.step(op, *args)

    def sample(self, logits: jax.Array, sampling: sampler_lib.SamplingBatch, flags) -> sampler_lib.SampleOutput:
        """Sample next tokens from `logits` [S, V]; returns host numpy arrays."""
        with self._routed("sample", sampling, flags):
            # read inside the routed call: on several processes, rank 0's result means every rank has
            # read this step's messages, which the channel then deletes (StepChannel.step)
            return jax.device_get(self._sample_on_device(logits, sampling, flags))

    def sample_async(self, logits: jax.Array, sampling: sampler_lib.SamplingBatch, flags) -> sampler_lib.SampleOutput:
        """`sample` without reading the result back: device arrays, still being computed
        (`jax.device_get` reads them). One process only (the other ranks replay `sample`).

        Raises:
            RuntimeError: the runner leads several processes.
        """
        if self.channel is not None:
            raise RuntimeError("sample_async runs in one process; rank 0 of several processes calls sample")
        return self._sample_on_device(logits, sampling, flags)

    def _sample_on_device(self, logits: jax.Array, sampling: sampler_lib.SamplingBatch, flags) -> sampler_lib.SampleOutput:
        target = self._sampler_logits_sharding(flags)
        if target is not None and logits.sharding != target:
            logits = jax.device_put(logits, target)
        key = (logits.shape[0], flags, jax.tree.map(lambda x: x.shape, sampling))
        exe = self._sample_exec.get(key)
        if exe is None:
            exe = self._compile(lambda: self._sample_jit.lower(logits, sampling, flags).compile(), f"sampler {key[:2]}",
                                feature_variant=True)
            self._sample_exec[key] = exe
        return sampler_lib.SampleOutput(*exe(logits, sampling))

    def _sampler_logits_sharding(self, flags):
        """Under tensor parallelism, greedy sampling reads the vocab-sharded logits as the step returns
        them (an argmax per shard, then across shards); every other sampler variant gathers them onto
        every device first (one layout for filters, penalties, masks and logprobs). None without a mesh."""
        if self.mesh is None:
            return None
        if flags.all_greedy:
            return parallel.vocab_sharding(self.mesh, self.model_config.vocab_size)
        return self._replicated

    def _lower_step(
        self, batch: ForwardBatch, input_logprobs: bool, parts: Sequence[str] = ("embed", "layer", "head")
    ) -> dict[str, jax.stages.Lowered]:
        """The programs of one bucket's step, lowered (not yet compiled): "step" for the scan loop;
        the given `parts` of "embed", "layer" (a group of `layers_per_call` layers) and "head" for the
        host loop."""
        if self.layer_loop == "scan":
            return {"step": self._step_jit[input_logprobs].lower(self.params, self.k_pool, self.v_pool, batch)}
        outer = functional.outer_params(self.params)
        # the residual stream and RoPE tables as the embed program makes them ([E, T]; [T, D], or
        # [R, T, D] for a model with R RoPE bases, Gemma 3)
        (h, rope, _), _ = jax.eval_shape(functools.partial(embed_step, config=self.model_config), outer, batch)
        h = jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=self._replicated)
        rope = jax.ShapeDtypeStruct(rope.shape, rope.dtype, sharding=self._replicated)
        lower = {
            "embed": lambda: self._embed_jit.lower(outer, batch),
            "layer": lambda: self._layers_jit.lower(
                functional.per_layer(self.params)[: self.layers_per_call], h, self.k_pool, self.v_pool,
                self._first_layer_ids[0], batch, rope, rope,
            ),
            "head": lambda: self._head_jit[input_logprobs].lower(outer, h, batch),
        }
        return {name: lower[name]() for name in parts}

    def _assemble_step(self, compiled: dict[str, Callable]) -> Callable:
        if self.layer_loop == "scan":
            return compiled["step"]
        return HostLayerLoop(compiled["embed"], compiled["layer"], compiled["head"], self._first_layer_ids)

    def _compile_step(self, key: BucketKey, batch: ForwardBatch, input_logprobs: bool = False) -> Callable:
        # the host loop's embed and layer programs are the same for both variants: compile only a head
        other = self._step_exec.get((key, False))
        if other is None:
            other = self._step_exec.get((key, True))
        reused = {"embed": other.embed, "layer": other.layers} if isinstance(other, HostLayerLoop) else {}
        lowered = self._lower_step(batch, input_logprobs, [p for p in ("embed", "layer", "head") if p not in reused])
        exe = self._compile(
            lambda: self._assemble_step({**reused, **{name: low.compile() for name, low in lowered.items()}}),
            f"step {key}{' with prompt logprobs' if input_logprobs else ''}",
            feature_variant=input_logprobs,
        )
        self._step_exec[(key, input_logprobs)] = exe
        return exe

    def _compile(self, fn: Callable[[], Callable], what: str, feature_variant: bool = False) -> Callable:
        """Compile and count. A `feature_variant` (prompt logprobs, a sampler with filters, penalties,
        a grammar bitmask or top logprobs) is compiled on first use by design, so it is logged at
        info; any other compile while serving is a bucket precompile missed: a warning."""
        t0 = time.perf_counter()
        exe = fn()
        self.compile_seconds += time.perf_counter() - t0
        if self.warmed_up:
            self.num_compiles_after_warmup += 1
            if feature_variant:
                logger.info("compiled %s on first use (%.2f s)", what, time.perf_counter() - t0)
            else:
                # under --disable-precompile a compile on first use is what was asked for: no warning
                logger.log(logging.WARNING if self.precompiled else logging.DEBUG,
                           "compiled %s while serving (%.2f s); precompile covers the usual buckets", what, time.perf_counter() - t0)
        return exe

    def dummy_entries(self, key: BucketKey) -> list[BatchEntry]:
        """A batch that lands exactly in bucket `key` (all tokens on the dummy page 0)."""
        pages = [0] * key.pages_per_seq
        if key.block_q == 1:
            return [BatchEntry([0], 0, pages) for _ in range(key.num_seqs)]
        # one sequence fewer than the bucket so the first one extends by >= 2 tokens (not a decode);
        # the tokens are spread evenly so that no sequence outgrows its pages_per_seq pages
        num_seqs = max(1, key.num_seqs - 1)
        base, extra = divmod(key.num_tokens, num_seqs)
        lens = [base + (i < extra) for i in range(num_seqs)]
        assert lens[0] <= key.pages_per_seq * self.page_size, f"bucket {key} cannot be filled"
        return [BatchEntry([0] * n, 0, pages) for n in lens]

    def precompile(self, sampler_variants: Sequence, show_progress: bool = True) -> None:
        """Compile every step bucket and the given sampler variants, then mark warm-up done.

        `sampler_variants`: (SamplingBatch, flags) pairs built for each sequence bucket by the engine.
        """
        buckets = [k for k in self.all_buckets() if (k, False) not in self._step_exec]
        jobs: list[tuple[object, Callable]] = []  # (key, lowered); step keys are (bucket, program name)
        for key in buckets:
            batch, got = self.build_forward_batch(self.dummy_entries(key))
            assert got == key, (got, key)
            jobs += [((key, name), lowered) for name, lowered in self._lower_step(batch, False).items()]
        for sampling, flags in sampler_variants:
            s = sampling.temperature.shape[0]
            logits = jax.ShapeDtypeStruct((s, self.model_config.vocab_size), jnp.float32,
                                          sharding=self._sampler_logits_sharding(flags))
            key = (s, flags, jax.tree.map(lambda x: x.shape, sampling))
            if key not in self._sample_exec:
                jobs.append((key, self._sample_jit.lower(logits, sampling, flags)))
        bar = tqdm(total=len(jobs), desc="Compiling", unit="executable",
                   disable=None if show_progress else True)  # None: no bar where stderr is no terminal
        # XLA compiles outside the GIL: one worker per core roughly divides start-up time by the cores
        t0 = time.perf_counter()
        step_parts: dict[BucketKey, dict[str, Callable]] = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            futures = {pool.submit(lowered.compile): key for key, lowered in jobs}
            for fut in concurrent.futures.as_completed(futures):
                key = futures[fut]
                if isinstance(key[0], BucketKey):
                    step_parts.setdefault(key[0], {})[key[1]] = fut.result()
                else:
                    self._sample_exec[key] = fut.result()
                bar.update()
        for key, parts in step_parts.items():
            self._step_exec[(key, False)] = self._assemble_step(parts)
        self.compile_seconds += time.perf_counter() - t0
        bar.close()
        self.warmed_up = True
        self.precompiled = True

    def mark_warmed_up(self) -> None:
        self.warmed_up = True

    # ---- LoRA slots -------------------------------------------------------------------------------
    def write_lora_slot(self, slot: int, adapter: lora_lib.LoraAdapter | None) -> None:
        """Write `adapter`'s host arrays (None: zeros) into LoRA slot `slot` of every layer: one donated
        device update of the slot arrays, compiled once for any slot (the slot index is traced).

        Raises:
            ValueError: no LoRA slots, or `slot` is 0 (the base model's) or out of range.
        """
        if self.lora is None:
            raise ValueError("the runner has no LoRA slots")
        if not 0 < slot < self.lora.num_slots:
            raise ValueError(f"LoRA slot {slot} out of range 1..{self.lora.num_slots - 1}")
        layers = self.params["layers"]
        stacked = functional.is_stacked(layers)
        layout = lora_lib.slot_layout(self.model_config, self.lora)
        per_layer = adapter.layers if adapter is not None else [
            {k: np.zeros(tuple(n for j, n in enumerate(shape) if j != axis), np.float32)
             for k, (shape, _, axis) in layout.items()}] * self.model_config.num_layers
        # the slot axis of each array (one further in under a stacked L axis)
        slot_axes = {k: axis + stacked for k, (_, _, axis) in layout.items()}
        if stacked:
            tree = layers["lora"]
            values = {k: np.stack([p[k] for p in per_layer]) for k in tree}
        else:
            tree = {i: layers[i]["lora"] for i in layers}
            values = {i: per_layer[i] for i in layers}
        fn = self._write_lora_jit.get(stacked)
        if fn is None:
            def write_one(x, v, slot, axis):
                return jax.lax.dynamic_update_index_in_dim(x, v.astype(x.dtype), slot, axis)

            def write(tree, slot, values):
                if stacked:
                    return {k: write_one(x, values[k], slot, slot_axes[k]) for k, x in tree.items()}
                return {i: {k: write_one(x, values[i][k], slot, slot_axes[k]) for k, x in t.items()}
                        for i, t in tree.items()}

            shardings = jax.tree.map(lambda x: x.sharding, tree) if self.mesh is not None else None
            fn = jax.jit(write, donate_argnums=(0,), out_shardings=shardings)
            self._write_lora_jit[stacked] = fn
        tree = fn(tree, np.int32(slot), values)
        if stacked:
            layers = {**layers, "lora": tree}
        else:
            layers = {i: {**layers[i], "lora": tree[i]} for i in layers}
        self.params = {**self.params, "layers": layers}

    # ---- KV page copies (release policy, D-36) ---------------------------------------------------
    # `KVPageIO` (jaxserve/cache/page_io.py) over the device pools, through the page-copy jits above.

    def _whole_pages_only(self) -> None:
        if self.window_pages is not None:
            raise RuntimeError("page copies need every layer's pages: the hybrid sliding-window pool has none (D-46)")

    def read_pages(self, pages) -> "DevicePageRead":
        """Start copying K/V of `pages` to the host (`copy_to_host_async`); finish with `.result()`."""
        self._whole_pages_only()
        idx = padded_page_ids(pages)
        with self._routed("read_pages", pages):
            k, v = self._page["gather"](self.k_pool, self.v_pool, idx)
        k.copy_to_host_async()
        v.copy_to_host_async()
        return DevicePageRead(k, v)

    def write_pages(self, pages, k: np.ndarray, v: np.ndarray) -> None:
        """Write host K/V `[L, len(pages), KVH, ps, D]` into device `pages`. With several processes
        the contents reach the other ranks through a collective (`StepChannel.share`)."""
        self._whole_pages_only()
        with self._routed("write_pages", pages, (k.shape, k.dtype.str), (v.shape, v.dtype.str)):
            if self.channel is not None:
                k, v = self.channel.share(k, v)
            idx = padded_page_ids(pages)
            n, pad = len(pages), len(idx) - len(pages)
            if pad:
                widths = [(0, 0), (0, pad)] + [(0, 0)] * (k.ndim - 2)
                k, v = np.pad(k[:, :n], widths), np.pad(v[:, :n], widths)
            self.k_pool, self.v_pool = self._page["scatter"](self.k_pool, self.v_pool, idx, k, v)

    def copy_pages(self, src, dst) -> None:
        """Copy device pages `src` onto `dst` (whole pages, K and V)."""
        self._whole_pages_only()
        src_idx, dst_idx = padded_page_ids(src), padded_page_ids(dst)
        with self._routed("copy_pages", src, dst):
            self.k_pool, self.v_pool = self._page["copy"](self.k_pool, self.v_pool, src_idx, dst_idx)
