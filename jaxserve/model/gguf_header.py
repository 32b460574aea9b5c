"""A GGUF file's header (key/value metadata and tensor infos), read without the values nobody asked for.

`gguf.GGUFReader` parses every key/value pair into numpy views, one per array element: for Gemma 3's
262,144-entry vocabulary (tokens, scores, token types) that takes seconds (8 s on the shared 2-core
machine), and the `gguf` package offers no way to read part of a header. This reader walks the same
layout (llama.cpp's gguf spec: magic, version, tensor count, key/value count, the pairs, one info per
tensor, then the data section at the next multiple of `general.alignment`) over a memory map, decodes
the keys a caller keeps and skips the others by their sizes: a scalar array is one jump, a string
array one length read per string. Kept arrays decode in one `struct` call (scalars) or one tight loop
(strings): Gemma 3's whole header in 0.1 s. tests/model/test_gguf_header.py checks it against
`GGUFReader` on the real GGUFs. It imports neither numpy, jax nor gguf, so the architecture check
(`jaxserve.model.architecture`) can use it before anything heavy loads; the loader views the tensors'
data at `data_offset` (`loader.read_gguf_tensors`).
"""

from __future__ import annotations

import mmap
import struct
from typing import Any, Callable, NamedTuple

_MAGIC = b"GGUF"
# GGUF value types (llama.cpp's gguf spec) -> struct format of the scalar types; 8 is a string, 9 an array
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_UINT32 = 4
_ALIGNMENT_KEY = "general.alignment"
_DEFAULT_ALIGNMENT = 32  # llama.cpp's GGUF_DEFAULT_ALIGNMENT


class GGUFTensorInfo(NamedTuple):
    """One tensor's info: `shape` in GGUF order (fastest-varying dimension first, as `GGUFReader`'s
    `ReaderTensor.shape`), `ggml_type` the `GGMLQuantizationType` value, `offset` in bytes from the
    start of the data section."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


class GGUFHeader(NamedTuple):
    """`metadata`: key -> value as `ReaderField.contents()` gives it (str, int, float, bool, or a list
    for an array), for the keys kept; `tensors`: the tensor infos in file order; `data_offset`: where
    the data section starts, in bytes from the start of the file (`GGUFReader.data_offset`);
    `byteorder`: the struct/numpy byte order of the file's numbers, "<" or ">"."""

    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    data_offset: int
    byteorder: str


