"""EngineBackend: run programs on an in-process `Engine`.

    engine = Engine(model_path="default")
    with EngineBackend(engine) as backend:
        state = program.run(backend=backend)

The Engine is single-threaded; programs call the backend from many threads (forks, run_batch). So the
backend drives the engine through an `EngineLoop` (one background thread that owns the engine; other
threads submit requests and get outputs through callbacks). While the backend is open, use the engine
only through `backend.loop` (`backend.loop.call(lambda engine: ...)`), never directly.
"""

from __future__ import annotations

import queue
from typing import Any, Iterator, Sequence

from jaxserve.core.errors import RequestError, SamplingParamsError
from jaxserve.engine.engine import Engine
from jaxserve.engine.engine_loop import EngineLoop
from jaxserve.engine.outputs import LogprobKeys, StepOutput, meta_info
from jaxserve.engine.request_input import GenerateInput
from jaxserve.lang.backend import SCORING_MAX_NEW_TOKENS, Backend, GenChunk, GenResult, split_request_fields
from jaxserve.lang.chat_template import ChatTemplate
from jaxserve.lang.errors import BackendError


class EngineBackend(Backend):
    """A backend over an in-process engine (see the module docstring).

    Args:
        engine: an `Engine` (the backend starts an `EngineLoop` over it and stops it on `shutdown`),
            or a running `EngineLoop` to share (the backend leaves it running).
        chat_template: overrides the template derived from `engine.tokenizer`.
    """

    def __init__(self, engine: Engine | EngineLoop, chat_template: ChatTemplate | None = None):
        super().__init__(chat_template)
        if isinstance(engine, EngineLoop):
            self.loop, self._owns_loop = engine, False
        else:
            self.loop, self._owns_loop = EngineLoop(engine).start(), True

    @property
    def tokenizer(self) -> Any:
        return self.loop.engine.tokenizer

    @property
    def caches_prefixes(self) -> bool:
        return not self.loop.engine.args.disable_radix_cache

    def generate(self, prompt: str, params: dict[str, Any]) -> GenResult:
        outputs = self._submit(prompt, params)
        while True:
            out = outputs.get()
            if out.finished:
                return _result(out)

    def generate_stream(self, prompt: str, params: dict[str, Any]) -> Iterator[GenChunk]:
        outputs = self._submit(prompt, params)
        while True:
            out = outputs.get()
            if out.finished:
                result = _result(out)
                yield GenChunk(out.text_delta, result)
                return
            if out.text_delta:
                yield GenChunk(out.text_delta)

    def prompt_logprobs(self, input_ids: list[list[int]], logprob_start_len: int) -> list[list[float | None]]:
        params = {"max_new_tokens": SCORING_MAX_NEW_TOKENS, "temperature": 0}
        # Submitted back to back, so the loop schedules them together; the scheduler staggers
        # prompts that share an uncached prefix so that the prefix is computed once.
        pending = [self._submit(ids, params, return_logprob=True, logprob_start_len=logprob_start_len) for ids in input_ids]
        logprobs = []
        for outputs in pending:
            while not (out := outputs.get()).finished:
                pass
            result = _result(out, LogprobKeys.of(True, 0))
            entries = result.meta_info.get("input_token_logprobs") or []
            logprobs.append([lp for lp, *_ in entries])  # [logprob, token_id, text] triples
        return logprobs

    def cache_prefix(self, prompt: str) -> None:
        self.generate(prompt, {"max_new_tokens": SCORING_MAX_NEW_TOKENS, "temperature": 0})

    def _submit(self, prompt: str | Sequence[int], params: dict[str, Any], **fields: Any) -> "queue.SimpleQueue[StepOutput]":
        params, request_fields = split_request_fields(params)
        fields = {**request_fields, **fields}
        outputs: queue.SimpleQueue[StepOutput] = queue.SimpleQueue()
        try:
            self.loop.submit(GenerateInput(prompt, params, **fields), on_output=outputs.put)
        except (SamplingParamsError, RequestError) as e:
            raise BackendError(400, str(e), param=e.field) from e
        except RuntimeError as e:  # the loop is shut down
            raise BackendError(503, str(e)) from e
        return outputs

    def shutdown(self) -> None:
        """Stop the engine loop this backend started (the engine can then be used directly again)."""
        if self._owns_loop:
            self.loop.shutdown()

    def __enter__(self) -> "EngineBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _result(out: StepOutput, logprobs: LogprobKeys | None = None) -> GenResult:
    """The finished output as a GenResult, its meta_info as /generate's (`logprobs`: which logprob keys it
    has); an aborted request raises BackendError."""
    reason = out.meta.finish_reason
    if reason is not None and reason.kind == "abort":
        raise BackendError(reason.status_code or 500, reason.message if reason.message is not None else "the request was aborted")
    return GenResult(out.text, list(out.output_ids), meta_info(out.meta, logprobs))
