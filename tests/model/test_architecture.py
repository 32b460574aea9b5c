"""The architecture check that runs before any tokenizer or weight work (jaxserve.model.architecture)."""

from __future__ import annotations

import json
import struct

import pytest

from jaxserve.model import architecture, registry
from jaxserve.model.architecture import architecture_problem, read_gguf_architecture


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_header_bytes(arch: str, *, keys_before: bool = True) -> bytes:
    """A GGUF v3 header whose `general.architecture` comes after a string, a string array and a
    uint32 array (when `keys_before`), followed by bytes that are no valid GGUF (no tensor infos):
    only a reader that stops at the architecture key gets through it."""
    kvs = []
    if keys_before:
        kvs.append(_gguf_string("general.name") + struct.pack("<I", 8) + _gguf_string("test model"))
        tokens = [f"tok{i}" for i in range(1000)]
        kvs.append(_gguf_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, len(tokens))
                   + b"".join(_gguf_string(t) for t in tokens))
        kvs.append(_gguf_string("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 4, 1000) + bytes(4000))
        kvs.append(_gguf_string("x.flag") + struct.pack("<I", 7) + b"\x01")
    kvs.append(_gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string(arch))
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs) + 5)
    return header + b"".join(kvs) + b"\xff" * 64


def test_reads_the_architecture_past_other_keys(tmp_path):
    for keys_before in (False, True):
        path = tmp_path / f"m{keys_before}.gguf"
        path.write_bytes(gguf_header_bytes("phi3", keys_before=keys_before))
        assert read_gguf_architecture(str(path)) == "phi3"


def test_reads_what_the_gguf_package_reads():
    import gguf

    from jaxserve.model.tokenizer import default_model_path

    path = default_model_path()
    assert read_gguf_architecture(path) == gguf.GGUFReader(path).fields["general.architecture"].contents() == "llama"


def test_unsupported_gguf_is_named_with_the_supported_list(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_header_bytes("phi3"))
    problem = architecture_problem(str(path))
    assert problem == f"unsupported GGUF architecture 'phi3'; supported: {', '.join(sorted(architecture.GGUF_ARCHITECTURES))}"
    path.write_bytes(gguf_header_bytes("qwen2"))
    assert architecture_problem(str(path)) is None


def test_unsupported_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert architecture_problem(str(tmp_path)) == (
        f"unsupported architecture 'GPT2LMHeadModel'; supported: {', '.join(architecture.ARCHITECTURES)}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    assert architecture_problem(str(tmp_path)) is None


def test_truncated_header_is_an_error(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_header_bytes("phi3")[:40])
    with pytest.raises(ValueError, match="truncated GGUF header"):
        read_gguf_architecture(str(path))


def test_tables_match_the_registry():
    assert sorted(architecture.ARCHITECTURES) == sorted(registry.ARCHITECTURES)
    assert set(architecture.GGUF_ARCHITECTURES.values()) <= set(registry.ARCHITECTURES)
    assert set(architecture.MODEL_TYPES.values()) <= set(registry.ARCHITECTURES)


def test_engine_refuses_before_the_tokenizer(tmp_path):
    from jaxserve.engine.engine import Engine

    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_header_bytes("phi3"))  # no vocabulary: building a tokenizer would fail otherwise
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi3'; supported: "):
        Engine(model_path=str(path), disable_precompile=True)
