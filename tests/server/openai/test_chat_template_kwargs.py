"""`chat_template_kwargs` (SGLang's and vLLM's chat field) become variables of the chat template; a
request with them was answered as if they were not there."""

from __future__ import annotations

import copy

import pytest

from jaxserve.server.errors import APIError
from jaxserve.server.openai.chat_prompt import chat_prompt
from jaxserve.server.openai.tools import get_parser
from jaxserve.server.protocol import ChatCompletionRequest

# Qwen3's switch, in a template written for the test: the expected prompts are spelled out below
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    tok = copy.copy(default_tokenizer)  # the session's tokenizer keeps its own template
    tok.chat_template = TEMPLATE
    return tok


def _prompt(tokenizer, **fields) -> str:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **fields})
    return chat_prompt(tokenizer, req, get_parser("qwen25"), None)


def test_template_variables_reach_the_template(tokenizer):
    assert _prompt(tokenizer) == "<user>Hi<assistant>"
    assert _prompt(tokenizer, chat_template_kwargs={"enable_thinking": False}) == "<user>Hi<assistant><think></think>"
    assert _prompt(tokenizer, chat_template_kwargs={"enable_thinking": True, "unused": 1}) == "<user>Hi<assistant>"


@pytest.mark.parametrize("key", ["add_generation_prompt", "tools", "tokenize", "messages"])
def test_request_fields_cannot_be_set_as_template_variables(tokenizer, key):
    with pytest.raises(APIError, match=f"'{key}' cannot be set") as info:
        _prompt(tokenizer, chat_template_kwargs={key: False})
    assert info.value.param == "chat_template_kwargs" and info.value.status_code == 400
