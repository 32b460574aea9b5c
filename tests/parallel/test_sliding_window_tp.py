"""Sliding-window models through the whole engine: tiny random Gemma 3, Gemma 2 and windowed Mistral
with a 16-token window, far shorter than their prompts (4-94 tokens), the 32-token prefill chunks and
the 44-token shared prefix (radix hits that start before the window; copy-on-write of a page
the match ends inside; soft release to the host tier and recall).

Greedy outputs at tp 1 equal transformers' greedy generation (near ties aside), and tp 2, the Pallas
kernel (interpret) under tp 2 and the radix cache off give the tp 1 outputs; no page leaks. With the host
tier on, every layer keeps all its pages (D-42); without it the hybrid window pool frees the pages that
left every window (D-46), and gives the same outputs at tp 1 and 2, XLA and Pallas, radix on and off.
The runs are `tests/parallel/tp_worker.py` subprocesses with 2 host devices."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import TINY_LLAMA, make_hf_checkpoint
from tests.pallas.test_ragged_paged_attention import needs_embedded_triton_ir
from tests.parallel.test_tensor_parallel import run_worker
from tests.parallel.tp_worker import prompts

torch = pytest.importorskip("torch")

WINDOW = 16
TINY = dict(TINY_LLAMA, num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, max_position_embeddings=256)
CASES = {
    "gemma3": ("Gemma3ForCausalLM", dict(
        TINY, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "gemma2": ("Gemma2ForCausalLM", dict(TINY, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=10.0)),
    "mistral": ("MistralForCausalLM", TINY),
}
NEAR_TIE = 1e-3
NUM_NEW = 6  # the worker's greedy max_new_tokens


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, default_tokenizer) -> dict[str, str]:
    return {
        case: make_hf_checkpoint(tmp_path_factory.mktemp(case), arch, cfg, seed=3, tokenizer=default_tokenizer,
                                 norm_noise=0.5 if "gemma" in case else 0.0)
        for case, (arch, cfg) in CASES.items()
    }


@pytest.fixture(scope="module")
def runs(model_dirs) -> dict[str, list[dict]]:
    results = run_worker(*model_dirs.values(), "--tp", "1", "2", devices=2)
    return {case: [r for r in results if r["model_dir"] == d] for case, d in model_dirs.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp1_engine_matches_transformers_greedy(model_dirs, runs, case):
    import transformers

    base = runs[case][0]
    assert base["tp"] == 1 and base["num_recalls"] > 0 and base["cow_hit_tokens"] > 0
    model = getattr(transformers, CASES[case][0]).from_pretrained(model_dirs[case], dtype=torch.float32).eval()
    for prompt, ours in zip(prompts(TINY["vocab_size"]), base["outputs"]):
        with torch.no_grad():
            t = torch.tensor([prompt])
            out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=NUM_NEW, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        ref, logits = out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0].numpy()
        diverged = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if diverged is not None:
            top2 = np.sort(logits[diverged])[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, f"{case}: greedy ids differ for a {len(prompt)}-token prompt"


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_gives_tp1_outputs_and_leaks_no_page(runs, case):
    base, tp2 = runs[case]
    assert tp2["tp"] == 2 and tp2["pool_sharding"] == "P(None, None, 'tensor')"
    assert tp2["outputs"] == base["outputs"] and tp2["sampled"] == base["sampled"]
    ref, ours = np.asarray(base["logits"]), np.asarray(tp2["logits"])
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) <= 1e-5
    for r in (base, tp2):
        assert r["free_pages"] == r["usable_pages"], f"pages leaked at tp {r['tp']}"


def test_pallas_interpret_under_tp2_and_radix_off_give_the_same_tokens(model_dirs, runs):
    [pallas] = run_worker(model_dirs["gemma3"], "--tp", "2", "--backend", "pallas", "--num-prompts", "4", devices=2)
    assert pallas["outputs"] == runs["gemma3"][0]["outputs"][:4]
    [no_radix] = run_worker(model_dirs["gemma2"], "--tp", "1", "--disable-radix-cache", devices=1)
    assert no_radix["outputs"] == runs["gemma2"][0]["outputs"]
    assert no_radix["free_pages"] == no_radix["usable_pages"]


@pytest.fixture(scope="module")
def hybrid_runs(model_dirs) -> dict[str, list[dict]]:
    results = run_worker(*model_dirs.values(), "--tp", "1", "2", "--hybrid", devices=2)
    return {case: [r for r in results if r["model_dir"] == d] for case, d in model_dirs.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hybrid_window_pool_gives_the_all_pages_outputs_at_tp_1_and_2(runs, hybrid_runs, case):
    for every_page, hybrid in zip(runs[case], hybrid_runs[case]):
        assert every_page["flat_pages"] is None
        # full layers of 129 pages (1024 tokens at page size 8), window layers of 0.8 as many
        num_full = {"gemma3": 1, "gemma2": 2, "mistral": 0}[case]
        assert hybrid["flat_pages"] == num_full * 129 + (TINY["num_hidden_layers"] - num_full) * 103
        assert hybrid["tp"] == every_page["tp"]
        assert hybrid["outputs"] == every_page["outputs"] and hybrid["sampled"] == every_page["sampled"]
        ref, ours = np.asarray(every_page["logits"]), np.asarray(hybrid["logits"])
        assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) <= 1e-5
        assert hybrid["free_pages"] == hybrid["usable_pages"], f"pages leaked at tp {hybrid['tp']}"


def test_hybrid_window_pool_under_pallas_interpret_and_radix_off(model_dirs, runs):
    [pallas] = run_worker(model_dirs["gemma3"], "--tp", "2", "--backend", "pallas", "--num-prompts", "4", "--hybrid",
                          devices=2)
    assert pallas["flat_pages"] is not None and pallas["outputs"] == runs["gemma3"][0]["outputs"][:4]
    [no_radix] = run_worker(model_dirs["mistral"], "--tp", "1", "--disable-radix-cache", "--hybrid", devices=1)
    assert no_radix["flat_pages"] is not None and no_radix["outputs"] == runs["mistral"][0]["outputs"]
    assert no_radix["free_pages"] == no_radix["usable_pages"]


@needs_embedded_triton_ir
def test_hybrid_window_pool_step_lowers_for_cuda_under_tp2(model_dirs):
    [low] = run_worker(model_dirs["gemma3"], "--tp", "2", "--lower-cuda", "--hybrid", devices=2)
    assert low["triton_kernels"] >= 1 and low["manual_axes"] >= 1 and low["num_sharding_annotations"] > 0
