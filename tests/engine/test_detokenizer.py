"""Tests of the incremental detokenizer with the default model's tokenizer (SmolLM2, byte-level BPE)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.request import finish_abort, finish_length, finish_stop
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.model.tokenizer import load_tokenizer

FFFD = "\ufffd"
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def byte_ids(tok) -> dict[int, int]:
    """byte -> id of the byte-level token that stands for that single byte (GPT-2's byte alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    ids = {b: tok.convert_tokens_to_ids(c) for b, c in chars.items()}
    return {b: i for b, i in ids.items() if i != tok.unk_token_id}


def full_decode(tok, ids, skip_special_tokens=True) -> str:
    return tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def stream(tok, ids, eos=(2,), prompt=PROMPT, **params):
    """Feed ids until finished; returns (deltas, detokenizer)."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), SamplingParams(**{"max_new_tokens": 128, **params}), eos)
    deltas = []
    for token in ids:
        result = detok.append(token)
        deltas.append(result.text_delta)
        assert result.finished == detok.finished
        if result.finished:
            assert result.finish_reason == detok.finish_reason
            break
    return deltas, detok


@pytest.mark.parametrize("text", ["café au lait", "emoji 😀🎉👍🏽 done", "你好，世界！日本語も", "naïve — ✓ ∑ 𝔘𝔫𝔦"])
def test_multibyte_characters_split_across_tokens_stream_cleanly(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert full_decode(tok, ids) == text
    deltas, detok = stream(tok, ids, max_new_tokens=len(ids) + 1)
    assert not detok.finished
    assert not any(FFFD in d for d in deltas)
    assert "".join(deltas) == detok.text == text
    if text.startswith(("emoji", "你")):
        assert any(FFFD in tok.decode([i]) for i in ids)  # a character really is split


def test_stop_string_spanning_tokens_is_trimmed(tok):
    ids = tok.encode("The answer is 42, and more", add_special_tokens=False)
    assert not any("is 42" in tok.decode([i]) for i in ids)
    deltas, detok = stream(tok, ids, stop=("is 42",))
    assert detok.finish_reason == finish_stop("is 42")
    assert detok.text == "".join(deltas) == "The answer "
    assert detok.num_tokens == 6  # the token that completes the stop string: "2"


def test_stop_string_kept_with_no_stop_trim(tok):
    ids = tok.encode("The answer is 42, and more", add_special_tokens=False)
    deltas, detok = stream(tok, ids, stop=("is 42",), no_stop_trim=True)
    assert detok.finish_reason == finish_stop("is 42")
    assert detok.text == "".join(deltas) == "The answer is 42"


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("one two three", add_special_tokens=False)
    deltas, detok = stream(tok, ids, stop=("three", "wo t"))
    assert detok.finish_reason == finish_stop("wo t")
    assert detok.text == "".join(deltas) == "one t"


def test_possible_stop_prefix_is_held_back_then_released(tok):
    ids = tok.encode("hello world war", add_special_tokens=False)  # hello | " world" | " war"
    assert len(ids) == 3
    detok = IncrementalDetokenizer(tok, [], SamplingParams(max_new_tokens=128, stop=("world peace",)), [2])
    assert detok.append(ids[0]).text_delta == "hello"
    held = detok.append(ids[1])
    assert held.text_delta == " " and not held.finished  # "world" could still become "world peace"
    released = detok.append(ids[2])
    assert released.text_delta == "world war" and not released.finished
    assert detok.text == "hello world war"


def test_held_back_text_is_released_at_max_new_tokens(tok):
    ids = tok.encode("hello world", add_special_tokens=False)
    deltas, detok = stream(tok, ids, stop=("world peace",), max_new_tokens=len(ids))
    assert detok.finish_reason == finish_length(len(ids))
    assert deltas[-1].endswith("world") and "".join(deltas) == "hello world"


def test_eos_finishes_and_its_text_is_dropped(tok):
    ids = tok.encode("Hello there", add_special_tokens=False) + [2] + tok.encode(" more", add_special_tokens=False)
    deltas, detok = stream(tok, ids, skip_special_tokens=False)
    assert detok.finish_reason == finish_stop(2)
    assert detok.text == "".join(deltas) == "Hello there"
    assert detok.num_tokens == 3

    _, kept = stream(tok, ids, skip_special_tokens=False, no_stop_trim=True)
    assert kept.text == "Hello there<|im_end|>"

    _, ignored = stream(tok, ids, ignore_eos=True, max_new_tokens=len(ids))
    assert ignored.finish_reason == finish_length(len(ids))
    assert ignored.text == "Hello there more"


def test_stop_token_ids_finish_the_request(tok):
    ids = tok.encode("one two three", add_special_tokens=False)
    deltas, detok = stream(tok, ids, stop_token_ids=(ids[1],))
    assert detok.finish_reason == finish_stop(ids[1])
    assert detok.text == "".join(deltas) == "one"


def test_min_new_tokens_delays_stop_tokens_and_stop_strings(tok):
    ids = tok.encode("ab", add_special_tokens=False) + [2] + tok.encode(" cd ab ef", add_special_tokens=False)
    _, detok = stream(tok, ids, min_new_tokens=4, stop=("ab",))
    # EOS (token 3) and the first "ab" (tokens 1-2) come before min_new_tokens; the second "ab" stops.
    assert detok.finish_reason == finish_stop("ab")
    assert detok.text == "ab cd "


def test_max_new_tokens_zero_and_one(tok):
    params = SamplingParams(max_new_tokens=0)
    assert IncrementalDetokenizer.finish_without_tokens(params) == ("", True, finish_length(0))
    assert IncrementalDetokenizer.finish_without_tokens(SamplingParams()) is None
    detok = IncrementalDetokenizer(tok, [1, 2], params, [2])
    assert detok.finished and detok.finish_reason == finish_length(0) and detok.text == ""
    with pytest.raises(RuntimeError):
        detok.append(5)

    ids = tok.encode("😀", add_special_tokens=False)  # the first token holds half of the emoji
    deltas, one = stream(tok, ids, max_new_tokens=1)
    assert one.finish_reason == finish_length(1)
    assert deltas == [full_decode(tok, ids[:1])]  # flushed at finish, U+FFFD and all


def test_finish_flushes_held_text(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(max_new_tokens=128, stop=("world peace",)), [2])
    for token in tok.encode("hello world", add_special_tokens=False):
        detok.append(token)
    result = detok.finish(finish_abort("client left"))
    assert result.finished and result.text_delta == "world"
    assert detok.text == "hello world"


def test_work_per_token_is_bounded_by_a_window(tok, byte_ids):
    class CountingTokenizer:
        max_len = 0

        def decode(self, ids, **kwargs):
            self.max_len = max(self.max_len, len(ids))
            return tok.decode(ids, **kwargs)

    counting = CountingTokenizer()
    # Lone continuation bytes decode to U+FFFD forever; CJK characters split across tokens.
    ids = [byte_ids[0x80 + i % 48] for i in range(300)] + tok.encode("你好世界" * 40, add_special_tokens=False)
    detok = IncrementalDetokenizer(counting, tok.encode(PROMPT), SamplingParams(max_new_tokens=len(ids)), [2])
    deltas = [detok.append(t).text_delta for t in ids]
    assert counting.max_len <= 16
    assert "".join(deltas) == full_decode(tok, ids)


token_ids = st.one_of(
    st.integers(0, 49151),
    st.integers(0, 20),  # special tokens
    st.integers(100, 300),  # mostly single bytes
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(ids=st.lists(token_ids, max_size=40), skip_special_tokens=st.booleans())
def test_deltas_concatenate_to_the_full_decode(tok, ids, skip_special_tokens):
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), SamplingParams(max_new_tokens=1000, skip_special_tokens=skip_special_tokens), [])
    deltas = [detok.append(t).text_delta for t in ids]
    deltas.append(detok.finish(finish_abort("")).text_delta)
    full = full_decode(tok, ids, skip_special_tokens)
    assert "".join(deltas) == detok.text == full
    if FFFD not in full:
        assert not any(FFFD in d for d in deltas)


STOPS = ["ab", "é😀", " b", "😀\n", "a a"]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    text=st.text(alphabet="ab é😀\n", max_size=30),
    stop=st.sampled_from(STOPS),
    no_stop_trim=st.booleans(),
)
def test_stop_strings_on_random_text(tok, text, stop, no_stop_trim):
    ids = tok.encode(text, add_special_tokens=False)
    deltas, detok = stream(tok, ids, eos=(), stop=(stop,), no_stop_trim=no_stop_trim, max_new_tokens=1000)
    if not detok.finished:
        deltas.append(detok.finish(finish_abort("")).text_delta)
    assert "".join(deltas) == detok.text
    assert not any(FFFD in d for d in deltas)
    consumed = full_decode(tok, ids[: detok.num_tokens])
    if detok.finish_reason.kind == "stop":
        assert detok.finish_reason.matched == stop
        assert stop in consumed
        assert detok.text == (consumed if no_stop_trim else consumed[: consumed.find(stop)])
    else:
        assert stop not in text
        assert detok.text == text


def reference_regex_stop(tok, ids, pattern):
    """Brute force: the first prefix of ids whose decode matches `pattern` (Python's re), cut there."""
    import re

    for k in range(1, len(ids) + 1):
        text = full_decode(tok, ids[:k])
        m = re.search(pattern, text)
        if m is not None:
            return text[: m.start()], k
    return full_decode(tok, ids), None


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("The answer is 42, and more", r"\d+,"),
        ("Call me at 555-1234 tomorrow", r"\d{3}-\d{4}"),
        ("alpha beta gamma delta", r"gam+a"),
        ("x = [1, 2, 3]; y", r"\]"),
        ("no match in here at all", r"\d"),
        ("héllo wörld, ünïcode", r"w.rld"),
    ],
)
def test_stop_regex_matches_a_brute_force_reference(tok, text, pattern):
    ids = tok.encode(text, add_special_tokens=False)
    expected, stop_at = reference_regex_stop(tok, ids, pattern)
    deltas, detok = stream(tok, ids, stop_regex=(pattern,), max_new_tokens=len(ids) + 1)
    assert "".join(deltas) == detok.text == expected
    if stop_at is None:
        assert not detok.finished
    else:
        assert detok.finish_reason == finish_stop(pattern)
        assert detok.num_tokens == stop_at