def read_gguf_header(path: str, keep_key: Callable[[str], bool] = lambda key: True) -> GGUFHeader:
    """The metadata whose keys `keep_key` accepts (the others are skipped unread) and every tensor info.

    `general.alignment` is read whether kept or not: it places the data section.

    Raises:
        ValueError: not a GGUF file, a version before 2, a truncated header, an unknown value type, a
            key or tensor name given twice, or a `general.alignment` that is not a uint32 power of two
            (the checks `GGUFReader` makes).
    """
    with _HeaderCursor(path) as cursor:
        metadata, seen, alignment = {}, set(), _DEFAULT_ALIGNMENT
        for key, value_type in cursor.keys():
            if key in seen:
                raise ValueError(f"{path}: GGUF key {key} is given twice")
            seen.add(key)
            if key == _ALIGNMENT_KEY:
                value = cursor.value(value_type)
                if value_type != _UINT32 or value <= 0 or value & (value - 1):
                    raise ValueError(f"{path}: {_ALIGNMENT_KEY} must be a uint32 power of two, got {value!r}")
                alignment = value
                if keep_key(key):
                    metadata[key] = value
            elif keep_key(key):
                metadata[key] = cursor.value(value_type)
            else:
                cursor.skip(value_type)
        tensors = cursor.tensor_infos()
        data_offset = -(-cursor.pos // alignment) * alignment
        return GGUFHeader(cursor.version, metadata, tensors, data_offset, cursor.order)


def read_gguf_value(path: str, key: str) -> Any:
    """The value of one metadata key, reading the header only up to it (the keys before it are skipped).

    Raises:
        ValueError: not a GGUF file, a version before 2, a truncated header, an unknown value type, or
            no such key.
    """
    with _HeaderCursor(path) as cursor:
        for name, value_type in cursor.keys():
            if name == key:
                return cursor.value(value_type)
            cursor.skip(value_type)
    raise ValueError(f"{path}: the GGUF header has no {key}")


class _HeaderCursor:
    """A read position in a memory-mapped GGUF file, past the fixed part of the header once opened."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            try:
                self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise ValueError(f"{path}: truncated GGUF header") from None
        self.pos = 0
        self.order = "<"
        try:
            if self.read(4) != _MAGIC:
                raise ValueError(f"{path}: not a GGUF file (no GGUF magic bytes)")
            version = self.unpack("I")
            if version & 0xFFFF == 0:  # written on a big-endian host (as GGUFReader detects it)
                self.order = ">"
                version = struct.unpack(">I", struct.pack("<I", version))[0]
            if version < 2:
                raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")
            self.version = version
            self.num_tensors = self.unpack("Q")
            self.num_keys = self.unpack("Q")
        except BaseException:
            self.buf.close()
            raise

    def __enter__(self) -> "_HeaderCursor":
        return self

    def __exit__(self, *exc) -> None:
        self.buf.close()

    def read(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header")
        b = self.buf[self.pos : self.pos + n]
        self.pos += n
        return b

    def unpack(self, fmt: str) -> Any:
        return self.unpack_array(fmt, 1)[0]

    def unpack_array(self, fmt: str, count: int) -> list:
        fmt = f"{self.order}{count}{fmt}"
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header")
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return list(values)

    def string(self) -> str:
        return self.read(self.unpack("Q")).decode("utf-8", errors="replace")

    def keys(self):
        """(key, value type) of each pair in turn; the caller reads or skips the value before the next."""
        for _ in range(self.num_keys):
            yield self.string(), self.unpack("I")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])
        if value_type == _ARRAY:
            item_type, count = self.unpack("I"), self.unpack("Q")
            if item_type in _SCALAR_FORMATS:
                return self.unpack_array(_SCALAR_FORMATS[item_type], count)
            if item_type == _STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF value type {value_type}")

    def skip(self, value_type: int) -> None:
        if value_type == _STRING:
            self.pos += 8 + self.unpack("Q")
        elif value_type in _SCALAR_FORMATS:
            self.pos += struct.calcsize(_SCALAR_FORMATS[value_type])
        elif value_type == _ARRAY:
            item_type, count = self.unpack("I"), self.unpack("Q")
            if item_type in _SCALAR_FORMATS:
                self.pos += struct.calcsize(_SCALAR_FORMATS[item_type]) * count
            elif item_type == _STRING:
                self.skip_strings(count)
            else:
                for _ in range(count):
                    self.skip(item_type)
        else:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type}")
        if self.pos > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header")

    def strings(self, count: int) -> list[str]:
        # the vocabulary's loop when it is kept: 262,144 strings, so no per-string method calls
        buf, pos, end, length = self.buf, self.pos, len(self.buf), struct.Struct(f"{self.order}Q")
        out = []
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError(f"{self.path}: truncated GGUF header")
            n = length.unpack_from(buf, pos)[0]
            pos += 8
            if pos + n > end:
                raise ValueError(f"{self.path}: truncated GGUF header")
            out.append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def skip_strings(self, count: int) -> None:
        # the vocabulary's loop: one length read per string, nothing decoded
        buf, pos, end, length = self.buf, self.pos, len(self.buf), struct.Struct(f"{self.order}Q")
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError(f"{self.path}: truncated GGUF header")
            pos += 8 + length.unpack_from(buf, pos)[0]
        self.pos = pos

    def tensor_infos(self) -> list[GGUFTensorInfo]:
        infos, names = [], set()
        for _ in range(self.num_tensors):
            name = self.string()
            if name in names:
                raise ValueError(f"{self.path}: GGUF tensor {name} is given twice")
            names.add(name)
            shape = tuple(self.unpack_array("Q", self.unpack("I")))
            infos.append(GGUFTensorInfo(name, shape, self.unpack("I"), self.unpack("Q")))
        return infos
