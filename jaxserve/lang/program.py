"""`@function` programs and how they run: `run`, `run(stream=True)`, `run_batch`.

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    state = qa.run(question="Why is the sky blue?", temperature=0)
    states = qa.run_batch([{"question": q} for q in questions], num_threads=16)

A program is a Python function whose first argument is the state. `run` calls it in the caller's
thread (stream=True: in a background thread, returning the state at once for `text_iter`), then waits
for every state it created (the root and its forks) and raises the first error.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import threading
from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from jaxserve.lang.backend import Backend, get_default_backend
from jaxserve.lang.state import ProgramContext, ProgramState

# Sampling params `run` / `run_batch` accept as defaults for every gen of the program (SGLang's names).
SAMPLING_DEFAULTS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "frequency_penalty", "presence_penalty", "ignore_eos",
    "lora_path",  # a request field, not a sampling param: the LoRA adapter of every `gen`
)
MAX_AUTO_THREADS = 64


class Program:
    """A function over a state, made runnable by `@function` (see the module docstring)."""

    def __init__(self, func: Callable[..., Any]):
        functools.update_wrapper(self, func)
        self.func = func
        self.signature = inspect.signature(func)
        if not self.signature.parameters:
            raise TypeError(f"@function {func.__name__}: a program takes the state as its first argument")

    def run(self, *args: Any, backend: Backend | None = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Run the program once; returns its state.

        Keyword arguments named in SAMPLING_DEFAULTS (max_new_tokens, temperature, stop, ...) are the
        default sampling params of every `gen`; the others are the program's arguments.

        Raises:
            TypeError: arguments that do not fit the function's signature.
            BackendError, UnknownVariableError, ...: the first error of the program (with
                stream=True, raised by `text_iter`, `text()` or `s[name]` instead).
        """
        sampling = {k: kwargs.pop(k) for k in SAMPLING_DEFAULTS if k in kwargs and k not in self._arg_names()}
        defaults = _sampling_defaults(sampling)
        ctx = ProgramContext(backend or get_default_backend(), defaults, stream)
        state = ProgramState(context=ctx)
        bound = self.signature.bind(state, *args, **kwargs)
        if stream:
            threading.Thread(target=self._execute, args=(ctx, bound, False), name=f"program-{self.__name__}", daemon=True).start()
        else:
            self._execute(ctx, bound, True)
        return state

    __call__ = run

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = True,
        **sampling: Any,
    ) -> list[ProgramState]:
        """Run the program once per element (a dict of keyword arguments, or a list of positional
        ones) on `num_threads` threads ("auto": one per program, at most 64), with a tqdm progress
        bar. Returns the states in input order.

        Raises:
            TypeError: an unknown sampling default.
            the first error of a program, in input order, after all have finished.
        """
        unknown = sorted(set(sampling) - set(SAMPLING_DEFAULTS))
        if unknown:
            raise TypeError(f"run_batch got unknown sampling defaults {unknown}; known: {', '.join(SAMPLING_DEFAULTS)}")
        items = list(batch_kwargs)
        if not items:
            return []
        workers = min(len(items), MAX_AUTO_THREADS) if num_threads == "auto" else int(num_threads)
        backend = backend or get_default_backend()

        def run_one(item: dict[str, Any] | Sequence[Any]) -> ProgramState:
            if isinstance(item, dict):
                return self.run(backend=backend, **sampling, **item)
            return self.run(*item, backend=backend, **sampling)

        with concurrent.futures.ThreadPoolExecutor(max(workers, 1), thread_name_prefix=f"batch-{self.__name__}") as pool:
            futures = [pool.submit(run_one, item) for item in items]
            with tqdm(total=len(futures), desc=self.__name__, disable=not progress_bar) as bar:
                for _ in concurrent.futures.as_completed(futures):
                    bar.update(1)
        return [f.result() for f in futures]

    def _arg_names(self) -> set[str]:
        return set(list(self.signature.parameters)[1:])

    def _execute(self, ctx: ProgramContext, bound: inspect.BoundArguments, reraise: bool) -> None:
        ctx.begin()
        error = None
        try:
            self.func(*bound.args, **bound.kwargs)
            error = ctx.drain()
        except BaseException as e:  # noqa: BLE001 - stored for the readers of a streamed run
            error = e
            ctx.drain()
        finally:
            ctx.finish(error)
        if error is not None and reraise:
            raise error


def function(func: Callable[..., Any] | None = None) -> Program | Callable[[Callable[..., Any]], Program]:
    """Decorator that turns `def f(s, ...)` into a Program (`@function` or `@function()`)."""
    if func is None:
        return Program
    return Program(func)


def _sampling_defaults(given: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in given.items() if v is not None}
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    return out
