"""The GGUF header reader (jaxserve.model.gguf_header) against the `gguf` package's GGUFReader."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.model.gguf_header import read_gguf_header, read_gguf_value
from tests.model.gguf_reference import assert_same_values

gguf = pytest.importorskip("gguf")


def reader_header(path: str) -> tuple[dict, list[tuple], int]:
    """GGUFReader's metadata (as `contents()`), tensor infos and data offset, in `read_gguf_header`'s form."""
    reader = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), t.data_offset - reader.data_offset)
               for t in reader.tensors]
    return metadata, tensors, reader.data_offset


def assert_reads_what_gguf_reads(path: str) -> None:
    header = read_gguf_header(path)
    metadata, tensors, data_offset = reader_header(path)
    assert_same_values(header.metadata, metadata)
    assert [tuple(t) for t in header.tensors] == tensors
    assert header.data_offset == data_offset
    tokenizer_keys = {k for k in metadata if k.startswith("tokenizer.ggml.") and not k.endswith("_token_id")}
    assert tokenizer_keys  # the real files carry a vocabulary: the skipping below is exercised
    skipped = read_gguf_header(path, keep_key=lambda k: k not in tokenizer_keys)
    assert skipped.metadata == {k: v for k, v in metadata.items() if k not in tokenizer_keys}
    assert skipped.tensors == header.tensors  # the tensor infos after the skipped arrays are found
    assert skipped.data_offset == header.data_offset


def write_gguf(path, endianess=None, alignment: int | None = None) -> str:
    """Every value type: scalars, a string, arrays of ints, floats, bools and strings (an empty one too),
    and two tensors, one 1-D; `general.alignment` only if `alignment` is given."""
    kwargs = {} if endianess is None else {"endianess": endianess}
    w = gguf.GGUFWriter(str(path), "llama", **kwargs)
    if alignment is not None:
        w.add_custom_alignment(alignment)
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
    w.add_tensor("b.weight", np.ones(5, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("endianess", ["little", "big"])
def test_every_value_type_reads_as_gguf_reads_it(tmp_path, endianess):
    path = write_gguf(tmp_path / "m.gguf", gguf.GGUFEndian.LITTLE if endianess == "little" else gguf.GGUFEndian.BIG)
    header = read_gguf_header(path)
    assert_same_values(header.metadata, reader_header(path)[0])
    assert header.metadata["t.strings"] == ["a", "", "ünï"] and header.metadata["t.u64"] == 2**40
    assert [(t.name, t.shape) for t in header.tensors] == [("a.weight", (3, 2)), ("b.weight", (5,))]
    assert [tuple(t) for t in header.tensors] == reader_header(path)[1]
    assert header.data_offset == reader_header(path)[2] and header.data_offset % 32 == 0
    assert header.byteorder == ("<" if endianess == "little" else ">")
    assert read_gguf_value(path, "t.bools") == [True, False]
    assert read_gguf_value(path, "general.architecture") == "llama"


def test_skipping_keeps_the_rest(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    header = read_gguf_header(path, keep_key=lambda k: k in ("t.f64", "t.bool"))
    assert header.metadata == {"t.f64": 1e-300, "t.bool": True}
    assert [t.name for t in header.tensors] == ["a.weight", "b.weight"]


@pytest.mark.parametrize("alignment", [64, 1])
def test_general_alignment_places_the_data_as_gguf_places_it(tmp_path, alignment):
    path = write_gguf(tmp_path / "m.gguf", alignment=alignment)
    data_offset = reader_header(path)[2]
    assert data_offset % alignment == 0 and (alignment == 1 or data_offset % 64 == 0)
    for keep in (lambda k: True, lambda k: False):  # read whether kept or not
        assert read_gguf_header(path, keep_key=keep).data_offset == data_offset


def write_alignment_gguf(path, add_value) -> bytes:
    """A file whose `general.alignment` is `add_value(writer)`'s; the writer itself still aligns to 32."""
    w = gguf.GGUFWriter(str(path), "llama")
    add_value(w)
    w.add_tensor("a.weight", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_what_gguf_reader_refuses_is_refused(tmp_path):
    """A key or tensor name given twice, a general.alignment that is no power of two or not a uint32:
    GGUFReader raises on each (checked here too), and so does `read_gguf_header`, with a message."""
    data = open(write_gguf(tmp_path / "m.gguf"), "rb").read()
    cases = {
        "dup_key": (data.replace(b"t.i8", b"t.u8"), "GGUF key t.u8 is given twice"),
        "dup_tensor": (data.replace(b"b.weight", b"a.weight"), "GGUF tensor a.weight is given twice"),
        "align48": (write_alignment_gguf(tmp_path / "a48.gguf", lambda w: w.add_uint32("general.alignment", 48)),
                    "general.alignment must be a uint32 power of two, got 48"),
        "align0": (write_alignment_gguf(tmp_path / "a0.gguf", lambda w: w.add_uint32("general.alignment", 0)),
                   "general.alignment must be a uint32 power of two, got 0"),
        "align_u64": (write_alignment_gguf(tmp_path / "a64.gguf", lambda w: w.add_uint64("general.alignment", 64)),
                      "general.alignment must be a uint32 power of two, got 64"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"bad_{name}.gguf"
        path.write_bytes(content)
        with pytest.raises((ValueError, KeyError)):
            gguf.GGUFReader(str(path))
        with pytest.raises(ValueError, match=message):
            read_gguf_header(str(path))


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
    in_strings = data.index("ünï".encode()) + 1  # inside a string array's last string
    for size, message in [(0, "truncated GGUF header"), (10, "truncated GGUF header"), (cut, "truncated GGUF header"),
                          (in_strings, "truncated GGUF header")]:
        (tmp_path / "cut.gguf").write_bytes(data[:size])
        with pytest.raises(ValueError, match=message):
            read_gguf_header(str(tmp_path / "cut.gguf"))
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_header(str(tmp_path / "bad.gguf"))
    (tmp_path / "v1.gguf").write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        read_gguf_header(str(tmp_path / "v1.gguf"))

