"""What the session server writes at start-up."""

from __future__ import annotations

import os


def test_no_pytorch_advice_at_start_up(server):
    """Before: every start logged transformers' "[transformers] PyTorch was not found. Models won't be
    available..." (the server hides torch on purpose: it never uses it), which alarmed users."""
    log = server.log()
    assert "jaxserve ready:" in log
    assert "PyTorch was not found" not in log, log[:2000]


def test_the_ready_line_without_flags_that_change_answers(server):
    ready = [line for line in server.log().splitlines() if line.startswith("jaxserve ready:")]
    assert ready == [f"jaxserve ready: serving tiny_llama0 at {server.url} (OpenAI API at /v1)"], ready


def test_malloc_keeps_freed_memory_on_cpu(server):
    """D-45: on CPU the server sets glibc malloc before jax starts, and says why (tests/launch/test_malloc.py
    checks what the setting does and the rule for CPU)."""
    from jaxserve.launch.malloc import glibc

    platforms = os.environ["JAX_PLATFORMS"]  # the server's (tests/conftest.py sets cpu unless given)
    if platforms.split(",")[0] != "cpu":
        assert f"malloc: left as it is: D-45 is for CPU only, and this server may not run on CPU (JAX_PLATFORMS={platforms})" \
            in server.log()
    elif glibc() is None:
        assert "malloc: not glibc, left as it is" in server.log()
    else:
        assert "malloc: freed memory kept for reuse: one arena, no mmap, no automatic trim (D-45; CPU: " \
               f"JAX_PLATFORMS={platforms})" in server.log()
