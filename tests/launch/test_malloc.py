"""glibc malloc keeps freed memory for reuse in a server process on CPU (D-45): a block freed by one run is
taken again by the next without faulting its pages in again. Counted in page faults, in a fresh process
per case (the settings are the process's own). Then the rule that says whether the server runs on CPU,
branch by branch, against real modules, entry points and variables in a bare import path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest

from jaxserve.launch.malloc import accelerator_plugins, glibc, server_platform

pytestmark = pytest.mark.skipif(glibc() is None, reason="glibc only")

BLOCK_PAGES = 12_288  # 48 MiB: above glibc's largest mmap threshold (32 MiB)

# A thread (as XLA's are) allocates, writes and frees the block three times; the faults of the last two
# runs are counted. `apply` says whether the process calls keep_freed_memory (without --device) first.
_RUNS = """
import ctypes, json, resource, sys, threading
from jaxserve.launch.malloc import keep_freed_memory
line = keep_freed_memory(None) if sys.argv[1] == "1" else ""
jax_imported = "jax" in sys.modules
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
print(json.dumps({"line": line, "faults": faults[1:], "jax_imported": jax_imported}))
"""


def runs(apply: bool, env: dict | None = None) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    out = subprocess.run([sys.executable, "-c", _RUNS, "1" if apply else "0", str(BLOCK_PAGES)], capture_output=True,
                         text=True, timeout=60, env=env, check=True)
    return json.loads(out.stdout)


def test_freed_blocks_are_reused_without_faults():
    kept = runs(apply=True)
    assert kept["line"] == "malloc: freed memory kept for reuse: one arena, no mmap, no automatic trim (D-45; CPU: " \
                           "JAX_PLATFORMS=cpu)", kept
    assert max(kept["faults"]) < BLOCK_PAGES // 10, kept
    assert not kept["jax_imported"]  # the platform is decided without jax, so before its threads


def test_not_on_cpu_malloc_is_left_alone():
    """One arena for every thread of a many-core GPU/TPU host was never measured (D-45)."""
    left = runs(apply=True, env={"JAX_PLATFORMS": "cuda"})
    assert left["line"] == "malloc: left as it is: D-45 is for CPU only, and this server may not run on CPU " \
                           "(JAX_PLATFORMS=cuda)", left
    assert min(left["faults"]) > BLOCK_PAGES * 9 // 10, left  # so nothing was set
    assert not left["jax_imported"]


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


PLATFORM_VARIABLES = ("JAX_PLATFORMS", "JAX_PLATFORM_NAME", "PJRT_NAMES_AND_LIBRARY_PATHS", "TPU_LIBRARY_PATH")


@pytest.fixture
def bare_path(monkeypatch, tmp_path):
    """An import path with the standard library and an empty folder (returned) only, no variable that names a
    platform, and no accelerator module imported yet: the host's own jax install does not count."""
    for name in PLATFORM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    stdlib = sysconfig.get_path("stdlib")
    monkeypatch.setattr(sys, "path", [str(tmp_path), stdlib, os.path.join(stdlib, "lib-dynload")])
    for name in list(sys.modules):
        if name.split(".")[0] in ("jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"):
            monkeypatch.delitem(sys.modules, name)
    return tmp_path


def install_module(folder, dotted: str) -> None:
    """A package `dotted` (a.b: a namespace package a holding package b) under `folder`."""
    path = folder.joinpath(*dotted.split("."))
    path.mkdir(parents=True)
    (path / "__init__.py").write_text("")


def install_entry_point(folder, module: str) -> None:
    """A distribution that advertises `module` under the `jax_plugins` entry-point group (as jax-cuda12-pjrt)."""
    info = folder / "fake_pjrt-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-pjrt\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[jax_plugins]\nfake_pjrt = {module}\n")


def test_no_accelerator_found_in_a_bare_path(bare_path):
    assert accelerator_plugins() == []


@pytest.mark.parametrize("module, found", [("jax_cuda12_plugin", "jax_cuda12_plugin"),
                                           ("jax_cuda13_plugin", "jax_cuda13_plugin"), ("libtpu", "libtpu"),
                                           ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda12")])
def test_an_installed_accelerator_module_is_found(bare_path, module, found):
    install_module(bare_path, module)
    assert accelerator_plugins() == [found]


def test_a_jax_plugins_entry_point_is_found(bare_path):
    install_entry_point(bare_path, "fake_pjrt_module")
    assert accelerator_plugins() == ["fake_pjrt_module"]


@pytest.mark.parametrize("name", ["PJRT_NAMES_AND_LIBRARY_PATHS", "TPU_LIBRARY_PATH"])
def test_a_plugin_path_in_the_environment_is_found(bare_path, monkeypatch, name):
    monkeypatch.setenv(name, "/opt/plugin.so")
    assert accelerator_plugins() == [name]


def test_other_modules_are_not_accelerators(bare_path):
    install_module(bare_path, "jax_cuda12_plugin_notes")
    install_module(bare_path, "jaxlib")
    assert accelerator_plugins() == []


# (JAX_PLATFORMS, JAX_PLATFORM_NAME, --device, an accelerator module installed) -> (is_cpu, reason)
RULE_CASES = [
    # 1. the environment names the platform, whatever --device and the installed modules say
    (("cpu", None, None, True), (True, "JAX_PLATFORMS=cpu")),
    (("cpu,cuda", None, "gpu", True), (True, "JAX_PLATFORMS=cpu,cuda")),
    ((" CPU ", None, None, False), (True, "JAX_PLATFORMS= CPU ")),
    (("cuda,cpu", None, "cpu", False), (False, "JAX_PLATFORMS=cuda,cpu")),
    (("tpu", None, None, False), (False, "JAX_PLATFORMS=tpu")),
    ((None, "cpu", None, True), (True, "JAX_PLATFORM_NAME=cpu")),
    ((None, "gpu", "cpu", False), (False, "JAX_PLATFORM_NAME=gpu")),
    (("cpu", "gpu", None, False), (False, "JAX_PLATFORMS=cpu, JAX_PLATFORM_NAME=gpu")),
    # 2. else --device
    ((None, None, "cpu", True), (True, "--device cpu")),
    (("", None, "CPU", True), (True, "--device CPU")),
    ((None, None, "cuda", False), (False, "--device cuda")),
    ((None, None, "gpu", False), (False, "--device gpu")),
    ((None, None, "tpu", False), (False, "--device tpu")),
    ((None, None, "xpu", False), (False, "--device xpu")),
    # 3. else CPU only without an accelerator back end
    ((None, None, None, False), (True, "no accelerator back end of JAX is installed")),
    (("", "", None, False), (True, "no accelerator back end of JAX is installed")),
    ((None, None, None, True), (False, "neither JAX_PLATFORMS nor --device is set, and jax_cuda12_plugin is installed")),
]


@pytest.mark.parametrize("case, expected", RULE_CASES)
def test_the_server_platform_rule(bare_path, monkeypatch, case, expected):
    platforms, platform_name, device, has_plugin = case
    for name, value in (("JAX_PLATFORMS", platforms), ("JAX_PLATFORM_NAME", platform_name)):
        if value is not None:
            monkeypatch.setenv(name, value)
    if has_plugin:
        install_module(bare_path, "jax_cuda12_plugin")
    assert tuple(server_platform(device)) == expected