def test_stop_regex_partial_match_is_held_back_then_released(tok):
    ids = tok.encode("id 12 34 done", add_special_tokens=False)
    deltas, detok = stream(tok, ids, stop_regex=(r"\d\d x",), max_new_tokens=len(ids))
    # "12" and "34" could each start a match; each is held until the next token rules it out
    assert detok.finish_reason == finish_length(len(ids))
    assert "".join(deltas) == detok.text == "id 12 34 done"
    held_at = [i for i, d in enumerate(deltas) if d == ""]
    assert held_at, deltas


def test_stop_regex_with_no_stop_trim_keeps_the_match(tok):
    ids = tok.encode("value: 7 apples", add_special_tokens=False)
    _, detok = stream(tok, ids, stop_regex=(r"\d",), no_stop_trim=True, max_new_tokens=len(ids))
    assert detok.finish_reason.matched == r"\d"
    assert detok.text.endswith("7") and "apples" not in detok.text


def test_stop_regex_and_stop_string_earliest_wins(tok):
    ids = tok.encode("one two three four", add_special_tokens=False)
    _, detok = stream(tok, ids, stop=("four",), stop_regex=(r"t[hw]",), max_new_tokens=len(ids))
    assert detok.text == "one " and detok.finish_reason == finish_stop(r"t[hw]")


