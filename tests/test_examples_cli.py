"""Every examples/ script takes --api-key (for a server started with --api-key) next to --url."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def test_every_example_takes_api_key():
    assert EXAMPLES
    procs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True) for p in EXAMPLES}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-2000:]
        assert "--api-key" in out and "--url" in out, name
