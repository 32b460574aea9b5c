"""What a new user sees first: scripts/serve.py refusing a --model-path that is not a model, with a
message saying what to pass instead. Each case is a real `python scripts/serve.py` run (it fails
before any model loads, in a few seconds)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.server.conftest import REPO, SERVE, free_port


def _serve_all(argvs: list[list[str]]) -> list[str]:
    """Run serve.py once per argv (in parallel); each must exit 1; returns their last output lines."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, str(SERVE), *a, "--port", str(free_port())], cwd=str(REPO), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for a in argvs]
    lines = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 1, out[-2000:]
        lines.append(out.strip().splitlines()[-1])
    return lines


def test_bad_model_paths_say_what_to_pass(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    fake = tmp_path / "weights.gguf"
    fake.write_bytes(b"\x93NUMPY" + bytes(200))
    missing, hub, not_dir, not_gguf = _serve_all([
        ["--model-path", "/no/such/dir"],
        ["--model-path", "HuggingFaceTB/SmolLM2-135M-Instruct"],
        ["--model-path", str(empty)],
        ["--model-path", str(fake)],
    ])
    assert missing == "jaxserve: cannot start: --model-path /no/such/dir: the model path does not exist"
    assert "tokenizer" not in missing
    assert "Hugging Face Hub id" in hub and "no model hub is reachable" in hub
    assert "--model-path DIR" in hub and ".gguf file" in hub
    for line, path in ((not_dir, empty), (not_gguf, fake)):
        assert f"--model-path {path}: not a model" in line
        assert "expected a Hugging Face model directory (config.json, *.safetensors" in line and "or a .gguf file" in line
    assert "it is empty" in not_dir and "GGUF magic" in not_gguf


def test_unsupported_architecture_is_refused_before_any_loading(tmp_path):
    """A GGUF whose header names an architecture jaxserve does not implement, followed by bytes that
    are no GGUF (no vocabulary, no tensors): the refusal names the architecture and the supported ones,
    so it came from the header alone, before any tokenizer or weight work. The same for an HF
    directory whose safetensors file is empty."""
    from tests.model.test_architecture import gguf_header_bytes

    gguf_file = tmp_path / "phi.gguf"
    gguf_file.write_bytes(gguf_header_bytes("phi3"))
    hf_dir = tmp_path / "gpt2"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    (hf_dir / "model.safetensors").write_bytes(b"")
    gguf_line, hf_line = _serve_all([["--model-path", str(gguf_file)], ["--model-path", str(hf_dir)]])
    assert gguf_line == (f"jaxserve: cannot start: --model-path {gguf_file}: unsupported GGUF architecture 'phi3'; "
                         "supported: gemma2, gemma3, llama, qwen2, qwen3")
    assert hf_line == (f"jaxserve: cannot start: --model-path {hf_dir}: unsupported architecture 'GPT2LMHeadModel'; "
                       "supported: Gemma2ForCausalLM, Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM")
