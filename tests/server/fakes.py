"""A model-free stand-in for `Engine`, for testing the engine loop and the app without JAX work."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from jaxserve.core.request import finish_abort, finish_length
from jaxserve.engine.memory_usage import ArrayBytes, MemoryUsage
from jaxserve.engine.outputs import EngineStats, RequestMeta, StepOutput
from jaxserve.engine.validation.check import CheckedInput, RequestChecker
from jaxserve.engine.validation.limits import ModelLimits
from jaxserve.server_args import ServerArgs


class FakeTokenizer:
    """One token per character (ids 1..50), a vocabulary of one-character entries."""

    eos_token_id = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 50 + 1 for c in text]

    def get_vocab(self):  # one long entry: the checks' bound on characters per token never refuses a prompt
        return {chr(i): i for i in range(63)} | {"x" * 4096: 63}


class FakeEngine:
    """One token (id 7, text "x") per running request per step; `fail_next_step` makes a step raise."""

    def __init__(self, step_time: float = 0.005):
        self.step_time = step_time
        self.reqs: dict[str, dict] = {}
        self.finished: list[StepOutput] = []
        self.num_steps = 0
        self.fail_next_step = False
        self.stats = EngineStats()
        self.scheduler = SimpleNamespace(
            num_running=0, waiting=[], chunked_req=None, config=SimpleNamespace(max_running_requests=64))
        self.cache = SimpleNamespace(used_tokens=lambda: 16 * len(self.reqs),
                                     tree=SimpleNamespace(total_size=lambda: 0, protected_size=lambda: 0))
        self.thread_ids: set[int] = set()
        self.tokenizer = FakeTokenizer()
        self.limits = ModelLimits(vocab_size=64, context_length=64, pool_tokens=1024)
        self.checker = RequestChecker(self.tokenizer, self.limits)  # the real checks, over a fake tokenizer
        self.runner = SimpleNamespace(model_path="/models/fake-model")
        self.devices = ["cpu:0"]
        self.args = ServerArgs(model_path="/models/fake-model")

    def close(self) -> None:
        """Engine.close: nothing to flush (no storage tier)."""

    def memory_usage(self) -> MemoryUsage:
        return MemoryUsage(ArrayBytes(0, 0, 0, 0, 1), None)

    def loaded_lora_adapters(self):
        return {}

    def add_request(self, checked: CheckedInput):
        self.thread_ids.add(threading.get_ident())
        rid, params = checked.request.rid, checked.params
        rids = [rid] if params.n == 1 else [f"{rid}-{i}" for i in range(params.n)]
        for r in rids:
            self.reqs[r] = {"prompt": len(checked.input_ids), "out": [], "max": params.max_new_tokens,
                            "think_end_ids": tuple(checked.request.think_end_ids)}
        return rids

    def _output(self, rid, new, finished, reason=None):
        req = self.reqs[rid]
        meta = RequestMeta(rid, req["prompt"], len(req["out"]), 0, reason, 0.0)
        if finished:
            del self.reqs[rid]
        return StepOutput(rid, new, list(req["out"]), "x" * len(req["out"]), "x" if new else "", finished, meta)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        time.sleep(self.step_time)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outs, self.finished = self.finished, []
        for rid in list(self.reqs):
            req = self.reqs[rid]
            req["out"].append(7)
            done = len(req["out"]) >= req["max"]
            outs.append(self._output(rid, [7], done, finish_length(req["max"]) if done else None))
        self.scheduler.num_running = len(self.reqs)
        return outs

    def abort(self, rid):
        if rid not in self.reqs:
            return False
        self.finished.append(self._output(rid, [], True, finish_abort("aborted by the client")))
        return True

    def snapshot(self):  # Engine's counters and gauges: the fake has none (/metrics leaves them out)
        return None

    def radix_cache_stats(self):
        return None

    def has_unfinished(self):
        return bool(self.reqs or self.finished)

    step_in_flight = False  # Engine's overlap schedule: the fake reads every step's tokens in the step

    def flush_cache(self):
        if self.reqs:
            raise RuntimeError(f"cannot flush the cache while {len(self.reqs)} requests are running or waiting")