def test_spaces_between_special_tokens_reaches_the_tokenizer():
    class RecordingTokenizer:
        def __init__(self):
            self.kwargs = []

        def decode(self, ids, **kwargs):
            self.kwargs.append(kwargs)
            return "".join(chr(97 + i % 26) for i in ids)

    for flag, expected in ((True, None), (False, False)):
        t = RecordingTokenizer()
        d = IncrementalDetokenizer(t, [1, 2], SamplingParams(max_new_tokens=128, spaces_between_special_tokens=flag), ())
        d.append(3)
        assert {k.get("spaces_between_special_tokens") for k in t.kwargs} == {expected}


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet="ab c01.", min_size=1, max_size=40),
    pattern=st.sampled_from([r"ab", r"b+c", r"[0-9]{2}", r"a.c", r"c\.", r"(ab|ba)0", r" 1", r"a{3}"]),
    no_stop_trim=st.booleans(),
)
def test_stop_regex_on_random_text(tok, text, pattern, no_stop_trim):
    ids = tok.encode(text, add_special_tokens=False)
    expected, stop_at = reference_regex_stop(tok, ids, pattern)
    deltas, detok = stream(tok, ids, stop_regex=(pattern,), no_stop_trim=no_stop_trim, max_new_tokens=len(ids) + 1)
    if stop_at is None:
        assert not detok.finished
        deltas.append(detok.finish(finish_abort("")).text_delta)  # releases text held for a partial match
        assert "".join(deltas) == detok.text == full_decode(tok, ids)
    else:
        assert "".join(deltas) == detok.text
        assert detok.num_tokens == stop_at
        assert detok.text == (full_decode(tok, ids[:stop_at]) if no_stop_trim else expected)


def test_a_stop_regex_that_backtracks_catastrophically_ends_only_its_request(tok):
    """Before: "(a|aa)+c" over an output of a's searched for tens of seconds per token on the engine's
    thread (a new user measured a 38 s wait for another client's 3-token request)."""
    a = tok.encode("a", add_special_tokens=False)
    assert len(a) == 1
    deltas, detok = stream(tok, a * 400, stop_regex=("(a|aa)+c",), max_new_tokens=400)
    reason = detok.finish_reason
    assert reason.kind == "abort" and reason.status_code == 400, reason
    assert "(a|aa)+c" in reason.message and "backtracks" in reason.message
    assert detok.text == "".join(deltas) and set(detok.text) == {"a"}  # the text so far is kept
