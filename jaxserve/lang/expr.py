"""The expressions of a program: what `s += ...` accepts, and the functions that build them.

    s += "Q: What is 2 + 2?\\nA:"                       Text
    s += gen("answer", max_tokens=16, stop="\\n")       Gen
    s += select("tool", choices=["search", "calc"])    Select (scored by log-probabilities)
    s += user("Hi") ; s += assistant(gen("reply"))      RoleBegin, ..., RoleEnd
    s += "Q: " + gen("a") + "\\n"                        ExprList (`+` concatenates)

Names and semantics follow SGLang's frontend language (python/sglang/lang/api.py and ir.py): `gen`
with `choices` is a `select`; `gen_int` / `gen_string` constrain the output with SGLang's regexes.
A variable holds the generated text (a `str`, also for `gen_int`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

# SGLang's regexes for typed generation (python/sglang/lang/ir.py).
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

ROLES = ("system", "user", "assistant")


class Expr:
    """Base of every expression; `a + b` concatenates (strings become `Text`)."""

    def __add__(self, other: "Expr | str") -> "ExprList":
        return concat(self, other)

    def __radd__(self, other: "Expr | str") -> "ExprList":
        return concat(other, self)


@dataclasses.dataclass(frozen=True, eq=False)
class Text(Expr):
    value: str


@dataclasses.dataclass(frozen=True, eq=False)
class Gen(Expr):
    """Generate text into variable `name`. `params` holds SGLang sampling params (only those given)."""

    name: str | None
    params: dict[str, Any]


@dataclasses.dataclass(frozen=True, eq=False)
class Select(Expr):
    """Append the choice with the highest length-normalised log-probability (see choices.py)."""

    name: str | None
    choices: tuple[str, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class RoleBegin(Expr):
    role: str


@dataclasses.dataclass(frozen=True, eq=False)
class RoleEnd(Expr):
    role: str


@dataclasses.dataclass(frozen=True, eq=False)
class ExprList(Expr):
    items: tuple[Expr, ...]


def as_expr(value: Expr | str) -> Expr:
    """A string as `Text`; an expression unchanged.

    Raises:
        TypeError: anything else (a number, a state, ...).
    """
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"cannot add a {type(value).__name__} to a program state; add a str or gen()/select()/role expression")


def concat(a: Expr | str, b: Expr | str) -> ExprList:
    items: list[Expr] = []
    for part in (as_expr(a), as_expr(b)):
        items.extend(part.items if isinstance(part, ExprList) else (part,))
    return ExprList(tuple(items))


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    choices: Sequence[str] | None = None,
    dtype: type | str | None = None,
    lora_path: str | None = None,
) -> Gen | Select:
    """Generate into variable `name` (None: append without storing). Unset parameters take the
    program's defaults (`run(temperature=...)`), then the server's (SGLang: 128 tokens, temperature 1).

    `json_schema` is a JSON Schema (a string, or a dict that is serialised); `regex` a regular
    expression; `choices` turns the call into `select(name, choices)`; `dtype` int / float / str /
    bool constrains with SGLang's regex for that type (int and float also stop at a space or newline).
    `lora_path`: generate under this loaded LoRA adapter (the server's --lora-paths or
    /load_lora_adapter name; `run(lora_path=...)` sets it for every `gen` of a program).

    Raises:
        ValueError: two constraints at once, an unknown dtype, or an empty `choices`.
    """
    if choices is not None:
        return select(name, choices)
    if json_schema is not None and not isinstance(json_schema, str):
        json_schema = json.dumps(json_schema)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if dtype is not None:
        if regex is not None or json_schema is not None:
            raise ValueError("gen: give at most one of dtype, regex and json_schema")
        regex, extra_stops = _dtype_regex(dtype)
        stops += [s for s in extra_stops if s not in stops]
    if regex is not None and json_schema is not None:
        raise ValueError("gen: give at most one of regex and json_schema")
    given = {
        "max_new_tokens": max_tokens,
        "stop": stops or None,
        "stop_token_ids": list(stop_token_ids) if stop_token_ids is not None else None,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "ignore_eos": ignore_eos,
        "regex": regex,
        "json_schema": json_schema,
        "lora_path": lora_path,
    }
    return Gen(name, {k: v for k, v in given.items() if v is not None})


def _dtype_regex(dtype: type | str) -> tuple[str, tuple[str, ...]]:
    table = {
        "int": (REGEX_INT, (" ", "\n")),
        "float": (REGEX_FLOAT, (" ", "\n")),
        "str": (REGEX_STR, ()),
        "bool": (REGEX_BOOL, ()),
    }
    key = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", str(dtype))
    if key not in table:
        raise ValueError(f"gen: unknown dtype {dtype!r}; use one of int, float, str, bool")
    return table[key]


def gen_int(name: str | None = None, **kwargs: Any) -> Gen:
    """`gen(name, dtype=int, ...)`: an integer (SGLang's REGEX_INT), the text kept as a str."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Gen:
    """`gen(name, dtype=str, ...)`: a double-quoted string of word characters and spaces."""
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: Sequence[str] | None = None) -> Select:
    """Append the choice the model finds most likely after the current text (greedy, scored by the
    mean log-probability of each choice's tokens: SGLang's `token_length_normalized`).

    Raises:
        ValueError: `choices` is empty or holds something other than non-empty strings.
    """
    if isinstance(choices, str):
        raise ValueError(f"select({name!r}): choices must be a list of strings, got the string {choices!r}")
    values = tuple(choices or ())
    if not values:
        raise ValueError(f"select({name!r}): the choice list is empty; give at least one choice")
    bad = [c for c in values if not isinstance(c, str) or not c]
    if bad:
        raise ValueError(f"select({name!r}): every choice must be a non-empty string, got {bad[0]!r}")
    return Select(name, values)


def _role(role: str, expr: Expr | str | None) -> ExprList:
    inner = () if expr is None else (as_expr(expr),)
    return ExprList((RoleBegin(role), *inner, RoleEnd(role)))


def system(expr: Expr | str | None = None) -> ExprList:
    """A system message around `expr`, in the model's chat template."""
    return _role("system", expr)


def user(expr: Expr | str | None = None) -> ExprList:
    """A user message around `expr`, in the model's chat template."""
    return _role("user", expr)


def assistant(expr: Expr | str | None = None) -> ExprList:
    """An assistant message around `expr` (typically a `gen`), in the model's chat template."""
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
