"""Scoring `select` choices by their token log-probabilities given the prompt.

Each choice is scored by the mean log-probability of its tokens (SGLang's default
`token_length_normalized`, python/sglang/lang/choices.py), all choices in one batched request whose
prompts share the prompt's tokens, so the radix cache computes that prefix once.

Tokenization boundaries: the tokens of a choice are tokenize(prompt + choice) minus the longest
common prefix with tokenize(prompt). When the boundary merges (prompt "The answer is " + "Paris"
tokenizes to [..., "is", " Paris"], not [..., "is", " ", "Paris"]), the merged token " Paris" is scored,
and the prompt token it replaced is not: the choice is judged as the model would read the joined text.
SGLang handles the same case ("token healing") by asking for logprobs from two tokens before the
prompt's end and dropping the first when it is plain prompt text.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True)
class ChoiceTokens:
    """The batched request of a select.

    Attributes:
        input_ids: per choice, the token ids of prompt + choice.
        logprob_start_len: the first position whose log-probability is asked for (the same for the
            whole batch: the shortest common prefix with the prompt's tokens).
        choice_starts: per choice, the position of its first token (>= logprob_start_len).
    """

    input_ids: list[list[int]]
    logprob_start_len: int
    choice_starts: list[int]

    def num_choice_tokens(self, i: int) -> int:
        return len(self.input_ids[i]) - self.choice_starts[i]


@dataclasses.dataclass(frozen=True)
class ChoiceScores:
    """The outcome of a select.

    Attributes:
        decision: the chosen choice.
        normalized_logprobs: per choice, the mean log-probability (nats per token) of its tokens.
        token_logprobs: per choice, the log-probability of each of its tokens (None where the model
            gives none: the very first token of an empty prompt).
        token_ids: per choice, its token ids (as scored, after the boundary merge).
    """

    decision: str
    normalized_logprobs: list[float]
    token_logprobs: list[list[float | None]]
    token_ids: list[list[int]]


def tokenize_choices(tokenizer: Any, prompt: str, choices: Sequence[str]) -> ChoiceTokens:
    """Token ids of prompt + choice for every choice, and where each choice's tokens start.

    `tokenizer.encode(text, add_special_tokens=False)`, as the engine tokenizes a text prompt.
    """
    prompt_ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    input_ids, starts = [], []
    for choice in choices:
        ids = list(tokenizer.encode(prompt + choice, add_special_tokens=False))
        start = _common_prefix_len(prompt_ids, ids)
        if start == len(ids):  # only when the choice adds no token at all; score its last token
            start = max(len(ids) - 1, 0)
        input_ids.append(ids)
        starts.append(start)
    return ChoiceTokens(input_ids, min(starts), starts)


def token_length_normalized(
    choices: Sequence[str], tokens: ChoiceTokens, input_logprobs: Sequence[Sequence[float | None]]
) -> ChoiceScores:
    """Pick the choice with the highest mean token log-probability (the first one on a tie).

    Args:
        choices: the choices, in the order of `tokens`.
        tokens: from `tokenize_choices`.
        input_logprobs: per choice, the log-probabilities of the LAST tokens of its input (at least
            the choice's tokens; a backend returns those from `logprob_start_len` on).

    Raises:
        ValueError: a backend returned fewer log-probabilities than the choice has tokens.
    """
    means, per_token, ids = [], [], []
    for i, choice in enumerate(choices):
        n = tokens.num_choice_tokens(i)
        got = list(input_logprobs[i])
        if len(got) < n:
            raise ValueError(f"choice {choice!r} has {n} tokens but the backend returned {len(got)} log-probabilities")
        mine = got[len(got) - n:]
        values = [v for v in mine if v is not None]
        means.append(sum(values) / len(values) if values else -math.inf)
        per_token.append(mine)
        ids.append(tokens.input_ids[i][tokens.choice_starts[i]:])
    best = max(range(len(choices)), key=lambda i: (means[i], -i))
    return ChoiceScores(choices[best], means, per_token, ids)


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
