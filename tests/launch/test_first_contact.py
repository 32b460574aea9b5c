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
