"""Start-up flags (items of the new-user trial): an empty --served-model-name, a --context-length above
the model's trained length (SGLang 0.5.23's rule), and the log level of compiles under --disable-precompile."""

from __future__ import annotations

import logging

import pytest

from jaxserve.model.context_length import ALLOW_LONGER_ENV, resolve_context_length, trained_context_length
from jaxserve.server_args import ServerArgs


@pytest.mark.parametrize("name", ["", "   "])
def test_empty_served_model_name_is_an_argparse_error(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        ServerArgs.from_cli(["--served-model-name", name])
    assert exit_.value.code == 2
    assert "--served-model-name must not be empty" in capsys.readouterr().err


def test_a_served_model_name_is_kept():
    assert ServerArgs.from_cli(["--served-model-name", "org/model"]).served_model_name == "org/model"


def test_context_length_above_the_trained_one_is_refused_with_sglangs_variable_named():
    with pytest.raises(ValueError, match=r"--context-length 100000 is greater than the model's context length 8192"
                                         r".*SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"):
        resolve_context_length(100000, 8192, 8192, environ={})
    with pytest.raises(ValueError):
        resolve_context_length(8193, 8192, 8192, environ={ALLOW_LONGER_ENV: "0"})


@pytest.mark.parametrize("value", ["1", "true", "Yes", "y"])
def test_sglangs_variable_turns_the_refusal_into_a_warning(value, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxserve.model.context_length"):
        assert resolve_context_length(100000, 8192, 8192, environ={ALLOW_LONGER_ENV: value}) == 100000
    assert "greater than the model's context length 8192" in caplog.text


def test_the_engine_api_only_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxserve.model.context_length"):
        assert resolve_context_length(4096, 1024, 8192, environ={}, refuse_longer=False) == 4096
    assert "greater than the model's context length 1024" in caplog.text


def test_within_the_trained_length_and_the_default():
    assert resolve_context_length(8192, 8192, 4096, environ={}) == 8192
    assert resolve_context_length(100, 8192, 4096, environ={}) == 100
    assert resolve_context_length(None, 8192, 4096, environ={}) == 4096  # jaxserve's default cap
    assert resolve_context_length(None, 1024, 4096, environ={}) == 1024


def test_trained_context_length_from_the_checkpoints_metadata(tiny_model_dir, tmp_path):
    assert trained_context_length(tiny_model_dir) == 1024  # tests/conftest.py's config
    assert trained_context_length("default") == 8192  # SmolLM2-135M-Instruct's max_position_embeddings
    assert trained_context_length(str(tmp_path / "missing")) is None


def test_disable_precompile_logs_first_use_compiles_at_debug_and_a_missed_bucket_warns(tiny_model_dir, caplog):
    from jaxserve.engine.engine import Engine

    engine = Engine(model_path=tiny_model_dir, max_total_tokens=1024, max_running_requests=2, context_length=256,
                    page_size=16, disable_precompile=True)
    greedy = {"max_new_tokens": 2, "temperature": 0.0}
    with caplog.at_level(logging.DEBUG, logger="jaxserve.runner.model_runner"):
        engine.generate([5, 6, 7], greedy)
    serving = [r for r in caplog.records if "while serving" in r.getMessage()]
    assert serving and all(r.levelno == logging.DEBUG for r in serving)

    caplog.clear()
    engine.runner.precompiled = True  # as after precompile(): a compile now is a bucket precompile missed
    with caplog.at_level(logging.DEBUG, logger="jaxserve.runner.model_runner"):
        engine.generate(list(range(3, 103)), greedy)  # 100 prompt tokens: a token bucket not compiled yet
    assert any(r.levelno == logging.WARNING and "while serving" in r.getMessage() for r in caplog.records)
