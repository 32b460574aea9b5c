"""scripts/bench_step_trace.py's option check (no model: it exits before the engine is built)."""

import pytest

from tests.scripts import load_script


def test_dataset_output_lens_is_refused_for_copy_heavy(capsys):
    bench = load_script("bench_step_trace")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--dataset", "copy-heavy", "--dataset-output-lens"])
    assert exc.value.code == 2 and "--dataset-output-lens is for --dataset random" in capsys.readouterr().err
