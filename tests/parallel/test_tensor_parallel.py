"""Tensor parallelism on CPU host devices: outputs at tp 2 and 4 equal tp 1 (tiny Llama with 2 kv heads,
so tp 4 replicates them, and tiny Qwen3), the Pallas backend under tp 2, the CUDA lowering of the
sharded step, retraction under a tiny pool at tp 2, and the start-up refusals.

Each multi-device run is a subprocess (`tests/parallel/tp_worker.py`) with JAX_NUM_CPU_DEVICES set
before jax starts; this process keeps its single device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve import parallel
from jaxserve.model.config import ModelConfig
from jaxserve.server_args import ServerArgs
from tests.conftest import TINY_LLAMA, make_hf_checkpoint
from tests.pallas.test_ragged_paged_attention import needs_embedded_triton_ir

REPO = Path(__file__).resolve().parents[2]

TINY_QWEN3 = dict(TINY_LLAMA, num_key_value_heads=4, head_dim=16, rope_theta=1e6, tie_word_embeddings=False)


def run_worker(*args: str, devices: int = 4, timeout: float = 900, module: str = "tests.parallel.tp_worker") -> list[dict]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, default_tokenizer) -> str:
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "Qwen3ForCausalLM", TINY_QWEN3,
                              seed=2, tokenizer=default_tokenizer)


@pytest.fixture(scope="module")
def tp_runs(tiny_model_dir, qwen3_dir) -> dict[str, list[dict]]:
    results = run_worker(tiny_model_dir, qwen3_dir, "--tp", "1", "2", "4", "--precompile")
    return {
        "llama": [r for r in results if r["model_dir"] == tiny_model_dir],
        "qwen3": [r for r in results if r["model_dir"] == qwen3_dir],
    }


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_outputs_identical_at_every_tp(tp_runs, family):
    base, *others = tp_runs[family]
    assert [r["tp"] for r in tp_runs[family]] == [1, 2, 4]
    assert len(base["outputs"]) == 16 and all(len(o) == 6 for o in base["outputs"])
    assert base["num_recalls"] > 0  # the host tier was used (soft release, recall)
    assert base["cow_hit_tokens"] > 0  # copy-on-write of a partly matched page
    for r in others:
        assert r["devices"] == [f"cpu:{i}" for i in range(r["tp"])]
        assert r["pool_sharding"] == "P(None, None, 'tensor')"
        assert r["outputs"] == base["outputs"], f"greedy outputs differ at tp {r['tp']}"
        assert r["sampled"] == base["sampled"], f"seeded sampling differs at tp {r['tp']}"
        ref, ours = np.asarray(base["logits"]), np.asarray(r["logits"])
        assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_no_compile_after_warmup_and_no_page_leak(tp_runs, family):
    for r in tp_runs[family]:
        assert r["compiles_after_warmup"] == 0, r["tp"]
        assert r["free_pages"] == r["usable_pages"], r["tp"]


def test_a_compressed_pool_at_tp_2(tiny_model_dir):
    """--kv-cache-dtype int8 at tp 2: the values and the scales are split over kv heads, and every row is one kv
    head's, so tp 2 quantizes and attends as tp 1 does: the same greedy outputs, through soft release, recall
    and copy-on-write of compressed pages, and no page leaked."""
    tp1, tp2 = run_worker(tiny_model_dir, "--tp", "1", "2", "--kv-cache-dtype", "int8", "--num-prompts", "8", devices=2)
    assert tp2["pool_sharding"] == "P(None, None, 'tensor') P(None, None, 'tensor')"  # values, scales
    assert tp2["outputs"] == tp1["outputs"] and tp2["sampled"] == tp1["sampled"]
    for r in (tp1, tp2):
        assert r["num_recalls"] > 0 and r["free_pages"] == r["usable_pages"]


def test_kv_heads_replicated_when_tp_exceeds_them(tp_runs):
    # the tiny Llama has 2 kv heads: tp 4 serves each twice (its outputs are checked above)
    assert [r["num_kv_heads"] for r in tp_runs["llama"]] == [2, 2, 4]
    assert [r["num_kv_heads"] for r in tp_runs["qwen3"]] == [4, 4, 4]


def test_pallas_interpret_under_tp2_gives_xla_tokens(tiny_model_dir, tp_runs):
    # greedy outputs do not depend on the batch they ran in: the first 4 prompts of the XLA run at tp 1
    [pallas] = run_worker(tiny_model_dir, "--tp", "2", "--backend", "pallas", "--num-prompts", "4", devices=2)
    assert pallas["outputs"] == tp_runs["llama"][0]["outputs"][:4]


def test_retraction_at_tp2_gives_tp1_outputs_and_leaks_no_page(tiny_model_dir):
    base, tp2 = run_worker(tiny_model_dir, "--tp", "1", "2", "--retract", devices=2)
    assert [base["tp"], tp2["tp"]] == [1, 2]
    for r in (base, tp2):
        assert r["num_retractions"] > 0, f"the pool did not force a retraction at tp {r['tp']}"
        assert all(len(o) == 32 for o in r["outputs"]), r["tp"]
        assert r["free_pages"] == r["usable_pages"], f"pages leaked at tp {r['tp']}"
    assert tp2["outputs"] == base["outputs"]


@needs_embedded_triton_ir
def test_sharded_step_lowers_for_cuda(tiny_model_dir):
    [low] = run_worker(tiny_model_dir, "--tp", "2", "--lower-cuda", devices=2)
    # the Triton kernel sits inside the shard_map (a manual computation) of a sharded module
    assert low["triton_kernels"] >= 1 and low["manual_axes"] >= 1 and low["num_sharding_annotations"] > 0


SMOLLM2 = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)


def test_plan_refuses_heads_tp_does_not_divide():
    with pytest.raises(ValueError) as e:
        parallel.plan_tensor_parallel(SMOLLM2, 2, "SmolLM2-135M")
    assert str(e.value) == "SmolLM2-135M has 9 attention heads; --tp-size 2 does not divide them (use 1, 3 or 9)"
    assert parallel.plan_tensor_parallel(SMOLLM2, 3) == parallel.TensorParallelPlan(3, 1)
    assert parallel.plan_tensor_parallel(SMOLLM2, 9) == parallel.TensorParallelPlan(9, 3)
    odd_kv = ModelConfig(**{**SMOLLM2.__dict__, "num_heads": 12, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="has 3 kv heads; --tp-size 4 neither divides them"):
        parallel.plan_tensor_parallel(odd_kv, 4, "m")


def test_mesh_refuses_more_devices_than_visible():
    import jax

    with pytest.raises(ValueError, match=rf"--tp-size 64 needs 64 devices, but {len(jax.devices())} (is|are) visible"):
        parallel.make_mesh(64)
    mesh = parallel.make_mesh(1)
    assert mesh.axis_names == ("data", "tensor") and mesh.devices.shape == (1, 1)


def test_rules_table_splits_megatron_style():
    from jax.sharding import PartitionSpec as P

    from jaxserve.model import functional

    axes = functional.logical_axes(SMOLLM2)
    layer = axes["layers"][0]
    spec = lambda a: parallel.partition_spec(a)  # noqa: E731
    assert spec(layer["attention"]["wqkv"]) == P("tensor", None, None)  # column-parallel (kv-head groups)
    assert spec(layer["attention"]["wo"]) == P(None, "tensor")  # row-parallel
    assert spec(layer["mlp"]["w_gate_up"]) == P(None, "tensor", None)
    assert spec(layer["mlp"]["w_down"]) == P(None, "tensor")
    assert spec(axes["embed"]) == P("tensor", None)
    assert spec(parallel.POOL_AXES) == P(None, None, "tensor", None, None)
    # a vocabulary tp does not divide stays whole
    assert parallel.partition_spec(("vocab", "embed"), (49153, 576), 2) == P(None, None)


def test_per_device_weight_bytes_follow_the_rules_table():
    from jaxserve.model import functional

    e, i, v, layers = 576, 1536, 49152, 30
    # per layer: wqkv [3, (3 + 2) 64, E], wo [E, 9 64], w_gate_up [2, I, E], w_down [E, I] are split in 3;
    # the two norms [E] are whole; then the embedding and the (untied) head [V, E] split over the
    # vocabulary, the final norm whole
    split_per_layer = 3 * 5 * 64 * e + e * 9 * 64 + 2 * i * e + e * i
    tp3 = layers * (split_per_layer // 3 + 2 * e) + 2 * (v * e // 3) + e
    abstract = functional.abstract_params(SMOLLM2)
    axes = functional.logical_axes(SMOLLM2)
    assert parallel.per_device_nbytes(abstract, axes, 3) == 4 * tp3
    assert parallel.per_device_nbytes(abstract, axes, 1) == 4 * (layers * (split_per_layer + 2 * e) + 2 * v * e + e)
    odd = ModelConfig(**{**SMOLLM2.__dict__, "vocab_size": v + 1})
    # an odd vocabulary stays whole on every device, embedding and head alike
    odd_tp3 = layers * (split_per_layer // 3 + 2 * e) + 2 * (v + 1) * e + e
    assert parallel.per_device_nbytes(functional.abstract_params(odd), functional.logical_axes(odd), 3) == 4 * odd_tp3
    assert parallel.pool_shards(3, 3) == 3 and parallel.pool_shards(4, 2) == 2 and parallel.pool_shards(3, 1) == 1


@pytest.mark.parametrize("flag", ["--tp-size", "--tp", "--tensor-parallel-size"])
def test_tp_flag_and_aliases(flag):
    assert ServerArgs.from_cli([flag, "3"]).tp_size == 3
    assert ServerArgs.from_cli([]).tp_size == 1
