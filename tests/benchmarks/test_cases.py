"""benchmarks/cases.py: `--case NAME|PATH` puts a case file's options before the command line's, and every
case file in the tree parses with its tool's own options (no server, no model)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.cases import case_argv, with_case

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
CASE_FILES = sorted(BENCHMARKS.glob("*/cases/*.json"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=1)
    p.add_argument("--flags", default="")
    p.add_argument("--workloads", nargs="+", default=[])
    p.add_argument("--flush-cache", action="store_true")
    return p


def _write_case(tmp_path: Path, args: dict, tool: str = "t") -> Path:
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"tool": tool, "description": "d", "args": args}))
    return path


def test_case_argv_forms():
    case = {"args": {"num-prompts": 8, "flags": "--speculative-algorithm NGRAM", "workloads": ["a:1:2", "b:8:16"],
                     "flush-cache": True, "disable-tqdm": False}}
    assert case_argv(case) == ["--num-prompts=8", "--flags=--speculative-algorithm NGRAM",
                               "--workloads", "a:1:2", "b:8:16", "--flush-cache"]


def test_command_line_overrides_the_case(tmp_path):
    path = _write_case(tmp_path, {"num-prompts": 8, "flags": "--x 1", "workloads": ["a:1:2"], "flush-cache": True})
    p = _parser()
    args = p.parse_args(with_case(p, ["--case", str(path), "--num-prompts", "3"], tmp_path, "t"))
    assert (args.num_prompts, args.flags, args.workloads, args.flush_cache) == (3, "--x 1", ["a:1:2"], True)
    p = _parser()
    args = p.parse_args(with_case(p, ["--case", "one"], tmp_path, "t"))  # by name, from the cases folder
    assert args.num_prompts == 8
    p = _parser()
    assert p.parse_args(with_case(p, ["--num-prompts", "2"], tmp_path, "t")).num_prompts == 2  # no case


def test_unknown_case_and_another_tools_case_are_refused(tmp_path, capsys):
    path = _write_case(tmp_path, {"num-prompts": 8}, tool="other")
    with pytest.raises(SystemExit):
        with_case(_parser(), ["--case", "missing"], tmp_path, "t")
    assert "no case 'missing'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        with_case(_parser(), ["--case", str(path)], tmp_path, "t")
    assert "is for 'other'" in capsys.readouterr().err


def test_case_files_exist_for_the_serving_offline_and_llama_server_tools():
    tools = {json.loads(p.read_text())["tool"] for p in CASE_FILES}
    assert {"benchmarks.serving.bench_serving", "benchmarks.serving.bench_decode_latency",
            "benchmarks.offline.bench_offline", "benchmarks.llama_server.bench_vs_llama_server"} <= tools


@pytest.mark.parametrize("path", CASE_FILES, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_every_case_parses_with_its_tool(path):
    case = json.loads(path.read_text())
    assert case["description"] and case["args"]
    tool = case["tool"]
    if tool == "benchmarks.serving.bench_serving":
        from benchmarks.serving import bench_serving

        args = bench_serving.parse_args(["--case", path.stem])
    else:
        module = __import__(tool, fromlist=["build_parser"])
        required = ["--llama-server", "llama-server"] if tool.endswith("bench_vs_llama_server") else []
        p = module.build_parser()
        args = p.parse_args(with_case(p, ["--case", str(path), *required], path.parent, tool))
    for option, value in case["args"].items():
        got = getattr(args, option.replace("-", "_"))
        assert got == value or str(got) == str(value) or float(got) == value, option
