"""Prompt positions' top logprobs through the real (tiny-checkpoint) server: /generate's
`input_top_logprobs` / `input_token_ids_logprobs` in SGLang's shape, and /v1/completions' `echo` with
`logprobs`, against transformers' log-softmax of the same checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

PROMPT = list(range(700, 720))


@pytest.fixture(scope="module")
def ref(tiny_model_dir) -> np.ndarray:
    torch = pytest.importorskip("torch")
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].double(), -1).numpy()


def test_generate_returns_sglangs_input_top_and_ids_logprobs(http, ref):
    body = {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0,
            "token_ids_logprob": [11, 12], "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    meta = http.post("/generate", json=body).json()["meta_info"]
    tops, picked = meta["input_top_logprobs"], meta["input_token_ids_logprobs"]
    assert len(tops) == len(picked) == len(meta["input_token_logprobs"]) == len(PROMPT)
    assert tops[0] is None and picked[0] is None  # SGLang's first prompt position
    for p in range(1, len(PROMPT)):
        expect = np.argsort(-ref[p - 1], kind="stable")[:3]
        assert [t for _, t, _ in tops[p]] == list(expect)
        assert all(isinstance(text, str) for _, _, text in tops[p])
        np.testing.assert_allclose([lp for lp, _, _ in tops[p]], ref[p - 1, expect], atol=1e-4)
        assert [t for _, t, _ in picked[p]] == [11, 12]
        np.testing.assert_allclose([lp for lp, _, _ in picked[p]], ref[p - 1, [11, 12]], atol=1e-4)


def test_completions_echo_gives_prompt_top_logprobs(http, ref, default_tokenizer):
    body = {"model": "x", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2}
    lp = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, len(PROMPT)):
        expect = np.argsort(-ref[p - 1], kind="stable")[:2]
        want = {default_tokenizer.decode([int(t)]): ref[p - 1, t] for t in expect}
        got = lp["top_logprobs"][p]
        assert set(got) == set(want), p
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), atol=1e-4)
    assert len(lp["top_logprobs"]) == len(PROMPT) + 1 and len(lp["top_logprobs"][-1]) >= 1  # the output token's
