"""ProgramState: the `s` of a program. It holds the text built so far, the variables set by `gen` and
`select`, the chat messages, and runs each `s += expr` on its own worker thread (worker.py).

Writes (`s += expr`) return at once; reads (`s[name]`, `s.text()`, `s.messages()`, `s.fork()`) wait
for the state's queued operations and raise the first error one of them hit. `s.fork(n)` copies the
state into n branches that share its text (so the server's radix cache shares their prefix) and
generate in parallel; reading a branch's variable joins it.

Every state of one `run` (the root and its forks) shares a `ProgramContext`: the backend, the default
sampling params, the streaming flag, and the condition that `text_iter` waits on.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

from jaxserve.lang.backend import Backend, get_default_backend
from jaxserve.lang.errors import ProgramError, UnknownVariableError
from jaxserve.lang.expr import Expr, ExprList, Gen, RoleBegin, RoleEnd, Select, Text, as_expr
from jaxserve.lang.worker import SerialWorker


class ProgramContext:
    """What the states of one program run share (see the module docstring)."""

    def __init__(self, backend: Backend | None, default_params: dict[str, Any] | None = None, stream: bool = False):
        self.backend = backend
        self.default_params = dict(default_params or {})
        self.stream = stream
        self.cond = threading.Condition()  # guards every state's stream events
        self.done = threading.Event()  # set when the program function has returned and its states drained
        self.done.set()
        self.program_thread: int | None = None
        self.error: BaseException | None = None
        self.states: list[ProgramState] = []

    def begin(self) -> None:
        self.done.clear()
        self.program_thread = threading.get_ident()

    def finish(self, error: BaseException | None = None) -> None:
        """Mark the program finished (with the error that ended it, if any) and wake `text_iter`."""
        with self.cond:
            if error is not None and self.error is None:
                self.error = error
            self.done.set()
            self.cond.notify_all()

    def drain(self) -> BaseException | None:
        """Wait for every state of the program to run its queued operations; the first error."""
        errors = [s._worker.wait() for s in list(self.states)]
        return next((e for e in errors if e is not None), None)


class ProgramState:
    """The state a program writes to (see the module docstring).

    Args:
        backend: the model server; None means the default backend (`set_default_backend`).
        default_params: sampling params every `gen` starts from (its own arguments override them).
        stream: stream generated text to `text_iter` as it is produced.
    """

    def __init__(
        self,
        backend: Backend | None = None,
        default_params: dict[str, Any] | None = None,
        stream: bool = False,
        *,
        context: ProgramContext | None = None,
    ):
        self._ctx = context or ProgramContext(backend or get_default_backend(), default_params, stream)
        self._ctx.states.append(self)
        self._worker = SerialWorker()
        self._text = ""
        self._variables: dict[str, Any] = {}
        self._meta_info: dict[str, Any] = {}
        self._messages: list[dict[str, str]] = []
        self._role: str | None = None
        self._role_start = 0
        self._events: list[tuple[str | None, str]] = []  # (variable or None, text added), for text_iter
        self._closed_vars: set[str] = set()

    # ---- writing --------------------------------------------------------------------------------
    def __iadd__(self, expr: Expr | str) -> "ProgramState":
        """Queue `expr` (text, gen, select, role, or a concatenation); returns at once."""
        expr = as_expr(expr)
        self._worker.submit(lambda: self._execute(expr))
        return self

    def fork(self, size: int = 1) -> "ForkGroup":
        """`size` copies of this state that continue independently (and in parallel).

        Before forking, the text so far is sent once through the model (SGLang's commit of lazy
        operations) so that the branches find it in the prefix cache instead of each computing it.

        Raises:
            ValueError: size < 1.
        """
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        self.sync()
        backend = self._ctx.backend
        if size > 1 and self._text and backend is not None and backend.caches_prefixes:
            backend.cache_prefix(self._text)
        return ForkGroup(self, [self._copy() for _ in range(size)])

    def _copy(self) -> "ProgramState":
        branch = ProgramState(context=self._ctx)
        branch._text = self._text
        branch._variables = dict(self._variables)
        branch._meta_info = dict(self._meta_info)
        branch._messages = [dict(m) for m in self._messages]
        branch._role, branch._role_start = self._role, self._role_start
        return branch

    # ---- reading (each waits for the queued operations) -----------------------------------------
    def sync(self) -> None:
        """Wait until every queued operation has run. Raises the first error one of them hit (or,
        read from another thread during a streamed run, the error that ended the program)."""
        ctx = self._ctx
        if ctx.program_thread is not None and ctx.program_thread != threading.get_ident():
            ctx.done.wait()
        error = self._worker.wait() or (ctx.error if ctx.done.is_set() else None)
        if error is not None:
            raise error

    def text(self) -> str:
        """The whole text built so far (chat markup included)."""
        self.sync()
        return self._text

    def __getitem__(self, name: str) -> Any:
        """The value of a variable set by `gen`/`select` (a str).

        Raises:
            UnknownVariableError (a KeyError): no such variable; the message lists the known ones.
        """
        self.sync()
        if name not in self._variables:
            raise UnknownVariableError(name, self._variables)
        return self._variables[name]

    def get_var(self, name: str) -> Any:
        return self[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._variables

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._variables)

    def get_meta_info(self, name: str) -> Any:
        """For a `gen`: the server's meta_info dict (prompt_tokens, cached_tokens, finish_reason, ...);
        for a `select`: its `ChoiceScores`. Raises UnknownVariableError."""
        self.sync()
        if name not in self._meta_info:
            raise UnknownVariableError(name, self._meta_info)
        return self._meta_info[name]

    def messages(self) -> list[dict[str, str]]:
        """The finished chat messages, [{"role": ..., "content": ...}], content without the markup."""
        self.sync()
        return [dict(m) for m in self._messages]

    def error(self) -> BaseException | None:
        """The error that stopped this state's operations, or None (does not raise)."""
        self._worker.wait()
        return self._worker.error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yield the text as it is produced: all of it, or only what generates `var_name`.

        With `run(stream=True)` the pieces arrive while the program runs and the iterator ends when
        the program does (or, for a variable, when its generation finishes). Without streaming it
        yields the final text (or the variable's value) once. Raises the program's error at the end.
        """
        if not self._ctx.stream:
            yield self.text() if var_name is None else self[var_name]
            return
        cond, i = self._ctx.cond, 0
        while True:
            with cond:
                while i == len(self._events) and not self._is_stream_done(var_name):
                    cond.wait()
                new, i = self._events[i:], len(self._events)
                done = self._is_stream_done(var_name)
            for var, piece in new:
                if piece and (var_name is None or var == var_name):
                    yield piece
            if done:
                break
        if self._ctx.done.is_set():
            self.sync()

    def _is_stream_done(self, var_name: str | None) -> bool:
        return self._ctx.done.is_set() or (var_name is not None and var_name in self._closed_vars)

    def __repr__(self) -> str:
        return f"ProgramState(text={self._text[-60:]!r}, variables={sorted(self._variables)})"

    # ---- the interpreter (on the worker thread) -------------------------------------------------
    def _execute(self, expr: Expr) -> None:
        match expr:
            case ExprList(items):
                for item in items:
                    self._execute(item)
            case Text(value):
                self._append(value)
            case Gen():
                self._gen(expr)
            case Select():
                self._select(expr)
            case RoleBegin(role):
                self._role_begin(role)
            case RoleEnd(role):
                self._role_end(role)
            case _:
                raise TypeError(f"unknown expression {expr!r}")

    def _backend(self) -> Backend:
        if self._ctx.backend is None:
            raise ProgramError("no backend: pass run(backend=...) or call set_default_backend(...)")
        return self._ctx.backend

    def _append(self, piece: str, var: str | None = None) -> None:
        with self._ctx.cond:
            self._text += piece
            self._events.append((var, piece))
            self._ctx.cond.notify_all()

    def _set_var(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        with self._ctx.cond:
            self._variables[name] = value
            self._meta_info[name] = meta
            self._closed_vars.add(name)
            self._ctx.cond.notify_all()

    def _gen(self, g: Gen) -> None:
        backend = self._backend()
        params = {**self._ctx.default_params, **g.params}
        start = len(self._text)
        if not self._ctx.stream:
            result = backend.generate(self._text, params)
            self._append(result.text, g.name)
        else:
            result = None
            for chunk in backend.generate_stream(self._text, params):
                if chunk.text_delta:
                    self._append(chunk.text_delta, g.name)
                result = chunk.result or result
            assert result is not None, "a stream ends with a chunk that carries the result"
            if self._text[start:] != result.text:  # the final text is authoritative (stop trimming)
                with self._ctx.cond:
                    self._text = self._text[:start] + result.text
        self._set_var(g.name, result.text, result.meta_info)

    def _select(self, sel: Select) -> None:
        scores = self._backend().select(self._text, sel.choices)
        self._append(scores.decision, sel.name)
        self._set_var(sel.name, scores.decision, scores)

    def _role_begin(self, role: str) -> None:
        if self._role is not None:
            raise ProgramError(f"{role}_begin() while a {self._role} message is open; close it with {self._role}_end()")
        is_first = not self._messages and not self._text
        self._append(self._backend().chat_template.begin(role, is_first))
        self._role, self._role_start = role, len(self._text)

    def _role_end(self, role: str) -> None:
        if self._role != role:
            opened = f"the open message is {self._role}" if self._role else "no message is open"
            raise ProgramError(f"{role}_end() but {opened}")
        self._messages.append({"role": role, "content": self._text[self._role_start:]})
        self._role = None
        self._append(self._backend().chat_template.end(role))


class ForkGroup(list):
    """The branches of `s.fork(n)` (a list of ProgramState) and `join()`."""

    def __init__(self, parent: ProgramState, branches: list[ProgramState]):
        super().__init__(branches)
        self.parent = parent
        self._parent_vars = set(parent._variables)

    def join(self) -> "ForkGroup":
        """Wait for every branch; each variable the branches set after the fork becomes, in the
        parent, the list of its values (SGLang's `join(mode="gather_variable")`). Raises the first
        branch error."""
        for branch in self:
            branch.sync()
        names = [n for n in self[0]._variables if n not in self._parent_vars] if self else []
        gathered = {n: [b._variables.get(n) for b in self] for n in names}

        def put() -> None:
            self.parent._variables.update(gathered)

        self.parent._worker.submit(put)
        return self
