"""Roles build the text the model's own chat template renders for the same messages."""

from __future__ import annotations

import pytest

from jaxserve.lang import (
    ChatTemplate,
    ChatTemplateError,
    ProgramError,
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    system,
    user,
    user_end,
)
from tests.lang.fakes import FakeBackend


@function
def chat(s, with_system):
    if with_system:
        s += system("You are terse.")
    s += user("What is 2 + 2?")
    s += assistant(gen("a1"))
    s += user("And 3 + 3?")
    s += assistant_begin()
    s += gen("a2")
    s += assistant_end()


@pytest.mark.parametrize("with_system", [True, False], ids=["system", "default-system"])
def test_roles_match_apply_chat_template(default_tokenizer, with_system):
    backend = FakeBackend(default_tokenizer, reply=lambda prompt, params: "It is 4." if "2 + 2" in prompt[-40:] else "6.")
    state = chat.run(with_system, backend=backend)
    messages = state.messages()
    assert [m["role"] for m in messages] == (["system"] if with_system else []) + ["user", "assistant", "user", "assistant"]
    assert messages[-3]["content"] == "It is 4." and state["a2"] == "6."
    assert state.text() == default_tokenizer.apply_chat_template(messages, tokenize=False)
    # the assistant gen saw exactly the template's generation prompt
    prompt = backend.calls[0][1][0]
    assert prompt == default_tokenizer.apply_chat_template(messages[:-3], tokenize=False, add_generation_prompt=True)


def test_smollm2_template_roles(default_tokenizer):
    tpl = ChatTemplate.from_tokenizer(default_tokenizer)
    assert tpl.begin("user", is_first=False) == "<|im_start|>user\n"
    assert tpl.end("assistant") == "<|im_end|>\n"
    assert "You are a helpful AI assistant named SmolLM" in tpl.begin("user", is_first=True)
    assert tpl.begin("system", is_first=True) == "<|im_start|>system\n"
    assert ChatTemplate.from_jinja(default_tokenizer.chat_template) == tpl


def test_override_template_is_used(default_tokenizer):
    backend = FakeBackend(default_tokenizer, reply=lambda p, q: "ok", chat_template=ChatTemplate.chatml())

    @function
    def one(s):
        s += user("hi")
        s += assistant(gen("a"))

    assert one.run(backend=backend).text() == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"


def test_template_without_a_role_raises_naming_it():
    tpl = ChatTemplate({"user": "U:", "assistant": "A:"}, {"user": "\n", "assistant": "\n"})
    with pytest.raises(ChatTemplateError, match="'system'"):
        tpl.begin("system", is_first=True)
    raising = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}" \
              "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    derived = ChatTemplate.from_jinja(raising)
    assert "system" not in derived.prefixes and derived.begin("user", is_first=False) == "[user]"


def test_mismatched_role_end_raises():
    backend = FakeBackend(chat_template=ChatTemplate.chatml())

    @function
    def bad(s):
        s += user_end()

    with pytest.raises(ProgramError, match="no message is open"):
        bad.run(backend=backend)
