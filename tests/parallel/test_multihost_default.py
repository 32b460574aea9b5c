"""The default model (SmolLM2-135M: 9 query heads, 3 kv heads) at `--tp-size 3` over three processes of
one CPU device each (`--nnodes 3`, ranks 0-2, on loopback): rank 0's greedy ids equal a single-process
tp-1 server's (the same prompts and flags as tests/parallel/test_serve_tp.py), and SIGTERM of rank 0
ends the followers.
"""

from __future__ import annotations

import httpx
import pytest

from tests.parallel.multihost_cluster import LoopbackCluster
from tests.parallel.test_serve_tp import FLAGS, GREEDY, PROMPTS
from tests.server.conftest import ServerProcess


def _native(url: str) -> list[list[int]]:
    resp = httpx.post(url + "/generate", json={"text": PROMPTS, "sampling_params": GREEDY}, timeout=300)
    assert resp.status_code == 200, resp.text
    return [out["output_ids"] for out in resp.json()]


@pytest.mark.slow
def test_default_model_tp3_over_three_processes_matches_tp1(tmp_path):
    ref = ServerProcess(FLAGS, tmp_path / "tp1.log")
    cluster = LoopbackCluster(3, 1, [*FLAGS, "--tp-size", "3"], tmp_path, "tp3", dist_timeout=60)
    try:
        ref.wait_healthy(600)
        cluster.wait_healthy(600)
        info = httpx.get(cluster.url + "/get_server_info", timeout=30).json()
        assert info["tp_size"] == 3 and len(info["devices"]) == 3
        expected = _native(ref.url)
        assert all(len(ids) == 12 for ids in expected)
        assert _native(cluster.url) == expected
        cluster.ranks[0].proc.terminate()
        assert cluster.wait_exit(0, 60) == 0
        assert [cluster.wait_exit(rank, 30) for rank in (1, 2)] == [0, 0]  # rank 0 sent shutdown
        assert all("rank 0 sent shutdown" in cluster.ranks[r].log() for r in (1, 2))
    finally:
        cluster.stop()
        ref.stop()
