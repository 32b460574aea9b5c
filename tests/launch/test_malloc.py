"""glibc malloc keeps freed memory for reuse in the server process (D-45): a block freed by one run is
taken again by the next without faulting its pages in again. Counted in page faults, in a fresh process
per case (the settings are the process's own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxserve.launch.malloc import glibc

pytestmark = pytest.mark.skipif(glibc() is None, reason="glibc only")

BLOCK_PAGES = 12_288  # 48 MiB: above glibc's largest mmap threshold (32 MiB)

# A thread (as XLA's are) allocates, writes and frees the block three times; the faults of the last two
# runs are counted. `apply` says whether the process calls keep_freed_memory first.
_RUNS = """
import ctypes, json, resource, sys, threading
from jaxserve.launch.malloc import keep_freed_memory
line = keep_freed_memory() if sys.argv[1] == "1" else ""
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = int(sys.argv[2]) * 4096
faults = []
def run():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
for _ in range(3):
    t = threading.Thread(target=run)
    t.start()
    t.join()
print(json.dumps({"line": line, "faults": faults[1:]}))
"""


def runs(apply: bool, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", _RUNS, "1" if apply else "0", str(BLOCK_PAGES)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, **(env or {})}, check=True)
    return json.loads(out.stdout)


def test_freed_blocks_are_reused_without_faults():
    kept = runs(apply=True)
    assert kept["line"].startswith("malloc: freed memory kept for reuse"), kept
    assert max(kept["faults"]) < BLOCK_PAGES // 10, kept


def test_without_it_every_run_faults_the_block_in_again():
    """The control: glibc's defaults map a fresh block for each run."""
    default = runs(apply=False)
    assert min(default["faults"]) > BLOCK_PAGES * 9 // 10, default


def test_the_users_own_malloc_tunables_win():
    tuned = runs(apply=True, env={"GLIBC_TUNABLES": "glibc.malloc.check=0"})
    assert tuned["line"] == "malloc: glibc's settings from GLIBC_TUNABLES (D-45 would keep freed memory for reuse)"
    assert min(tuned["faults"]) > BLOCK_PAGES * 9 // 10, tuned  # so nothing was set


def test_tunables_of_other_subsystems_do_not_count():
    line = runs(apply=True, env={"GLIBC_TUNABLES": "glibc.rtld.nns=4"})["line"]
    assert line.startswith("malloc: freed memory kept for reuse"), line
