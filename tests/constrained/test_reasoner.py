"""ReasonerMatcher (jaxserve/constrained/reasoner.py, SGLang's ReasonerGrammarObject): no constraint while
reasoning, the inner grammar from the token after the end sequence; partial matches, rollback across the
end, and the engine on the tiny checkpoint with a fake reasoning end taken from its own greedy reply."""

from __future__ import annotations

import re

import pytest

from jaxserve.constrained.bitmask import allocate_bitmask
from jaxserve.constrained.reasoner import ReasonerMatcher


class RecordingMatcher:
    """A fake inner grammar: accepts even ids only, terminates after 3 tokens, records what it saw."""

    def __init__(self):
        self.tokens: list[int] = []

    def fill_bitmask(self, row):
        row[:] = 0x55555555  # even ids

    def accept_token(self, t):
        if t % 2:
            return False
        self.tokens.append(t)
        return True

    def is_terminated(self):
        return len(self.tokens) >= 3

    def is_accepting(self):
        return len(self.tokens) >= 3

    def jump_forward_tokens(self):
        return [2]

    def accept_jump_forward(self):
        self.tokens.append(2)
        return [2]

    def rollback(self, n):
        del self.tokens[len(self.tokens) - n:]

    def error_message(self):
        return None


END = (5, 9, 8)


def test_reasoning_is_free_and_the_grammar_starts_after_the_end_sequence():
    inner = RecordingMatcher()
    m = ReasonerMatcher(inner, END)
    row = allocate_bitmask(1, 64)[0]
    for t in [1, 5, 9, 5, 9, 3, 5, 5, 9]:  # odd ids the grammar refuses; two broken partial matches
        m.fill_bitmask(row)
        assert (row == -1).all() and m.jump_forward_tokens() == [] and not m.is_terminated()
        assert m.accept_token(t) and m.is_reasoning
    assert m.constraining is None
    assert m.accept_token(8) and not m.is_reasoning and m.constraining is inner  # 5 9 8 completed
    assert inner.tokens == []
    m.fill_bitmask(row)
    assert (row == 0x55555555).all()
    assert not m.accept_token(7) and m.accept_token(4) and inner.tokens == [4]
    assert m.accept_jump_forward() == [2] and m.accept_tokens([6, 1]) == 1 and m.is_terminated()


def test_rollback_across_the_end_returns_to_reasoning():
    inner = RecordingMatcher()
    m = ReasonerMatcher(inner, END)
    assert m.accept_tokens([5, 9, 8, 4, 6]) == 5 and inner.tokens == [4, 6]
    m.rollback(3)  # 6, 4 and the 8 that ended the reasoning
    assert m.is_reasoning and inner.tokens == [] and m.accept_token(8) and not m.is_reasoning
    m.rollback(2)  # 8, 9: back inside a partial match of 5
    assert m.accept_tokens([9, 8]) == 2 and not m.is_reasoning
    with pytest.raises(ValueError):
        m.rollback(4)
    with pytest.raises(ValueError):
        ReasonerMatcher(inner, ())


def test_engine_reasons_freely_then_follows_the_grammar(tiny_model_dir):
    from tests.engine.test_engine import make_engine

    engine = make_engine(tiny_model_dir)
    prompt, greedy = [11, 12, 13, 14], {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}

    def run(params, **kwargs):
        engine.add_request(prompt, params, rid="r", **kwargs)
        final = None
        while engine.has_unfinished():
            final = next((o for o in engine.step() if o.finished), final)
        return final

    plain = run(greedy).output_ids
    # the grammar refuses the plain reply's start, so a reply that keeps it was not constrained there
    assert not re.fullmatch("[0-9]*", engine.tokenizer.decode(plain[:4]))
    end = plain[2:4]  # a fake reasoning end: the tokens greedy decoding writes 3rd and 4th
    assert not any(plain[i : i + 2] == end for i in range(2)), "the end sequence must first occur at 2"
    constrained = {**greedy, "regex": "[0-9]{3}"}
    deferred = run(constrained, think_end_ids=end)
    assert deferred.output_ids[:4] == plain[:4]  # the reasoning was not constrained
    answer = engine.tokenizer.decode(deferred.output_ids[4:])
    assert re.fullmatch("[0-9]{3}", answer), answer
    assert deferred.meta.finish_reason.kind == "stop"
    from_start = run(constrained)
    assert re.fullmatch("[0-9]{3}", engine.tokenizer.decode(from_start.output_ids)), from_start.output_ids
    engine.cache.check_integrity([])
