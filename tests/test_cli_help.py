"""`serve.py --help`: flags grouped by their `group` metadata, every None default explained, examples
and the docs link at the end."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from jaxserve.server_args import FLAG_GROUPS, ServerArgs


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


# the flags of a launch_server command line copied from SGLang's docs and scripts
SGLANG_COMMAND = ("--model-path /models/m --port 30001 --enable-metrics --trust-remote-code --log-requests "
                  "--disable-cuda-graph --kv-cache-dtype auto --enable-cache-report --tokenizer-mode auto "
                  "--watchdog-timeout 300 --device cpu --disable-overlap-schedule").split()


def test_a_copied_sglang_command_line_parses_and_resolves_on_cpu():
    args = ServerArgs.from_cli(SGLANG_COMMAND)
    assert (args.enable_metrics, args.trust_remote_code, args.log_requests, args.disable_cuda_graph,
            args.enable_cache_report) == (True,) * 5
    assert (args.kv_cache_dtype, args.tokenizer_mode, args.watchdog_timeout, args.device) == ("auto", "auto", 300.0, "cpu")
    assert args.disable_overlap_schedule
    assert args.port == 30001 and not args.disable_metrics  # --enable-metrics keeps /metrics on
    resolved = args.resolved("cpu")
    assert resolved.device == "cpu" and resolved.log_requests
    # the pool's own dtype, in jaxserve's or SGLang's spelling
    ServerArgs.from_cli([*SGLANG_COMMAND, "--kv-cache-dtype", "float32"]).resolved("cpu")
    ServerArgs.from_cli(["--kv-cache-dtype", "bf16", "--device", "cuda"]).resolved("gpu")
    ServerArgs.from_cli(["--kv-cache-dtype", "fp16", "--dtype", "float16"]).resolved("cpu")
    # a compressed pool, on any platform
    for value in ("fp8_e4m3", "fp8_e5m2", "int8", "FP8_E4M3"):
        assert ServerArgs.from_cli(["--kv-cache-dtype", value]).resolved("cpu").kv_cache_quantization == value.lower()
    assert ServerArgs.from_cli([]).kv_cache_quantization is None


def test_kv_cache_quantized_names_are_the_pools():
    """server_args names the compressed pools without importing them: the two lists must agree."""
    from jaxserve.pallas.quantized_kv import KV_QUANT_DTYPES
    from jaxserve.server_args import KV_CACHE_QUANTIZED

    assert set(KV_CACHE_QUANTIZED) == set(KV_QUANT_DTYPES)


@pytest.mark.parametrize("argv, platform, message", [
    (["--device", "cuda"], "cpu", "--device cuda: this process runs on the JAX platform 'cpu'"),
    (["--device", "npu"], "cpu", "--device npu"),
    (["--kv-cache-dtype", "fp4_e2m1"], "cpu", "--kv-cache-dtype 'fp4_e2m1' is not a KV cache dtype: give auto, float32 (the model's, --dtype), or a compressed pool: fp8_e4m3, fp8_e5m2, int8"),
    (["--kv-cache-dtype", ""], "cpu", "--kv-cache-dtype '' is not a KV cache dtype"),
    (["--kv-cache-dtype", "fp16"], "cpu", "--kv-cache-dtype fp16: a float KV pool is stored in the model's dtype, float32"),
    (["--kv-cache-dtype", "bfloat16"], "cpu", "give auto, float32, or a compressed pool: fp8_e4m3, fp8_e5m2, int8"),
    (["--kv-cache-dtype", "float32"], "tpu", "bfloat16 here"),
])
def test_device_and_kv_cache_dtype_outside_what_runs_are_clear_errors(argv, platform, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerArgs.from_cli(argv).resolved(platform)


def test_tokenizer_mode_other_than_auto_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        ServerArgs.from_cli(["--tokenizer-mode", "slow"])
    assert e.value.code == 2 and "--tokenizer-mode" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    # accepted, then the first decode step divided by it: the engine died (ZeroDivisionError)
    (["--decode-log-interval", "0"], "--decode-log-interval must be >= 1, got 0"),
    (["--decode-log-interval", "-3"], "--decode-log-interval must be >= 1, got -3"),
    # refused only after the model loaded, over four lines, with exit status 1
    (["--constrained-json-whitespace-pattern", "("], "--constrained-json-whitespace-pattern '(' is not a valid regex: regex parse error: ( ^ error: unclosed group"),
])
def test_bad_flag_values_are_one_line_errors_before_start_up(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        ServerArgs.from_cli(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines()[-1] == f"serve.py: error: {message}", err


def test_a_valid_whitespace_pattern_is_accepted():
    assert ServerArgs.from_cli(["--constrained-json-whitespace-pattern", "[ \\t]{0,4}"]).constrained_json_whitespace_pattern == "[ \\t]{0,4}"
