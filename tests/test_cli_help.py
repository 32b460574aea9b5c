"""`serve.py --help`: flags grouped by their `group` metadata, every None default explained, examples
and the docs link at the end."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from jaxserve.config import FLAG_GROUPS, ServerArgs


def _help() -> str:
    parser = argparse.ArgumentParser(prog="serve.py", formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    return parser.format_help()


def _sections(text: str) -> dict[str, list[str]]:
    """Section title -> the flags listed under it (argparse prints "title:" then indented options)."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            sections[current] = []
        elif current and line.startswith("  --"):
            sections[current].append(line.split()[0].rstrip(","))  # "--flag, --no-flag"
    return sections


def test_every_field_has_a_known_group_and_shows_under_it():
    sections = _sections(_help())
    for f in dataclasses.fields(ServerArgs):
        group = f.metadata.get("group")
        assert group in FLAG_GROUPS and group != "other", f"{f.name} has no group= (got {group!r})"
        assert "--" + f.name.replace("_", "-") in sections[FLAG_GROUPS[group]], f.name
    for title in ("model and execution", "HTTP server", "memory (KV pool)", "scheduling and admission",
                  "radix cache and release policy", "structured output", "observability"):
        assert sections[title], title


def test_a_field_without_a_group_is_listed_under_other():
    @dataclasses.dataclass(frozen=True)
    class Extended(ServerArgs):
        brand_new_flag: int = dataclasses.field(default=3, metadata={"help": "an engineer's new flag"})

    original = dataclasses.fields
    try:  # add_cli_args reads dataclasses.fields(ServerArgs): hand it Extended's fields instead
        dataclasses.fields = lambda cls: original(Extended) if cls is ServerArgs else original(cls)
        parser = argparse.ArgumentParser(prog="serve.py")
        ServerArgs.add_cli_args(parser)
    finally:
        dataclasses.fields = original
    assert _sections(parser.format_help())["other"] == ["--brand-new-flag"]


def test_every_none_default_says_what_none_means():
    text = _help()
    for f in dataclasses.fields(ServerArgs):
        if f.default is None:
            help_ = f.metadata["help"]
            assert "(default" in help_, f"--{f.name}: say what None means"
    assert "(default: None)" not in text


def test_help_ends_with_examples_and_the_docs_link(capsys):
    try:
        ServerArgs.from_cli(["--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    tail = out[out.index("examples:"):]
    assert tail.count("python scripts/serve.py") == 2 and "docs/api.md" in tail
    assert out.rstrip().endswith("(quick start).")


def test_the_readme_flag_table_lists_every_flag():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for f in dataclasses.fields(ServerArgs):
        assert f"| `--{f.name.replace('_', '-')}` |" in readme, f"README.md's flag table lacks --{f.name}"
