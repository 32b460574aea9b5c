"""`load_runner`: everything between a model path and a `ModelRunner` ready to run steps.

In order (as SGLang's `ModelRunner.__init__` and `init_memory_pool`): the architecture, refused from its
config alone before anything loads; the weights (`model.loader.load_model`: a GGUF or safetensors, or the
converted-weights cache); the tensor-parallel plan and the mesh (heads that tp does not divide are refused
before any allocation; kv heads replicated where tp is a multiple of them); `--quantization`; the context
length; the KV pool sized per device (every layer's pages, or the hybrid sliding-window pool of D-46) and
allocated, with its page allocator; the LoRA device slots. Compiling the buckets is `ModelRunner.precompile`,
which the engine calls once the sampler's variants are known.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax

from jaxserve.cache.kv_pool import PageAllocator, PoolShape, available_memory_bytes, size_pool
from jaxserve.cache.window_pool import HybridPageAllocator, WindowLayout, check_window_pool_fits, size_hybrid_pool
from jaxserve.model import functional
from jaxserve.model import lora as lora_lib
from jaxserve.model.architecture import check_architecture
from jaxserve.model.config import ModelConfig
from jaxserve.model.context_length import resolve_context_length
from jaxserve.model.loader import BLOCK_QUANTIZATIONS, load_model, replicate_kv_heads
from jaxserve.model.tokenizer import resolve_model_path
from jaxserve.pallas import get_attention_backend
from jaxserve.pallas.quantized_kv import KV_QUANT_DTYPES, SCALE_BYTES, allocate_pools
from jaxserve.parallel import make_mesh, per_device_nbytes, plan_tensor_parallel, pool_shards
from jaxserve.quant.w8a8 import quantize_params
from jaxserve.runner.buckets import EXTEND_BLOCK_Q
from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

MAX_DEFAULT_CONTEXT = 8192  # the default context is the model's, capped here (a CPU memory reason, docs/api.md)


@dataclasses.dataclass(frozen=True)
class LoraSlotsConfig:
    """The LoRA device slots (SGLang's flags): `num_slots` - 1 adapters per batch, at `max_rank` (None:
    the largest rank of the --lora-paths adapters, else 16), on `target_modules` (PEFT names; None: the
    --lora-paths adapters', else all)."""

    num_slots: int
    max_rank: int | None
    target_modules: tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """What the runner is built from (the engine maps `ServerArgs` onto it: engine/config.py; the defaults
    here are the CPU's resolved flags).

    `model_path`: an HF directory, a .gguf file or "default"; `served_model_name`: the name in messages
    (None: from the path). `context_length`: tokens (None: the model's, capped at MAX_DEFAULT_CONTEXT).
    Pool: `page_size` tokens per page, `max_total_tokens` / `mem_fraction_static` / `max_num_pages` as the
    flags; `swa_full_tokens_ratio` for the hybrid pool, which `hybrid_swa_off_reason` (a flag's name, or
    None) turns off. `max_extend_tokens`: the most tokens of one step (the chunk); `min_extend_tokens`: the
    smallest extend bucket. `kv_cache_quantization`: a compressed pool (a key of `KV_QUANT_DTYPES`,
    --kv-cache-dtype) or None for a pool in the model's dtype. `lora_sources`: the --lora-paths adapters (their ranks and targets size the
    slots; the engine loads them).
    """

    model_path: str = "default"
    served_model_name: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    weights_cache_dir: str | None = None
    weights_cache: bool = True
    tp_size: int = 1
    context_length: int | None = None
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    max_num_pages: int | None = None
    swa_full_tokens_ratio: float = 0.8
    hybrid_swa_off_reason: str | None = None
    kv_cache_quantization: str | None = None
    attention_backend: str = "xla"
    layer_loop: str = "host"
    max_running_requests: int = 8
    max_extend_tokens: int = 512
    min_extend_tokens: int = EXTEND_BLOCK_Q
    lora: LoraSlotsConfig | None = None
    lora_sources: tuple[lora_lib.LoraSource, ...] = ()


def load_runner(config: RunnerConfig) -> ModelRunner:
    """Load the model of `config` and allocate its KV pool (see the module docstring).

    Raises:
        FileNotFoundError: no model at the path.
        ValueError: an unsupported architecture, a tp size the heads or the devices do not allow, a memory
            budget without room for two pages, a window space too small (naming the flag), LoRA with
            several processes.
    """
    platform = jax.default_backend()
    model_path = resolve_model_path(config.model_path)
    check_architecture(model_path)  # before the weights: a refusal costs milliseconds
    block_quantization = config.quantization if config.quantization in BLOCK_QUANTIZATIONS else None
    model_config, params = load_model(config.model_path, config.dtype, config.weights_cache_dir,
                                      use_weights_cache=config.weights_cache, quantization=block_quantization)
    model_name = config.served_model_name or Path(model_path.rstrip("/")).name.split(".")[0]
    plan = plan_tensor_parallel(model_config, config.tp_size, model_name)
    mesh = make_mesh(config.tp_size)
    model_config, params = replicate_kv_heads(model_config, params, plan.kv_replicas)
    if config.quantization not in BLOCK_QUANTIZATIONS:  # None, w8a8_int8, or refused by name
        model_config, params = quantize_params(model_config, params, config.quantization)
    context_length = resolve_context_length(config.context_length, model_config.max_position_embeddings,
                                            MAX_DEFAULT_CONTEXT, refuse_longer=False)  # serve.py refused it already
    pool_shape, window_layout = size_kv_pool(config, model_config, params, mesh, platform, context_length)
    device_shape = pool_shape if window_layout is None else window_layout.device_pool_shape(pool_shape)
    k_pool, v_pool = allocate_pools(device_shape.shape, device_shape.dtype)
    allocator = PageAllocator(pool_shape.num_pages) if window_layout is None else HybridPageAllocator(window_layout)
    return ModelRunner(
        model_config, params, k_pool, v_pool,
        attn_fn=get_attention_backend(config.attention_backend),
        layer_loop=config.layer_loop,
        max_running_requests=config.max_running_requests,
        max_extend_tokens=min(config.max_extend_tokens, context_length),
        context_length=context_length,
        min_extend_tokens=config.min_extend_tokens,
        mesh=mesh,
        lora=lora_slots_config(config, plan.kv_replicas),
        allocator=allocator,
        pool_shape=pool_shape,
        model_path=model_path,
    )


def size_kv_pool(config: RunnerConfig, model_config: ModelConfig, params: functional.Params, mesh,
                 platform: str, context_length: int) -> tuple[PoolShape, WindowLayout | None]:
    """The KV pool's shape, sized to one device's budget (each device holds its share of the weights and
    of every page), and the hybrid window pool's layout (None: every layer keeps all its pages).

    Raises:
        ValueError: no room for two pages, or a window space that cannot hold one request's window and a
            chunk (naming --swa-full-tokens-ratio).
    """
    weights_bytes = per_device_nbytes(params, functional.logical_axes(model_config), config.tp_size)
    quantized = config.kv_cache_quantization
    pool_args = dict(
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        page_size=config.page_size,
        dtype=str(functional.compute_dtype(params)) if quantized is None else KV_QUANT_DTYPES[quantized],
        scale_bytes=0 if quantized is None else SCALE_BYTES,
        max_total_tokens=config.max_total_tokens,
        mem_fraction_static=config.mem_fraction_static,
        weights_bytes=weights_bytes,
        platform=platform,
        max_num_pages=config.max_num_pages,
        pool_shards=pool_shards(model_config.num_kv_heads, config.tp_size),
        available_bytes=available_memory_bytes(mesh.devices.flat),
    )
    if not model_config.has_sliding_window_layers:
        return size_pool(num_layers=model_config.num_layers, **pool_args), None
    if config.hybrid_swa_off_reason is not None:
        logger.info("sliding-window model with %s: every layer keeps all its pages", config.hybrid_swa_off_reason)
        return size_pool(num_layers=model_config.num_layers, **pool_args), None
    shape, layout = size_hybrid_pool(model_config.layer_sliding_windows(), config.swa_full_tokens_ratio, **pool_args)
    check_window_pool_fits(layout, min(config.max_extend_tokens, context_length), config.page_size)
    return shape, layout


def lora_slots_config(config: RunnerConfig, kv_replicas: int) -> lora_lib.LoraConfig | None:
    """The LoRA device slots (None without --enable-lora): rank and targets from the flags, else from the
    --lora-paths adapters' configs, as SGLang infers them.

    Raises:
        ValueError: LoRA with several processes.
    """
    if config.lora is None:
        return None
    if jax.process_count() > 1:
        raise ValueError("--enable-lora runs in one process: give --nnodes 1")
    rank, targets = lora_lib.infer_rank_and_targets(list(config.lora_sources))
    return lora_lib.LoraConfig.of(config.lora.num_slots, config.lora.max_rank or rank or 16,
                                  config.lora.target_modules or targets, kv_replicas)
