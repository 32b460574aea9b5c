"""The GGUF header reader (jaxserve.model.gguf_header) against the `gguf` package's GGUFReader."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.model.gguf_header import read_gguf_header, read_gguf_value

gguf = pytest.importorskip("gguf")


def reader_header(path: str) -> tuple[dict, list[tuple]]:
    """GGUFReader's metadata (as `contents()`) and tensor infos, in `read_gguf_header`'s form."""
    reader = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), t.data_offset - reader.data_offset)
               for t in reader.tensors]
    return metadata, tensors


def assert_reads_what_gguf_reads(path: str) -> None:
    header = read_gguf_header(path)
    metadata, tensors = reader_header(path)
    assert header.metadata == metadata
    assert [tuple(t) for t in header.tensors] == tensors
    tokenizer_keys = {k for k in metadata if k.startswith("tokenizer.ggml.") and not k.endswith("_token_id")}
    assert tokenizer_keys  # the real files carry a vocabulary: the skipping below is exercised
    skipped = read_gguf_header(path, keep_key=lambda k: k not in tokenizer_keys)
    assert skipped.metadata == {k: v for k, v in metadata.items() if k not in tokenizer_keys}
    assert skipped.tensors == header.tensors  # the tensor infos after the skipped arrays are found


def write_gguf(path, endianess=None) -> str:
    """Every value type: scalars, a string, arrays of ints, floats, bools and strings (an empty one too),
    and two tensors, one 1-D."""
    kwargs = {} if endianess is None else {"endianess": endianess}
    w = gguf.GGUFWriter(str(path), "llama", **kwargs)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.bools", [True, False])
    w.add_array("t.strings", ["a", "", "ünï"])
    w.add_array("t.empty", [])
    w.add_tensor("a.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("b.bias", np.ones(5, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("endianess", ["little", "big"])
def test_every_value_type_reads_as_gguf_reads_it(tmp_path, endianess):
    path = write_gguf(tmp_path / "m.gguf", gguf.GGUFEndian.LITTLE if endianess == "little" else gguf.GGUFEndian.BIG)
    header = read_gguf_header(path)
    assert header.metadata == reader_header(path)[0]
    assert header.metadata["t.strings"] == ["a", "", "ünï"] and header.metadata["t.u64"] == 2**40
    assert [(t.name, t.shape) for t in header.tensors] == [("a.weight", (3, 2)), ("b.bias", (5,))]
    assert [tuple(t) for t in header.tensors] == reader_header(path)[1]
    assert read_gguf_value(path, "t.bools") == [True, False]
    assert read_gguf_value(path, "general.architecture") == "llama"


def test_skipping_keeps_the_rest(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    header = read_gguf_header(path, keep_key=lambda k: k in ("t.f64", "t.bool"))
    assert header.metadata == {"t.f64": 1e-300, "t.bool": True}
    assert [t.name for t in header.tensors] == ["a.weight", "b.bias"]


def test_the_default_model_reads_as_gguf_reads_it():
    from jaxserve.model.tokenizer import default_model_path

    assert_reads_what_gguf_reads(default_model_path())


@pytest.mark.slow  # GGUFReader takes about 8 s over Gemma 3's 262,144-entry vocabulary
def test_gemma3_reads_as_gguf_reads_it(gemma3_gguf):
    assert_reads_what_gguf_reads(gemma3_gguf)
    assert read_gguf_value(gemma3_gguf, "gemma3.attention.sliding_window") == 512


def test_errors(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="has no t.nope"):
        read_gguf_value(path, "t.nope")
    data = (tmp_path / "m.gguf").read_bytes()
    cut = data.index(b"t.strings")  # inside the key/value pairs
    for size, message in [(0, "truncated GGUF header"), (10, "truncated GGUF header"), (cut, "truncated GGUF header")]:
        (tmp_path / "cut.gguf").write_bytes(data[:size])
        with pytest.raises(ValueError, match=message):
            read_gguf_header(str(tmp_path / "cut.gguf"))
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_header(str(tmp_path / "bad.gguf"))
    (tmp_path / "v1.gguf").write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        read_gguf_header(str(tmp_path / "v1.gguf"))
