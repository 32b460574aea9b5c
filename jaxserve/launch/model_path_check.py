"""What a new user typed as --model-path, checked before anything loads, with a message that says
what to do: a missing path, a Hugging Face Hub id (jaxserve never downloads: no hub is reachable),
an empty or foreign directory, a file named .gguf that is not one, or a model whose architecture
jaxserve does not implement (read from config.json or the GGUF header alone, in milliseconds, before
any tokenizer or weight work; `jaxserve.model.architecture`).

    problem = model_path_problem("HuggingFaceTB/SmolLM2-135M-Instruct")   # -> a message, or None
"""

from __future__ import annotations

import glob
import os
import re

from jaxserve.model.architecture import architecture_problem

GGUF_MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file (llama.cpp's gguf spec)
# owner/name, as the Hub spells repository ids (letters, digits, '-', '_', '.')
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
EXPECTED = (
    "expected a Hugging Face model directory (config.json, *.safetensors weights and the tokenizer "
    "files) or a .gguf file (llama.cpp's format)"
)


def model_path_problem(path: str) -> str | None:
    """Why `path` cannot be a model (a message naming the path and what to pass instead), or None
    when it looks loadable ("default", a GGUF file or a directory with config.json and safetensors,
    of an architecture jaxserve implements). Reads config.json or a GGUF file's header up to
    `general.architecture`; never touches the network."""
    if path == "default":
        return None
    if not os.path.exists(path):
        if _HUB_ID.match(path) and not path.startswith("."):
            return (
                f"--model-path {path}: no such local path. It looks like a Hugging Face Hub id, but "
                "jaxserve loads local files only and no model hub is reachable from here. Download it "
                f"where there is internet (huggingface-cli download {path} --local-dir DIR) and pass "
                "--model-path DIR, or pass a .gguf file, or leave --model-path out for the default "
                "model (SmolLM2-135M-Instruct)."
            )
        return f"--model-path {path}: the model path does not exist"
    if os.path.isdir(path):
        has_config = os.path.isfile(os.path.join(path, "config.json"))
        has_weights = bool(glob.glob(os.path.join(path, "*.safetensors")))
        if not (has_config and has_weights):
            found = "it is empty" if not os.listdir(path) else (
                "it has no config.json" if not has_config else "it has no *.safetensors weights")
            return f"--model-path {path}: not a model ({found}); {EXPECTED}"
        return _architecture_problem(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as e:
        return f"--model-path {path}: cannot read it: {e.strerror or e}"
    if magic != GGUF_MAGIC:
        what = "named .gguf, but it does not start with the GGUF magic bytes" if path.endswith(".gguf") else "a file that is not GGUF"
        return f"--model-path {path}: not a model ({what}); {EXPECTED}"
    return _architecture_problem(path)


def _architecture_problem(path: str) -> str | None:
    try:
        problem = architecture_problem(path)
    except (OSError, ValueError) as e:
        return f"--model-path {path}: {e}"
    return None if problem is None else f"--model-path {path}: {problem}"
