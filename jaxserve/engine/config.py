"""`EngineConfig`: `ServerArgs` mapped onto the small configs each part of the engine takes, so that nothing
below the engine reads a flag (mini-sglang layers its `EngineConfig` inside `SchedulerConfig` inside
`ServerArgs`; here one mapping, `EngineConfig.of`, in one place).

    runner       RunnerConfig (runner/loader.py): model, tp, KV pool, buckets, LoRA slots
    cache        CacheConfig (scheduler/cache_manager.py): page size, radix tree, release policy, storage tier
    scheduler    SchedulerConfig (scheduler/scheduler.py), completed by `scheduler_config` once the runner
                 knows the context length and its extend buckets
    speculative  SpeculativeConfig (speculative/decoder.py), None without --speculative-algorithm
    lora_slots   the host side of LoRA (scheduler/lora_slots.py), None without --enable-lora

Research code still writes `Engine(ServerArgs(...))`; `Engine` calls `EngineConfig.of` itself.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Mapping

from jaxserve.cache.release_policy import ReleasePolicyConfig
from jaxserve.cache.storage import StorageConfig
from jaxserve.model import lora as lora_lib
from jaxserve.runner.buckets import EXTEND_BLOCK_Q
from jaxserve.runner.loader import LoraSlotsConfig, RunnerConfig
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.scheduler.cache_manager import CacheConfig
from jaxserve.scheduler.scheduler import SchedulerConfig
from jaxserve.server_args import ServerArgs
from jaxserve.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoraHostConfig:
    """The adapters' host table (`scheduler.lora_slots.LoraSlots`): adapters per batch and at most this
    many loaded (None: no bound)."""

    max_loras_per_batch: int
    max_loaded_loras: int | None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every part's config (see the module docstring); `grammar_backend` / `json_whitespace_pattern` are
    the grammar backend's, the rest the engine's own (`disable_overlap_schedule`, `disable_jump_forward`,
    `random_seed` of requests without a seed, `decode_log_interval` in decode steps, `enable_debug_checks`,
    `disable_precompile`, `log_storage_stats`)."""

    runner: RunnerConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    speculative: SpeculativeConfig | None
    lora: LoraHostConfig | None
    grammar_backend: str = "llguidance"
    json_whitespace_pattern: str | None = None
    disable_overlap_schedule: bool = True
    disable_jump_forward: bool = False
    random_seed: int | None = None
    decode_log_interval: int = 40
    enable_debug_checks: bool = False
    disable_precompile: bool = False
    log_storage_stats: bool = False

    @staticmethod
    def of(args: ServerArgs, environ: Mapping[str, str] = os.environ) -> "EngineConfig":
        """Map resolved `args` (`ServerArgs.resolved`) onto the parts' configs; warn about flags that do
        nothing in this combination (SGLang 0.5.23 ignores them silently).

        Raises:
            ValueError: a bad value no flag check sees alone (`StorageError`: the storage tier's extra config,
                size or environment, naming it; an unknown --speculative-algorithm).
        """
        _warn_ignored_flags(args)
        chunk = args.chunked_prefill_size if args.chunked_prefill_size > 0 else args.max_prefill_tokens
        sources = tuple(lora_lib.parse_lora_paths(args.lora_paths)) if args.enable_lora else ()
        runner = RunnerConfig(
            model_path=args.model_path, served_model_name=args.served_model_name, dtype=args.dtype,
            quantization=args.quantization, weights_cache_dir=args.weights_cache_dir, weights_cache=bool(args.weights_cache),
            tp_size=args.tp_size, context_length=args.context_length, page_size=args.page_size,
            max_total_tokens=args.max_total_tokens, mem_fraction_static=args.mem_fraction_static,
            max_num_pages=args.radix_cache_max_num_blocks, swa_full_tokens_ratio=args.swa_full_tokens_ratio,
            hybrid_swa_off_reason=_hybrid_swa_off_reason(args), kv_cache_quantization=args.kv_cache_quantization,
            attention_backend=args.attention_backend,
            layer_loop=args.layer_loop, max_running_requests=args.max_running_requests, max_extend_tokens=chunk,
            min_extend_tokens=2 if args.speculative_algorithm else EXTEND_BLOCK_Q,
            lora=LoraSlotsConfig(args.max_loras_per_batch + 1, args.max_lora_rank, args.lora_target_modules)
            if args.enable_lora else None,
            lora_sources=sources,
        )
        storage = None if args.disable_radix_cache else StorageConfig.from_flags(
            args.hicache_storage_backend, args.hicache_storage_backend_extra_config,
            args.hicache_storage_prefetch_policy, args.hicache_write_policy, environ)
        cache = CacheConfig(
            page_size=args.page_size, disable_radix_cache=args.disable_radix_cache,
            release_policy=None if args.disable_radix_cache else _release_policy_config(args), storage=storage,
        )
        scheduler = SchedulerConfig(
            page_size=args.page_size, max_running_requests=args.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens, chunked_prefill_size=args.chunked_prefill_size,
            enable_mixed_chunk=args.enable_mixed_chunk, schedule_policy=args.schedule_policy,
            disable_radix_cache=args.disable_radix_cache, seed=args.random_seed,
            prefill_decode_itl_ratio=args.prefill_decode_itl_ratio, min_prefill_budget=args.min_prefill_budget,
            prefill_decode_stall_fraction=args.prefill_decode_stall_fraction,
        )
        return EngineConfig(
            runner=runner, cache=cache, scheduler=scheduler, speculative=_speculative_config(args),
            lora=LoraHostConfig(args.max_loras_per_batch, args.max_loaded_loras) if args.enable_lora else None,
            grammar_backend=args.grammar_backend, json_whitespace_pattern=args.constrained_json_whitespace_pattern,
            disable_overlap_schedule=args.disable_overlap_schedule, disable_jump_forward=args.disable_jump_forward,
            random_seed=args.random_seed, decode_log_interval=args.decode_log_interval,
            enable_debug_checks=args.enable_debug_checks, disable_precompile=args.disable_precompile,
            log_storage_stats=args.hicache_storage_backend is not None,
        )

    def scheduler_config(self, runner: ModelRunner) -> SchedulerConfig:
        """The scheduler's config with what the runner resolved: a step's token budget never exceeds the
        context nor the largest compiled extend bucket, and a capped step fills up to its bucket."""
        s, context = self.scheduler, runner.context_length
        return dataclasses.replace(s, max_prefill_tokens=min(s.max_prefill_tokens, context),
                                   chunked_prefill_size=min(s.chunked_prefill_size, context),
                                   extend_token_buckets=tuple(runner.extend_tokens))


