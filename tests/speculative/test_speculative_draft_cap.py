"""--speculative-num-draft-tokens above what a verify step can check: a start-up warning with the value
used, and the resolved args carry it (it started silently; SGLang accepts any value). The caps below are
worked by hand from the rows of a verify step, min(pow2(max running requests), pow2(extend bucket)),
less the sequence's own last token; the in-process check of the 63 is the engine test below."""

from __future__ import annotations

import logging

import pytest

from jaxserve.server_args import ServerArgs

NGRAM = dict(speculative_algorithm="NGRAM")


@pytest.mark.parametrize("flags, given, used", [
    (dict(), 100000, 63),  # CPU defaults: 64 running requests, 512-token chunks -> 64 rows
    (dict(max_running_requests=16, chunked_prefill_size=64), 100000, 15),
    (dict(max_running_requests=200, chunked_prefill_size=100), 1000, 127),  # rows: 256 and 128
    (dict(max_running_requests=64, chunked_prefill_size=-1, max_prefill_tokens=20), 40, 31),  # no chunking
    (dict(max_running_requests=64, context_length=8), 40, 15),  # the extend bucket is at least 16
])
def test_too_many_draft_tokens_warn_with_the_value_used(caplog, flags, given, used):
    with caplog.at_level(logging.WARNING, logger="jaxserve.server_args"):
        args = ServerArgs(**NGRAM, **flags, speculative_num_draft_tokens=given).resolved("cpu")
    assert args.speculative_num_draft_tokens == used
    [warning] = [r.getMessage() for r in caplog.records if r.name == "jaxserve.server_args"]
    assert f"--speculative-num-draft-tokens {given} " in warning and f"using {used} " in warning, warning


@pytest.mark.parametrize("flags", [dict(**NGRAM, speculative_num_draft_tokens=63), dict(**NGRAM),
                                   dict(speculative_num_draft_tokens=100000)])  # the last: no algorithm, ignored
def test_draft_tokens_that_fit_are_kept_silently(caplog, flags):
    with caplog.at_level(logging.WARNING, logger="jaxserve.server_args"):
        args = ServerArgs(**flags).resolved("cpu")
    assert args.speculative_num_draft_tokens == flags.get("speculative_num_draft_tokens", 15)
    assert not [r for r in caplog.records if r.name == "jaxserve.server_args"]


def test_the_cap_is_the_longest_draft_the_engine_verifies(tiny_model_dir):
    from jaxserve.engine.engine import Engine

    engine = Engine(model_path=tiny_model_dir, max_total_tokens=2048, max_running_requests=32, chunked_prefill_size=128,
                    context_length=512, disable_precompile=True, speculative_num_draft_tokens=100000,
                    disable_speculative_adaptive=True, **NGRAM)
    assert engine.args.speculative_num_draft_tokens == 31
    lengths = []
    propose = engine.speculator.propose_batch
    engine.speculator.propose_batch = lambda *a, **k: lengths.extend(map(len, d := propose(*a, **k))) or d
    engine.generate(list(range(3, 13)) * 8, {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True})
    assert max(lengths) == 31  # a loop of period 10: the n-gram draft fills whatever room it gets
