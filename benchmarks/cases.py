"""Benchmark cases: a tool's options kept as a data file, so a number in docs/results.md names the case
that reproduces it (as tpu-inference keeps `.buildkite/benchmark/cases/*.json`).

A case is a JSON object in a `cases/` folder beside its tool:

    {"tool": "benchmarks.serving.bench_serving",
     "description": "random 256 in / 64 out, 64 prompts, 8 in flight",
     "args": {"dataset-name": "random", "random-input-len": 256, "num-prompts": 64,
              "max-concurrency": 8, "seed": 1, "flush-cache": true}}

`args` holds the tool's own options, without the leading `--`: a value is passed as one argument, a
list as several (`nargs`), `true` as a bare flag (`false` leaves it out). `--case NAME|PATH` puts them
before the command line's own arguments, so an option given on the command line overrides the case's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence


def case_argv(case: dict[str, Any]) -> list[str]:
    """The command-line arguments of `case["args"]`; a `{"option": value}` per the module docstring."""
    argv: list[str] = []
    for option, value in case.get("args", {}).items():
        flag = f"--{option}"
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv.append(f"{flag}={value}")  # one argument, so a value such as "--flag x" stays a value
    return argv


def find_case(name_or_path: str, cases_dir: Path, tool: str) -> Path:
    """The case file: a path as given if it exists, else `cases_dir/NAME.json`. Raises ValueError naming
    the cases of `tool` there when neither exists."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    path = cases_dir / f"{name_or_path}.json"
    if path.is_file():
        return path
    names = sorted(p.stem for p in cases_dir.glob("*.json") if json.loads(p.read_text()).get("tool") == tool)
    raise ValueError(f"no case {name_or_path!r}: not a file, and not one of {tool}'s cases in {cases_dir} "
                     f"({', '.join(names) or 'none'})")


def with_case(parser: argparse.ArgumentParser, argv: Sequence[str] | None, cases_dir: Path,
              tool: str) -> list[str]:
    """Adds `--case NAME|PATH` to `parser` and returns the arguments to parse: the case's options (if
    `argv` names a case of `tool`), then `argv` itself (sys.argv[1:] when None). Exits through
    `parser.error` on an unknown case or a case written for another tool."""
    parser.add_argument("--case", metavar="NAME|PATH",
                        help=f"run a case: a JSON file, or the name of one in {cases_dir.name}/ beside this tool "
                             "(benchmarks/cases.py); options given here override the case's")
    argv = list(argv) if argv is not None else sys.argv[1:]
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--case")
    name = pre.parse_known_args(argv)[0].case
    if name is None:
        return argv
    try:
        path = find_case(name, cases_dir, tool)
    except ValueError as e:
        parser.error(str(e))
    case = json.loads(path.read_text())
    if case.get("tool") != tool:
        parser.error(f"case {path} is for {case.get('tool')!r}, not {tool}")
    return case_argv(case) + argv