def _warn_ignored_flags(args: ServerArgs) -> None:
    if ignored := args.ignored_speculative_flags():
        logger.warning("%s given without --speculative-algorithm: ignored (decoding is one token per step)",
                       ", ".join(ignored))
    if args.speculative_algorithm is not None and args.speculative_max_batch_size == 0:
        logger.warning("--speculative-max-batch-size 0: no decode step verifies drafts (speculation is off)")
    if ignored := args.ignored_radix_cache_flags():
        logger.warning("%s given with --disable-radix-cache: ignored (there are no radix-cache nodes to move or merge)",
                       ", ".join(ignored))


def _hybrid_swa_off_reason(args: ServerArgs) -> str | None:
    """Why a sliding-window model would keep every layer's pages instead of the hybrid window pool (D-46):
    --disable-hybrid-swa-memory, or a tier that copies whole pages (host, storage); None: the hybrid pool."""
    if args.disable_hybrid_swa_memory:
        return "--disable-hybrid-swa-memory"
    if args.enable_hierarchical_cache and not args.disable_radix_cache:
        return "--enable-hierarchical-cache"
    if args.hicache_storage_backend is not None and not args.disable_radix_cache:
        return "--hicache-storage-backend"
    return None


def _release_policy_config(args: ServerArgs) -> ReleasePolicyConfig:
    return ReleasePolicyConfig(
        max_frozen_ratio=args.radix_cache_max_frozen_ratio,
        enable_host_tier=args.enable_hierarchical_cache,
        hicache_ratio=args.hicache_ratio,
        hicache_size_gb=args.hicache_size,
        soft_free_threshold_s=args.radix_cache_soft_free_threshold,
        evict_threshold=args.radix_cache_evict_threshold,
        enable_coalescing=args.enable_auto_merge,
        merge_max_suffix_tokens=args.merge_max_suffix_tokens,
        merge_min_shared_ratio=args.merge_min_shared_ratio,
        conservative_batch_size=args.release_conservative_batch_size,
        aggressive_batch_size=args.release_aggressive_batch_size,
        enable_stats_log=args.enable_radix_cache_stats,
    )


def _speculative_config(args: ServerArgs) -> SpeculativeConfig | None:
    """None unless --speculative-algorithm. Raises ValueError for an algorithm other than NGRAM."""
    if args.speculative_algorithm is None:
        return None
    return SpeculativeConfig.of(args.speculative_algorithm, args.speculative_num_draft_tokens or 15,
                                args.speculative_ngram_max_trie_depth, args.speculative_max_batch_size,
                                not args.disable_speculative_adaptive, args.speculative_ngram_capacity)
