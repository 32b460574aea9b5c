"""The memory the session server reports after start-up (log line, /get_server_info), against the
tiny checkpoint's own tensor sizes and the pool's page arithmetic."""

from __future__ import annotations

import json
import os
import re

import pytest

pytestmark = pytest.mark.slow

GIB, MIB = 1 << 30, 1 << 20
FLOAT32_BYTES = 4  # the CPU default dtype of weights and pool


def checkpoint_bytes(model_dir: str) -> int:
    """float32 bytes of the checkpoint's tensors, from the safetensors headers (tied embeddings: one)."""
    from safetensors import safe_open

    total = 0
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), framework="numpy") as f:
                for key in f.keys():
                    num = 1
                    for d in f.get_slice(key).get_shape():
                        num *= d
                    total += num * FLOAT32_BYTES
    return total


def process_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_server_info_reports_weights_pool_and_rss(server, http, tiny_model_dir):
    config = json.load(open(os.path.join(tiny_model_dir, "config.json")))
    before = process_rss(server.proc.pid)
    info = http.get("/get_server_info").json()
    after = process_rss(server.proc.pid)
    memory = info["memory"]

    assert memory["weights_bytes"] == checkpoint_bytes(tiny_model_dir)
    bytes_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * FLOAT32_BYTES
    num_pages = info["max_total_num_tokens"] // info["page_size"] + 1  # page 0: the reserved dummy page
    assert memory["kv_pool_bytes"] == num_pages * info["page_size"] * bytes_per_token
    assert memory["num_devices"] == 1
    assert memory["weights_bytes_per_device"] == memory["weights_bytes"]
    assert memory["kv_pool_bytes_per_device"] == memory["kv_pool_bytes"]
    # read between the test's two readings of the kernel's count (RSS moves a little while serving)
    assert 0.9 * min(before, after) <= memory["rss_bytes"] <= 1.1 * max(before, after)
    assert memory["startup_rss_bytes"] > memory["weights_bytes"]

    [state] = info["internal_states"]
    assert state["memory_usage"] == {
        "weight": round(memory["weights_bytes"] / GIB, 3),
        "kvcache": round(memory["kv_pool_bytes"] / GIB, 3),
        "token_capacity": info["max_total_num_tokens"],
        "token_capacity_swa": None,
    }


def test_start_up_log_line_gives_the_same_numbers(server, http):
    memory = http.get("/get_server_info").json()["memory"]
    lines = [line for line in server.log().splitlines() if "memory after start-up:" in line]
    assert len(lines) == 1, lines
    found = re.search(r"weights ([\d.]+) MiB, KV pool ([\d.]+) MiB, process RSS ([\d.]+) MiB", lines[0])
    assert found, lines[0]
    assert found.groups() == (f"{memory['weights_bytes'] / MIB:.1f}", f"{memory['kv_pool_bytes'] / MIB:.1f}",
                              f"{memory['startup_rss_bytes'] / MIB:.1f}")
