"""The `gguf` package's GGUFReader as the reference for jaxserve's own GGUF reading (gguf_header): what
the code read through it before."""

from __future__ import annotations


def reader_metadata(path: str, keep_key=lambda key: True) -> dict:
    """GGUFReader's key/value pairs as `ReaderField.contents()` gives them (its own GGUF.* entries left out)."""
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.") and keep_key(k)}


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

