"""Engine: the in-process API of jaxserve (used by the server and by research code).

    engine = Engine(model_path="default", max_total_tokens=4096)
    engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    rids = engine.add_request(GenerateInput([1, 2, 3], {"max_new_tokens": 4})); outs = engine.step(); engine.abort(rid)

The engine composes its parts, each built from its own config (engine/config.py maps `ServerArgs` onto
them): the model runner (runner/: weights, mesh, KV pool, compiled steps), the prefix cache
(`CacheManager`: radix tree, release policy, storage tier), the scheduler, the grammar backend, the
speculator and the output processor. `step()` = schedule -> launch (jitted forward + sample) -> read ->
process. The jitted core is `jaxserve.runner.model_runner.forward_step`, a pure function of (params,
k_pool, v_pool, ForwardBatch).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Any, Sequence

import jax
import numpy as np

from jaxserve.cache.release_policy import RadixCacheStats
from jaxserve.cache.storage import storage_fingerprint
from jaxserve.constrained import GrammarCompiler, GrammarQueue, GrammarSpec, get_grammar_backend
from jaxserve.constrained.reasoner import ReasonerMatcher
from jaxserve.core.batch import BatchEntry
from jaxserve.core.errors import RequestError
from jaxserve.core.request import Req, finish_abort, finish_length, new_rid
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import overlap, prompt_logprobs
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.memory_usage import MemoryUsage, measure_array_bytes, process_rss_bytes
from jaxserve.engine.output_processor import LaunchedBatch, OutputProcessor, StepCounts
from jaxserve.engine.outputs import EngineSnapshot, EngineStats, LogprobKeys, StepOutput, meta_info
from jaxserve.engine.request_input import GenerateInput
from jaxserve.engine.sampling_rows import grammar_bitmask, sampler_warmup_variants, sampling_rows
from jaxserve.engine.stats_log import decode_line, prefill_line, prefill_stats, storage_line
from jaxserve.engine.validation.check import CheckedInput, RequestChecker
from jaxserve.engine.validation.limits import ModelLimits
from jaxserve.model import lora as lora_lib
from jaxserve.model.tokenizer import cache_root, load_tokenizer, source_fingerprint
from jaxserve.runner import sampler as sampler_lib
from jaxserve.runner.loader import load_runner
from jaxserve.scheduler.cache_manager import CacheManager
from jaxserve.scheduler.lora_slots import LoraSlots
from jaxserve.scheduler.scheduler import ScheduleBatch, Scheduler
from jaxserve.server_args import ServerArgs
from jaxserve.speculative import NgramSpeculator, SpeculativeStats, constrain_drafts

logger = logging.getLogger(__name__)


class Engine:
    """Continuous-batching engine over one model (see the module docstring).

    Args:
        server_args: a `ServerArgs`; keyword arguments override its fields (same names as the flags).

    Raises:
        FileNotFoundError / ValueError: from loading the model or from invalid arguments.
    """

    def __init__(self, server_args: ServerArgs | None = None, **kwargs: Any):
        args = dataclasses.replace(server_args or ServerArgs(), **kwargs).resolved(jax.default_backend())
        self.config = config = EngineConfig.of(args)
        enable_compilation_cache(args.compilation_cache_dir)
        self.runner = runner = load_runner(config.runner)
        # /get_server_info reports the pool the model got: a window model without the hybrid pool keeps every layer's pages
        has_windows = runner.model_config.has_sliding_window_layers and runner.window_layout is None
        self.args = dataclasses.replace(args, disable_hybrid_swa_memory=True) if has_windows else args
        self.tokenizer = load_tokenizer(args.model_path, args.tokenizer_path)
        self.eos_token_ids = tuple(runner.model_config.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        page_io = runner if runner.window_layout is None else None  # whole-page copies: not over the hybrid pool (D-46)
        self.cache = CacheManager.build(config.cache, runner.allocator, runner.pool_shape, page_io, self.kv_fingerprint())
        lora_slots = None if config.lora is None else LoraSlots(runner.lora.num_slots, config.lora.max_loras_per_batch,
                                                                config.lora.max_loaded_loras)
        self.scheduler = Scheduler(config.scheduler_config(runner), self.cache, lora_slots)
        self.grammar_backend = get_grammar_backend(
            config.grammar_backend, self.tokenizer, whitespace_pattern=config.json_whitespace_pattern,
            vocab_size=runner.model_config.vocab_size, eos_token_ids=self.eos_token_ids)
        self.grammar_queue: GrammarQueue[Req] = GrammarQueue(GrammarCompiler(self.grammar_backend))
        self.limits = ModelLimits(runner.model_config.vocab_size, runner.context_length, runner.pool_shape.num_tokens,
                                  None if args.chunked_prefill_size > 0 else args.max_prefill_tokens, lora_slots)
        self.checker = RequestChecker(self.tokenizer, self.limits, self.grammar_backend.compile)
        self.speculator = None if config.speculative is None else NgramSpeculator(config.speculative, self.cache.tree)
        self.processor = OutputProcessor(self.scheduler, self.cache, self.speculator, config.disable_jump_forward)
        self.stats = EngineStats()
        self._rng = random.Random(config.random_seed)
        self._finished_outside_step: list[StepOutput] = []
        self._throughput_mark, self._gen_throughput = (time.perf_counter(), 0), 0.0
        self._inflight: LaunchedBatch | None = None  # a decode step whose tokens are not read yet (overlap)
        self._last_tokens_read = time.perf_counter()
        # the overlap schedule needs the sampled tokens on the device: one process on one device
        self._overlap_enabled = not config.disable_overlap_schedule and runner.mesh is None and runner.channel is None
        for source in config.runner.lora_sources:
            self.load_lora_adapter(source.lora_name, source.lora_path, source.pinned)
        self.array_bytes = measure_array_bytes(runner.params, runner.k_pool, runner.v_pool, len(self.devices))
        self._finish_start_up()

    def _finish_start_up(self) -> None:
        """Warn about a pool smaller than the context, compile every bucket (unless --disable-precompile),
        then log the ready line."""
        runner, shape = self.runner, self.runner.pool_shape
        if shape.num_tokens < runner.context_length:
            logger.warning(
                "the KV pool holds %d tokens, fewer than the context length %d: a prompt of %d tokens or more "
                "is refused and max_new_tokens is cut to what the pool holds (raise --max-total-tokens or "
                "--mem-fraction-static)", shape.num_tokens, runner.context_length, self.limits.max_req_input_len,
            )
        if self.config.disable_precompile:
            runner.mark_warmed_up()
        else:
            runner.precompile(sampler_warmup_variants((k.num_seqs for k in runner.all_buckets()), runner.model_config.vocab_size))
        logger.info(
            # the page count as the "KV pool:" line of kv_pool.size_pool gives it: page 0 is the dummy page
            "engine ready: %s, KV pool %d tokens (%d pages of %d, one of them the reserved dummy page; %s), context "
            "%d, attention %s, layer loop %s, tp_size %d on %s",
            runner.model_config.architecture, shape.num_tokens, shape.num_pages, shape.page_size,
            f"--kv-cache-dtype {self.args.kv_cache_dtype}: {shape.dtype}" + (" and scales" if shape.scale_bytes else ""),
            runner.context_length,
            self.args.attention_backend, self.args.layer_loop, self.args.tp_size, ", ".join(self.devices),
        )

    def kv_fingerprint(self) -> str:
        """What changes a page's KV bytes (model and weights, dtype, quantization, page size, pool layout, tp
        size, RoPE): the storage tier salts its keys with it, so pages of another model are never served."""
        cfg, shape = self.runner.model_config, self.runner.pool_shape
        return storage_fingerprint(
            weights=source_fingerprint(self.runner.model_path), architecture=cfg.architecture,
            dtype=np.dtype(jax.numpy.dtype(shape.dtype)), quantization=self.args.quantization, page_size=shape.page_size,
            pool_layout=("layers, pages, kv_heads, page, head_dim", cfg.num_layers, shape.num_kv_heads, shape.head_dim),
            tp_size=self.args.tp_size, rope=(cfg.rope_theta, cfg.rope_scaling),
        )

    @property
    def devices(self) -> list[str]:
        """The devices the model runs on, as "platform:id" (one per tensor-parallel shard)."""
        return [f"{d.platform}:{d.id}" for d in self.runner.devices]

    def memory_usage(self) -> MemoryUsage:
        """The weights' and the KV pool's bytes (measured at start-up) and the process's RSS now; safe
        to call from any thread."""
        return MemoryUsage(self.array_bytes, process_rss_bytes())

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self, request: GenerateInput | CheckedInput | str | Sequence[int],
        sampling_params: SamplingParams | dict | None = None, **fields: Any,
    ) -> list[str]:
        """Queue one prompt; returns the rids of its `n` sequences.

        `request`: a `GenerateInput` (its fields: request_input.py), checked here once
        (`RequestChecker.check`), or a `CheckedInput` that passed that check already (the server's
        `EngineLoop.submit`, which also made its rid unique), queued as it is. Research code may give the
        prompt (text or token ids), its sampling params and the other fields by name instead
        (`GenerateInput.of`).

        Raises:
            SamplingParamsError: an invalid sampling parameter (names it).
            RequestError: what `RequestChecker.check` refuses; a rid in use; an adapter unloaded since
                the request was checked.
        """
        if isinstance(request, CheckedInput):
            if sampling_params is not None or fields:
                raise TypeError("give a CheckedInput alone")
            checked = request
        else:
            checked = self.checker.check(GenerateInput.of(request, sampling_params, **fields))
            base = checked.request.rid or new_rid()
            if base in self.processor.reqs or any(f"{base}-{i}" in self.processor.reqs for i in range(checked.params.n)):
                raise RequestError("rid", f"request id {base!r} is already in use")
            checked = dataclasses.replace(checked, request=dataclasses.replace(checked.request, rid=base))
        request, input_ids, params = checked.request, checked.input_ids, checked.params
        lora_slots = self.scheduler.lora
        rids = [request.rid] if params.n == 1 else [f"{request.rid}-{i}" for i in range(params.n)]
        now = time.perf_counter()
        for i, r in enumerate(rids):
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(32)
            lora_id = None if request.lora_path is None else lora_slots.acquire(request.lora_path)
            # the KV caches key on the adapter's contents: KV computed under one adapter is never another's
            namespace = (request.namespace if lora_id is None
                         else ("lora", lora_slots.cache_key_of(lora_id), request.namespace))
            req = Req(r, list(input_ids), params, request.return_logprob or request.top_logprobs_num > 0,
                      request.top_logprobs_num, request.logprob_start_len, tuple(request.token_ids_logprob),
                      namespace, arrival_time=now, seed=seed, think_end_ids=tuple(request.think_end_ids),
                      lora_id=lora_id)
            self.processor.track(req, IncrementalDetokenizer(self.tokenizer, input_ids, params, self.eos_token_ids))
            self.stats.num_requests += 1
            self.stats.prompt_tokens += len(input_ids)
            spec = GrammarSpec.of_sampling_params(params)
            if params.max_new_tokens == 0 and not req.wants_input_logprobs:
                self._finish_outside_step(req, finish_length(0))
            elif params.max_new_tokens == 0:  # prompt logprobs only (SGLang's select scores choices so)
                self.scheduler.add(req)
            elif spec is not None:
                self.grammar_queue.add(req, spec)
            else:
                self.scheduler.add(req)
        return rids

    # ---- LoRA adapters (thread-safe: the server calls these off the engine thread) ---------------
    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> list[str]:
        """Read a PEFT adapter into host memory and make `lora_name` servable (its device slot is
        written when a request under it is first admitted). Returns the names unloaded to stay within
        --max-loaded-loras.

        Raises:
            ValueError: LoRA is not enabled, the name is loaded already, or `lora.LoraError` (the adapter
                cannot serve this model: files, rank, shapes, targets).
        """
        lora_slots = self.scheduler.lora
        if lora_slots is None:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if not lora_name or not isinstance(lora_name, str):
            raise ValueError(f"lora_name must be a non-empty string, got {lora_name!r}")
        if not isinstance(lora_path, str) or not lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {lora_path!r}")
        if lora_slots.has(lora_name):
            raise ValueError(f"LoRA adapter {lora_name!r} is already loaded")
        adapter = lora_lib.load_adapter(lora_path, self.runner.model_config, self.runner.lora)
        _, evicted = lora_slots.register(lora_name, lora_path, adapter, bool(pinned), cache_key=adapter.digest)
        logger.info("loaded LoRA adapter %s from %s (rank %d, %s)%s", lora_name, lora_path, adapter.rank,
                    ", ".join(adapter.targets), f"; unloaded {', '.join(evicted)}" if evicted else "")
        return evicted

    def unload_lora_adapter(self, lora_name: str) -> str:
        """Stop serving `lora_name`: new requests naming it are refused at once; its running requests
        finish under it, then its slot and host memory are freed (`lora_in_use` says when). Returns the
        adapter's lora_id.

        Raises:
            ValueError: LoRA is not enabled, or the name is not loaded.
        """
        if self.scheduler.lora is None:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        return self.scheduler.lora.unregister(lora_name)

    def lora_in_use(self, lora_id: str) -> bool:
        return self.scheduler.lora is not None and self.scheduler.lora.is_in_use(lora_id)

    def loaded_lora_adapters(self) -> dict[str, str]:
        """name -> path of the loaded adapters ({} without LoRA)."""
        return {} if self.scheduler.lora is None else self.scheduler.lora.loaded()

    def _write_lora_slots(self) -> None:
        """Write the adapters the scheduler gave slots to into the device slots, before the step runs."""
        if self.scheduler.lora is not None:
            for write in self.scheduler.lora.take_writes():
                self.runner.write_lora_slot(write.slot, write.payload)

    def abort(self, rid: str) -> bool:
        """Stop a request wherever it is and free its pages. Returns False for an unknown rid."""
        req = self.processor.reqs.get(rid)
        if req is None or req.is_finished:
            return False
        self.grammar_queue.remove(req)
        self._finish_outside_step(req, finish_abort("aborted by the client"), is_abort=True)
        return True

    def close(self) -> None:
        """Finish the storage tier's queued writes and stop its threads (a no-op without one)."""
        if self.cache.policy is not None:
            self.cache.policy.close()

    def flush_cache(self) -> None:
        """Drop every cached prefix (the radix tree, device and host tiers) and return its pages to the free
        list. The storage tier's files stay (a restart and the other replicas read them).

        Raises:
            RuntimeError: requests are waiting or running (their prefixes are locked in the tree).
        """
        if self.scheduler.has_work():
            num = self.scheduler.num_running + len(self.scheduler.waiting)
            raise RuntimeError(f"cannot flush the cache while {num} requests are running or waiting")
        self.cache.flush()
        if self.speculator is not None:
            self.speculator.flush()

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_work() or bool(self._finished_outside_step) or self.grammar_queue.num_pending > 0
                or self.step_in_flight)

    @property
    def step_in_flight(self) -> bool:
        """A decode step was launched and its tokens are not read yet (the overlap schedule): the next
        `step` reads them."""
        return self._inflight is not None and not all(r.is_finished for r in self._inflight.reqs)

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one batch, return every request's progress: schedule -> launch -> read -> process. Under the
        overlap schedule (overlap.py) the next decode step is launched before this one's tokens are read."""
        self._admit_compiled_grammars()
        outputs, self._finished_outside_step = self._finished_outside_step, []
        launched = self._take_step_in_flight() or self._launch(self.scheduler.schedule())
        launched = launched and self.processor.advance(launched)  # the KV it wrote; drops aborted requests
        if launched is None:
            self._idle_checks()
            return outputs
        self._inflight = self._launch_followup(launched)
        step_outputs, counts = self.processor.process(launched, self._read(launched))
        self.stats.add(counts)
        return outputs + step_outputs

    def _take_step_in_flight(self) -> LaunchedBatch | None:
        """The step in flight, whose tokens this call reads; None without one, or when each of its requests
        ended (aborted) since its launch."""
        launched, self._inflight = self._inflight, None
        return None if launched is None or all(r.is_finished for r in launched.reqs) else launched

    def _launch(self, batch: ScheduleBatch | None) -> LaunchedBatch | None:
        """Dispatch the forward and sampling of `batch` (None: nothing to run), verifying drafts where
        the speculator proposes some. The sampled tokens stay on the device under the overlap schedule."""
        if batch is None:
            return None
        self._write_lora_slots()
        started = time.perf_counter()
        if logger.isEnabledFor(logging.INFO) and not batch.is_decode:
            # SGLang's Prefill batch line (engine/stats_log.py); the snapshot only when it is logged
            stats = prefill_stats(batch.reqs, batch.extend_lens, self.scheduler.running)
            logger.info(prefill_line(stats, self.snapshot()))
        drafts = [[] for _ in batch.reqs]
        if self.speculator is not None and self.speculator.should_speculate(batch.reqs, batch.is_decode):
            rows = min(self.runner.max_seqs, self.runner.max_extend_tokens)  # logits rows of a verify step
            drafts = self.speculator.propose_batch(batch.reqs, rows, self.runner.context_length, self.cache.grow)
        if any(drafts):
            return self._launch_verify(batch, drafts, started)
        prompt_variant = prompt_logprobs.step_variant(batch.reqs)  # False, or which prompt logprobs
        logits = self.runner.forward(batch.entries(bool(prompt_variant)), input_logprobs=prompt_variant)
        if prompt_variant:
            logits, prompt_rows = logits
            prompt_logprobs.record(batch.reqs, batch.extend_lens, prompt_rows)
        bitmask = grammar_bitmask(batch.reqs, self.grammar_backend, self.runner.model_config.vocab_size)
        sampling, flags = self._sampling_rows([(r, ()) for r in batch.reqs], bitmask, logits.shape[0])
        sample = self.runner.sample_async if self._overlap_enabled else self.runner.sample
        return LaunchedBatch.plain(batch, sample(logits, sampling, flags), started)

    def _launch_verify(self, batch: ScheduleBatch, drafts: list[list[int]], started: float) -> LaunchedBatch:
        """A verification step: every request's last token and its draft in one forward, one sampled row
        per (request, draft prefix) (speculative/acceptance.py)."""
        reqs, bitmask = batch.reqs, None
        if any(r.grammar is not None for r in reqs):
            drafts, bitmask = constrain_drafts(reqs, drafts, self.runner.model_config.vocab_size)
        entries = [BatchEntry([r.fill_ids[r.kv_len]] + d, r.kv_len, r.page_table, num_logits=1 + len(d),
                              lora_slot=r.lora_slot) for r, d in zip(reqs, drafts)]
        logits = self.runner.forward(entries)
        sampling, flags = self._sampling_rows([(r, d[:j]) for r, d in zip(reqs, drafts) for j in range(len(d) + 1)],
                                              bitmask, logits.shape[0])
        rows = np.cumsum([0] + [len(d) + 1 for d in drafts[:-1]]).tolist()
        return LaunchedBatch(batch, drafts, rows, self.runner.sample(logits, sampling, flags), started, is_verify=True)

    def _launch_followup(self, launched: LaunchedBatch) -> LaunchedBatch | None:
        """The overlap schedule: launch the decode step after `launched` before reading its tokens, with
        its sampled tokens (still on the device) as input, where nothing of the next step needs the host
        (`overlap.can_follow`) and no request left the batch while it ran (the device's tokens are in the
        batch's rows). Call after `OutputProcessor.advance`."""
        if not (self._overlap_enabled and launched.batch.is_decode and not launched.is_verify
                and launched.has_every_row and overlap.can_follow(launched.reqs)):
            return None
        if self.speculator is not None and self.speculator.should_speculate(launched.reqs, True):
            return None
        batch = self.scheduler.schedule_followup(launched.reqs)
        if batch is None:
            return None
        started = time.perf_counter()
        # the token ids are on the device: the entries carry a placeholder
        entries = [BatchEntry([0], r.kv_len, r.page_table, lora_slot=r.lora_slot) for r in batch.reqs]
        logits = self.runner.forward(entries, input_ids=launched.sampled.next_tokens)
        # the row of a request's token after the one in flight: position len(output_ids) + 1
        sampling, flags = self._sampling_rows([(r, (0,)) for r in batch.reqs], None, logits.shape[0])
        self.stats.num_overlapped_steps += 1
        sampled = self.runner.sample_async(logits, sampling, flags)
        return LaunchedBatch.plain(batch, sampled, started)

    def _read(self, launched: LaunchedBatch) -> sampler_lib.SampleOutput:
        """Wait for `launched`'s sampled tokens and observe how long it took since it was launched or,
        under the overlap schedule, since the previous step's tokens were read."""
        sampled = jax.device_get(launched.sampled)
        now = time.perf_counter()
        seconds = now - max(launched.launched, self._last_tokens_read)
        self._last_tokens_read = now
        self.scheduler.observe_step(launched.batch, seconds)
        if self.speculator is not None and launched.is_verify:
            self.speculator.observe_verify(launched.drafts, seconds)
        elif self.speculator is not None and launched.batch.is_decode:
            self.speculator.observe_decode(len(launched.reqs), seconds)
        self._count_step(launched.batch.is_decode_only, launched.launched)
        return sampled

    def _admit_compiled_grammars(self) -> None:
        for ready in self.grammar_queue.pop_ready():
            req = ready.item
            if req.is_finished:
                continue
            if ready.error is not None:
                self._finish_outside_step(req, finish_abort(f"invalid grammar: {ready.error}"))
            else:
                req.grammar = self.grammar_backend.new_matcher(ready.compiled)
                if req.think_end_ids:
                    req.grammar = ReasonerMatcher(req.grammar, req.think_end_ids)
                self.scheduler.add(req)

    def _finish_outside_step(self, req: Req, reason: dict, is_abort: bool = False) -> None:
        """End `req` between steps (aborted, an invalid grammar, nothing to generate); the next `step`
        returns its output."""
        counts = StepCounts(num_aborted_requests=int(is_abort))
        self.processor.finish(req, reason, counts)
        self.stats.add(counts)
        self._finished_outside_step.append(self.processor.output(req, [], ""))

    def _sampling_rows(self, rows: Sequence[tuple[Req, Sequence[int]]], bitmask: np.ndarray | None, num_seqs: int):
        """`sampling_rows.sampling_rows` for this model: one row per (request, draft tokens before it)."""
        return sampling_rows(rows, bitmask, num_seqs, self.runner.model_config.vocab_size, self.eos_token_ids)

    def _count_step(self, is_decode_only: bool, started: float) -> None:
        """Count a step that began at `started` (perf_counter seconds) before its tokens are appended."""
        self.stats.num_steps += 1
        self.stats.release_mode = self.cache.release_mode
        if is_decode_only:
            self.stats.num_decode_steps += 1
            if self.stats.num_decode_steps % self.config.decode_log_interval == 1 % self.config.decode_log_interval:
                # the gen throughput window opens at the interval's first step, as SGLang's: not at the last
                # log line, which left the idle time between them in the average
                self._throughput_mark = (started, self.stats.generation_tokens)
            if self.stats.num_decode_steps % self.config.decode_log_interval == 0:
                self._log_stats()

    def snapshot(self) -> EngineSnapshot:
        """Counters and gauges now. Safe to call from another thread (reads only)."""
        used = self.cache.used_tokens() - self.cache.tree.evictable_size()
        total = self.runner.pool_shape.num_tokens
        window = self.runner.window_layout
        s = dataclasses.replace(self.stats)
        spec = SpeculativeStats(s.num_spec_verifications, s.num_spec_draft_tokens, s.num_spec_accepted_tokens)
        return EngineSnapshot(
            counters=s,
            num_retracted_requests=self.scheduler.num_retractions,
            num_jit_compiles=self.runner.num_compiles_after_warmup,
            num_running_reqs=self.scheduler.num_running,
            num_queue_reqs=len(self.scheduler.waiting),
            num_grammar_queue_reqs=self.grammar_queue.num_pending,
            kv_used_tokens=max(0, used),
            kv_evictable_tokens=self.cache.tree.evictable_size(),
            kv_total_tokens=total,
            cache_hit_rate=s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            gen_throughput=self._gen_throughput,
            spec_accept_length=spec.accept_length,
            spec_accept_rate=spec.accept_rate,
            kv_swa_used_tokens=self.cache.window_used_tokens(),
            kv_swa_total_tokens=None if window is None else (window.num_window_pages - 1) * self.runner.pool_shape.page_size,
        )

    def _log_stats(self) -> None:
        now = time.perf_counter()
        t0, g0 = self._throughput_mark
        self._gen_throughput = (self.stats.generation_tokens - g0) / max(now - t0, 1e-9)
        self._throughput_mark = (now, self.stats.generation_tokens)
        snap = self.snapshot()
        logger.info(decode_line(snap))
        if self.speculator is not None:  # SGLang's decode log adds the same two numbers
            logger.info("Speculative decoding. accept len: %.2f, accept rate: %.2f", snap.spec_accept_length, snap.spec_accept_rate)
        if self.config.log_storage_stats and (radix := self.radix_cache_stats()) is not None:
            logger.info(storage_line(radix))

    def radix_cache_stats(self) -> RadixCacheStats | None:
        """The KV release policy's stats (None with the radix cache disabled). O(tree nodes)."""
        return self.cache.radix_cache_stats(self.scheduler.live_reqs())

    def _idle_checks(self) -> None:
        if self.config.enable_debug_checks and not self.scheduler.has_work():
            self.cache.check_integrity(self.scheduler.live_reqs())
            if self.scheduler.lora is not None:
                self.scheduler.lora.check_integrity((r.lora_id, r.lora_slot) for r in self.scheduler.live_reqs())

    # ---- convenience ----------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: dict | SamplingParams | Sequence[dict | SamplingParams] | None = None,
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        lora_path: str | Sequence[str | None] | None = None,
    ) -> dict | list[dict]:
        """Run prompts to completion (blocking). A single prompt gives one dict (a list when n > 1);
        a list of prompts gives a list with n dicts per prompt, in order. Each dict is /generate's output:
        `text`, `output_ids` and `meta_info` (`outputs.meta_info`, the builder /generate uses; logprobs as
        `[logprob, token_id, null]` triples). `lora_path`: a loaded LoRA adapter's name for every prompt,
        or one per prompt (None: the base model). Every prompt is checked before any is queued.

        Raises:
            SamplingParamsError, RequestError: as `add_request`, for the first bad prompt; nothing is queued then.
        """
        single = not isinstance(prompt, (list, tuple, np.ndarray)) or (len(prompt) > 0 and isinstance(prompt[0], (int, np.integer)))
        prompts = [prompt] if single else list(prompt)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError("sampling_params", "one sampling_params per prompt is required")
        loras = list(lora_path) if isinstance(lora_path, (list, tuple)) else [lora_path] * len(prompts)
        if len(loras) != len(prompts):
            raise RequestError("lora_path", "one lora_path per prompt is required")
        # every prompt is checked before any is queued: a bad one leaves nothing running
        checked = [self.checker.check(GenerateInput(p, sp, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                                                    lora_path=lo)) for p, sp, lo in zip(prompts, params, loras)]
        rids = [self.add_request(dataclasses.replace(c, request=dataclasses.replace(c.request, rid=new_rid())))
                for c in checked]
        keys = LogprobKeys.of(return_logprob, top_logprobs_num)
        results: dict[str, dict] = {}
        wanted = {r for group in rids for r in group}
        while wanted - results.keys():
            for out in self.step():
                if out.finished and out.rid in wanted:
                    results[out.rid] = {"text": out.text, "output_ids": out.output_ids, "meta_info": meta_info(out.meta, keys)}
        flat = [results[r] for group in rids for r in group]
        if single:
            return flat[0] if len(flat) == 1 else flat
        return flat


def enable_compilation_cache(cache_dir: str | None) -> None:
    """JAX's persistent compilation cache under `cache_dir` (None: ~/.cache/jaxserve/xla; "none": off)."""
    if cache_dir == "none":
        return
    path = cache_dir or str(cache_root() / "xla")
    jax.config.update("jax_compilation_cache_dir", path)
    # every executable: the host layer loop's programs compile in well under a second each, but there
    # are ~100 of them, and a restart should compile nothing
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
