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


def test_malloc_keeps_freed_memory(server):
    """D-45: the server sets glibc malloc before jax starts (tests/launch/test_malloc.py checks what the
    setting does)."""
    from jaxserve.launch.malloc import glibc

    if glibc() is None:
        assert "malloc: not glibc, left as it is" in server.log()
    else:
        assert "malloc: freed memory kept for reuse: one arena, no mmap, no automatic trim (D-45)" in server.log()
