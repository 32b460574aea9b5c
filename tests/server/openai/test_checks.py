"""The chat checks' messages: a missing content names the message's role with the right article."""

from __future__ import annotations

import pytest

from jaxserve.server.errors import APIError
from jaxserve.server.openai.checks import check_chat_messages
from jaxserve.server.protocol import ChatCompletionRequest


@pytest.mark.parametrize("role, says", [("user", "a user"), ("system", "a system"), ("assistant", "an assistant")])
def test_a_missing_content_names_the_role(role, says):
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": role}]})
    with pytest.raises(APIError, match=f"messages\\[0\\].content: field required for {says} message"):
        check_chat_messages(req)
