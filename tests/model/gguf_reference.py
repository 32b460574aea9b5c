"""The `gguf` package's GGUFReader as the reference for jaxserve's own GGUF reading (gguf_header, the
loader's tensor views, the tokenizer metadata): what the code read through it before."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.model.gguf_header import GGUFTensorInfo


def reader_metadata(path: str, keep_key=lambda key: True) -> dict:
    """GGUFReader's key/value pairs as `ReaderField.contents()` gives them (its own GGUF.* entries left out)."""
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.") and keep_key(k)}


def reader_tensors(path: str) -> list[tuple[GGUFTensorInfo, np.ndarray]]:
    """GGUFReader's tensors in `loader.read_gguf_tensors`' form: (info, `ReaderTensor.data`)."""
    import gguf

    reader = gguf.GGUFReader(path)
    return [(GGUFTensorInfo(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), t.data_offset - reader.data_offset),
             t.data) for t in reader.tensors]


def load_model_through_gguf_reader(path: str, dtype: str):
    """`load_model` with GGUFReader's tensor data in place of `read_gguf_tensors`' views (weights cache off)."""
    from jaxserve.model import loader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "read_gguf_tensors", lambda p, header: iter(reader_tensors(p)))
        return loader.load_model(path, dtype, use_weights_cache=False)


def assert_same_values(ours, ref, where: str = "") -> None:
    """Equal and of the same Python type, element by element (1 == True == 1.0 would pass a plain ==)."""
    assert type(ours) is type(ref), f"{where}: {type(ours).__name__} vs {type(ref).__name__}"
    if isinstance(ref, dict):
        assert list(ours) == list(ref), where
        for key in ref:
            assert_same_values(ours[key], ref[key], f"{where}[{key!r}]")
    elif isinstance(ref, list):
        assert len(ours) == len(ref), where
        assert {type(x) for x in ours} == {type(x) for x in ref}, where
        assert ours == ref, where
    else:
        assert ours == ref, where


def assert_same_tensors(ours: list[tuple[GGUFTensorInfo, np.ndarray]], ref: list[tuple[GGUFTensorInfo, np.ndarray]]) -> None:
    """Same infos, and data of the same dtype (byte order included), shape and bytes."""
    assert [info for info, _ in ours] == [info for info, _ in ref]
    for (info, a), (_, b) in zip(ours, ref):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), info.name
        assert np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)), info.name
