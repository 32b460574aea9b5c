"""What the session server writes at start-up."""

from __future__ import annotations


def test_no_pytorch_advice_at_start_up(server):
    """Before: every start logged transformers' "[transformers] PyTorch was not found. Models won't be
    available..." (the server hides torch on purpose: it never uses it), which alarmed users."""
    log = server.log()
    assert "jaxserve ready:" in log
    assert "PyTorch was not found" not in log, log[:2000]


def test_the_ready_line_without_flags_that_change_answers(server):
    ready = [line for line in server.log().splitlines() if line.startswith("jaxserve ready:")]
    assert ready == [f"jaxserve ready: serving tiny_llama0 at {server.url} (OpenAI API at /v1)"], ready
