"""Benchmarks a user runs, grouped by subject; benchmarks/README.md lists them. Run each from the
repository root as a module: `python -m benchmarks.serving.bench_serving --help`."""
