"""bench_serving.py's datasets: random, generated-shared-prefix, ShareGPT (a local file) and copy-heavy.

Each sampler returns `DatasetRow`s (the prompt text, or its token ids, and the output length). The
random and generated-shared-prefix shapes follow SGLang's `bench_serving.py`; copy-heavy is ours:
prompts whose answers reuse their own text (copy and continue a passage, rename a parameter in a
code block, extract a document's fields as JSON), where n-gram speculation has something to match.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np

# Used to make prompts when no tokenizer can be loaded: common English words are one token each in
# every BPE vocabulary we know, so a prompt of n words is close to n tokens.
FALLBACK_WORDS = tuple(
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been call who oil its now "
    "find long down day did get come made may part over new sound take only little work know place year "
    "live me back give most very after thing our just name good sentence man think say great where help "
    "through much before line right too mean old any same tell boy follow came want show also around "
    "form three small set put end does another well large must big even such because turn here why ask "
    "went men read need land different home us move try kind hand picture again change off play spell "
    "air away animal house point page letter mother answer found study still learn should world".split()
)


@dataclass(frozen=True)
class DatasetRow:
    """One request to send.

    prompt: the text sent (unless prompt_ids is set and the backend accepts token ids).
    prompt_len: prompt length in tokens by the local tokenizer (estimated without one); the server's
        own count replaces it in the results when reported.
    output_len: max_new_tokens / max_tokens requested.
    prompt_ids: the token ids the prompt was made from, when known (sent with --tokenize-prompt).
    group: the shared-prefix group index (generated-shared-prefix only).
    """

    prompt: str
    prompt_len: int
    output_len: int
    prompt_ids: list[int] | None = None
    group: int | None = None


class Tokenizer(Protocol):
    """The slice of a transformers tokenizer that this script uses."""

    all_special_ids: list[int]

    def get_vocab(self) -> dict[str, int]: ...
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class PromptSampler:
    """Makes random prompts of a given length in tokens.

    With a tokenizer: uniformly random non-special token ids decoded to text, as SGLang's random and
    generated-shared-prefix datasets do (re-tokenizing the text may give a slightly different
    length). Without one: random common English words, about one token each.
    """

    def __init__(self, tokenizer: Tokenizer | None, rng: np.random.Generator):
        self.tokenizer = tokenizer
        self.rng = rng
        if tokenizer is not None:
            special = set(tokenizer.all_special_ids)
            self._vocab_ids = np.array(sorted(set(tokenizer.get_vocab().values()) - special))

    def sample(self, num_tokens: int) -> tuple[str, list[int] | None]:
        """Returns (text, token ids or None without a tokenizer) for a prompt of num_tokens tokens."""
        if self.tokenizer is None:
            words = self.rng.choice(len(FALLBACK_WORDS), size=num_tokens)
            return " ".join(FALLBACK_WORDS[i] for i in words), None
        ids = self.rng.choice(self._vocab_ids, size=num_tokens).tolist()
        return self.tokenizer.decode(ids), ids


def token_counter(tokenizer: Tokenizer | None) -> Callable[[str], int] | None:
    """Counts the tokens of a text without special tokens; None without a tokenizer."""
    if tokenizer is None:
        return None
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def sample_random_requests(
    sampler: PromptSampler, num_prompts: int, input_len: int, output_len: int, range_ratio: float
) -> list[DatasetRow]:
    """SGLang's `random` dataset: input and output lengths uniform in [len * range_ratio, len]
    (at least 1), prompts from random token ids."""
    rng = sampler.rng
    input_lens = rng.integers(max(int(input_len * range_ratio), 1), input_len + 1, size=num_prompts)
    output_lens = rng.integers(max(int(output_len * range_ratio), 1), output_len + 1, size=num_prompts)
    rows = []
    for prompt_len, out_len in zip(input_lens.tolist(), output_lens.tolist()):
        text, ids = sampler.sample(prompt_len)
        rows.append(DatasetRow(text, prompt_len, out_len, ids))
    return rows


def sample_generated_shared_prefix_requests(
    sampler: PromptSampler,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
) -> list[DatasetRow]:
    """SGLang's `generated-shared-prefix` dataset: num_groups random system prompts, each followed
    by prompts_per_group random questions ("{system}\\n\\n{question}"), shuffled. It measures how
    well the prefix cache reuses the shared system prompts."""
    systems = [sampler.sample(system_prompt_len) for _ in range(num_groups)]
    sep_ids = sampler.tokenizer.encode("\n\n", add_special_tokens=False) if sampler.tokenizer else []
    rows = []
    for group, (system_text, system_ids) in enumerate(systems):
        for _ in range(prompts_per_group):
            question_text, question_ids = sampler.sample(question_len)
            text = f"{system_text}\n\n{question_text}"
            if system_ids is None:
                ids, prompt_len = None, system_prompt_len + question_len
            else:
                ids = system_ids + sep_ids + question_ids
                prompt_len = len(ids)
            rows.append(DatasetRow(text, prompt_len, output_len, ids, group))
    order = sampler.rng.permutation(len(rows))
    return [rows[i] for i in order]


COPY_HEAVY_TASKS = ("rewrite", "code-edit", "extract")


def _sentence(rng: np.random.Generator) -> str:
    words = [FALLBACK_WORDS[i] for i in rng.choice(len(FALLBACK_WORDS), size=int(rng.integers(6, 13)))]
    return " ".join(words).capitalize() + "."


def _copy_heavy_prompt(task: str, rng: np.random.Generator, num_sentences: int) -> str:
    if task == "rewrite":
        passage = " ".join(_sentence(rng) for _ in range(num_sentences))
        return f"Copy the passage below word for word, then continue it.\n\nPassage:\n{passage}\n\nCopy:\n"
    if task == "code-edit":
        names = [FALLBACK_WORDS[i] for i in rng.choice(len(FALLBACK_WORDS), size=3 * num_sentences)]
        funcs = [
            f"def {a}_{b}(items, {c}=0):\n    total = {c}\n    for item in items:\n        total += item.{b}\n"
            f"    return total\n"
            for a, b, c in zip(names[0::3], names[1::3], names[2::3])
        ]
        code = "\n".join(funcs)
        return (f"Rename the parameter `items` to `values` everywhere in this code and print the whole edited "
                f"file.\n\n```python\n{code}```\n\nEdited file:\n```python\n")
    fields = {name: " ".join(FALLBACK_WORDS[i] for i in rng.choice(len(FALLBACK_WORDS), size=3))
              for name in ("name", "street", "city", "company", "title", "department", "project", "manager")}
    notes = " ".join(_sentence(rng) for _ in range(max(1, num_sentences // 2)))
    doc = "\n".join(f"{k.capitalize()}: {v}" for k, v in fields.items())
    return f"Document:\n{doc}\nNotes: {notes}\n\nExtract every field of the document as JSON with the same values.\nJSON:\n{{\n"


def sample_copy_heavy_requests(
    tokenizer: Tokenizer | None, rng: np.random.Generator, num_prompts: int, num_sentences: int, output_len: int
) -> list[DatasetRow]:
    """Prompts whose answers reuse their own text (a workload for n-gram speculation): copy and
    continue a passage, rename a parameter in a code block, extract a document's fields as JSON, in
    turn. Passages are random common English words (`num_sentences` sentences of 6-12 words)."""
    count = token_counter(tokenizer) or estimate_num_tokens
    rows = []
    for i in range(num_prompts):
        prompt = _copy_heavy_prompt(COPY_HEAVY_TASKS[i % len(COPY_HEAVY_TASKS)], rng, num_sentences)
        rows.append(DatasetRow(prompt, count(prompt), output_len))
    return rows


def estimate_num_tokens(text: str) -> int:
    """About 4 characters per token for English text with BPE vocabularies (OpenAI's rule of thumb)."""
    return max(1, round(len(text) / 4))


def sample_sharegpt_requests(
    dataset_path: str | Path,
    num_prompts: int,
    count_tokens: Callable[[str], int],
    rng: np.random.Generator,
    fixed_output_len: int | None = None,
) -> list[DatasetRow]:
    """SGLang's `sharegpt` dataset from a local JSON file `[{"conversations": [{"from": "human",
    "value": ...}, {"from": "gpt", "value": ...}, ...]}, ...]`: the first turn is the prompt, the
    length of the second sets the output length (unless fixed_output_len). Like SGLang, drops
    conversations with a prompt or completion under 2 tokens, a prompt over 1024 tokens or (without
    fixed_output_len) a total over 2048. Returns up to num_prompts rows in random order.

    Raises FileNotFoundError if the file is missing (nothing is downloaded)."""
    with open(dataset_path) as f:
        conversations = [d["conversations"] for d in json.load(f) if len(d.get("conversations", [])) >= 2]
    rows = []
    for i in rng.permutation(len(conversations)):
        if len(rows) == num_prompts:
            break
        prompt, completion = conversations[i][0]["value"], conversations[i][1]["value"]
        prompt_len = count_tokens(prompt)
        output_len = fixed_output_len or count_tokens(completion)
        if prompt_len < 2 or output_len < 2:
            continue
        if prompt_len > 1024 or (fixed_output_len is None and prompt_len + output_len > 2048):
            continue
        rows.append(DatasetRow(prompt, prompt_len, output_len))
    return rows
