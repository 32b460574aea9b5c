"""ChatTemplate: the text a role adds before and after a message, derived from the model's own
(Jinja) chat template so that `system()/user()/assistant()` build exactly what
`tokenizer.apply_chat_template(state.messages())` would.

A program's text only grows (that is what lets the radix cache reuse it), so a template is reduced to
per-role prefixes and suffixes. They are found by rendering conversations with a sentinel content and
cutting around it:

    prefix, suffix of role r = render(ctx + [r: SENTINEL]) minus render(ctx), split at SENTINEL

with ctx a short valid conversation before r (a system message before a user one, a user message
before an assistant one). The first message of a conversation gets its own prefix, rendered with no
context: it carries what a template puts at the start (a BOS token, or SmolLM2's default system
prompt when the conversation does not open with a system message).

Templates that do not reduce to prefixes and suffixes (Llama 2 folds the system prompt into the first
user turn) raise ChatTemplateError; pass `chat_template=ChatTemplate(...)` to the backend instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from jaxserve.lang.errors import ChatTemplateError

SENTINEL = "JAXSERVELANGCONTENT"
Messages = list[dict[str, str]]
Renderer = Callable[[Messages], str]

# Conversations tried, in order, before a message of each role (the first that renders wins).
_CONTEXTS: dict[str, tuple[Messages, ...]] = {
    "system": ([{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}], []),
    "user": ([{"role": "system", "content": "A"}], [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]),
    "assistant": ([{"role": "system", "content": "A"}, {"role": "user", "content": "B"}], [{"role": "user", "content": "B"}]),
}


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """Per-role text around a message's content.

    Attributes:
        prefixes: role -> text before the content of a message that follows another message.
        suffixes: role -> text after the content.
        first_prefixes: role -> text before the content when the message opens the conversation
            (defaults to `prefixes`).
    """

    prefixes: Mapping[str, str]
    suffixes: Mapping[str, str]
    first_prefixes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def begin(self, role: str, is_first: bool) -> str:
        """Text that opens a `role` message. Raises ChatTemplateError for a role the template lacks."""
        self._check(role)
        if is_first and role in self.first_prefixes:
            return self.first_prefixes[role]
        return self.prefixes[role]

    def end(self, role: str) -> str:
        """Text that closes a `role` message."""
        self._check(role)
        return self.suffixes[role]

    def _check(self, role: str) -> None:
        if role not in self.prefixes:
            raise ChatTemplateError(
                f"the chat template has no {role!r} role (it has {', '.join(sorted(self.prefixes)) or 'none'})"
            )

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def chatml(cls) -> "ChatTemplate":
        """ChatML (`<|im_start|>role\\n...<|im_end|>\\n`) with no default system prompt."""
        roles = ("system", "user", "assistant")
        return cls({r: f"<|im_start|>{r}\n" for r in roles}, {r: "<|im_end|>\n" for r in roles})

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "ChatTemplate":
        """Derive from a transformers tokenizer's `chat_template` (see the module docstring).

        Raises:
            ChatTemplateError: the tokenizer has no chat template, or it does not reduce to prefixes
                and suffixes.
        """
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("the tokenizer has no chat template; pass chat_template= to the backend")

        def render(messages: Messages) -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

        return cls.from_renderer(render)

    @classmethod
    def from_jinja(cls, template: str, bos_token: str = "", eos_token: str = "") -> "ChatTemplate":
        """Derive from a Jinja chat template string (rendered like transformers does: trim_blocks,
        lstrip_blocks, `raise_exception`), without a tokenizer."""
        import jinja2.sandbox

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        compiled = env.from_string(template)

        def render(messages: Messages) -> str:
            return compiled.render(messages=messages, add_generation_prompt=False, bos_token=bos_token, eos_token=eos_token)

        return cls.from_renderer(render)

    @classmethod
    def from_renderer(cls, render: Renderer, roles: Sequence[str] = ("system", "user", "assistant")) -> "ChatTemplate":
        """Derive from any function that renders a list of messages (see the module docstring).

        Raises:
            ChatTemplateError: no role could be derived.
        """
        prefixes, suffixes, first_prefixes = {}, {}, {}
        for role in roles:
            split = next((s for ctx in _CONTEXTS.get(role, ([],)) if (s := _split(render, ctx, role))), None)
            if split is None:
                continue
            prefixes[role], suffixes[role] = split
            first = _split(render, [], role)
            if first is not None:
                first_prefixes[role] = first[0]
        if not prefixes:
            raise ChatTemplateError(
                "could not derive role prefixes from the chat template; pass chat_template=ChatTemplate(...)"
            )
        return cls(prefixes, suffixes, first_prefixes)


def _split(render: Renderer, ctx: Messages, role: str) -> tuple[str, str] | None:
    """(prefix, suffix) of a `role` message rendered after `ctx`, or None when the template refuses
    the conversation or does not render the content verbatim after what ctx rendered."""
    try:
        base = render(ctx) if ctx else ""
        full = render([*ctx, {"role": role, "content": SENTINEL}])
    except Exception:  # templates raise for role orders they do not support
        return None
    if not full.startswith(base) or full.count(SENTINEL) != 1:
        return None
    head, tail = full[len(base):].split(SENTINEL)
    return head, tail
