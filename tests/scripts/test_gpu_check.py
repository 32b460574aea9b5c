"""scripts/gpu_check.py's engine check, in its CPU smoke form on the tiny random Llama (on a GPU it runs
the default model with the GPU's defaults; no GPU is lent to CI)."""

from __future__ import annotations

import pytest

from jaxserve.quant import formats
from tests.scripts import load_script


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


def test_engine_check_passes_on_the_tiny_model(gpu_check, tiny_model_dir):
    report = gpu_check.Report()
    rows = gpu_check.run_engine_check(tiny_model_dir, report, on_gpu=False)
    assert report.failures == []
    assert set(rows) == set(gpu_check.ENGINE_VARIANTS)
    # the overlap variants report overlapped steps, the reference none
    assert rows["overlap off"]["overlapped"] == 0
    assert rows["overlap on"]["overlapped"] > 0


def test_engine_check_reports_differing_outputs(gpu_check, tiny_model_dir, monkeypatch):
    """A variant whose outputs differ (here: another sampling seed with temperature) is a failure."""
    variants = dict(gpu_check.ENGINE_VARIANTS)
    variants["overlap on"] = {**variants["overlap on"], "random_seed": 1}
    monkeypatch.setattr(gpu_check, "ENGINE_VARIANTS", variants)
    real = gpu_check.engine_request_params
    monkeypatch.setattr(gpu_check, "engine_request_params",
                        lambda free: [{**p, "temperature": 1.0} for p in real(free)])
    report = gpu_check.Report()
    gpu_check.run_engine_check(tiny_model_dir, report, on_gpu=False)
    assert any("overlap on: greedy outputs differ" in f for f in report.failures)


def test_quant_matmul_check_passes_in_interpret_mode(gpu_check, capsys):
    report = gpu_check.Report()
    gpu_check.run_quant_matmul_check(on_gpu=False, iters=1, report=report)
    assert report.failures == []
    assert capsys.readouterr().out.count(" ok") == 3 * len(formats.FORMATS)  # every format at T = 1, 8, 256
