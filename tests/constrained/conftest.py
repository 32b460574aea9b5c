"""Shared fixtures: the default model's tokenizer and llguidance backends (built once per session)."""

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from jaxserve.model.tokenizer import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="session")
def backend(tokenizer):
    from jaxserve.constrained.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer)


@pytest.fixture(scope="session")
def compact_backend(tokenizer):
    """No whitespace between JSON tokens (whitespace_pattern=""): forced text is unambiguous."""
    from jaxserve.constrained.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, whitespace_pattern="")
