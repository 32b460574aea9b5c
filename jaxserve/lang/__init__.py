"""The frontend language: SGLang-style programs over a state.

    from jaxserve.lang import function, gen, select, user, assistant, RuntimeEndpoint, set_default_backend

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    set_default_backend(RuntimeEndpoint("http://127.0.0.1:30000"))   # or EngineBackend(Engine(...))
    print(qa.run(question="Why is the sky blue?")["answer"])

Files: expr.py (what `s += ...` accepts), state.py (the state and its interpreter), worker.py (the
per-state thread), program.py (`@function`, run, run_batch), backend.py (the backend interface),
engine_backend.py / runtime_endpoint.py (in-process / HTTP), choices.py (select scoring),
chat_template.py (roles), errors.py.

`EngineBackend` imports the engine (and JAX) only when used, so an HTTP client stays light.
"""

from jaxserve.lang.backend import Backend, GenChunk, GenResult, get_default_backend, set_default_backend
from jaxserve.lang.chat_template import ChatTemplate
from jaxserve.lang.choices import ChoiceScores
from jaxserve.lang.errors import BackendError, ChatTemplateError, ProgramError, UnknownVariableError
from jaxserve.lang.expr import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from jaxserve.lang.program import Program, function
from jaxserve.lang.runtime_endpoint import RuntimeEndpoint
from jaxserve.lang.state import ForkGroup, ProgramState

__all__ = [
    "Backend", "BackendError", "ChatTemplate", "ChatTemplateError", "ChoiceScores", "EngineBackend", "ForkGroup",
    "GenChunk", "GenResult", "Program", "ProgramError", "ProgramState", "RuntimeEndpoint", "UnknownVariableError",
    "assistant", "assistant_begin", "assistant_end", "function", "gen", "gen_int", "gen_string",
    "get_default_backend", "select", "set_default_backend", "system", "system_begin", "system_end", "user",
    "user_begin", "user_end",
]


def __getattr__(name: str):
    if name == "EngineBackend":
        from jaxserve.lang.engine_backend import EngineBackend

        return EngineBackend
    raise AttributeError(f"module 'jaxserve.lang' has no attribute {name!r}")
