"""The HLO text readers (jaxserve/runner/hlo_text.py) on hand-written instructions in XLA's syntax.

The compiled-program test (test_model_runner_hlo.py) only sees the fixed engine, where the answer is
"no copy"; these lines check that the reader does find the copy the cliff made, and only it.
"""

from __future__ import annotations

from jaxserve.runner.hlo_text import aliased_params, pool_copies

POOL = (2, 40, 16, 2, 16)

# the cliff's instruction as XLA:CPU printed it: the tiny checkpoint's decode program (context 256)
# with reference.py before the fix (git show 94ace41:jaxserve/pallas/reference.py), host layer loop
CLIFF = "  %copy.28 = f32[2,40,16,2,16]{4,3,2,1,0} copy(%v_pool.1)"


def test_finds_a_whole_pool_copy_of_any_element_type():
    text = "\n".join([CLIFF, CLIFF.replace("f32", "bf16")])
    assert pool_copies(text, POOL) == [CLIFF.strip(), CLIFF.replace("f32", "bf16").strip()]


def test_ignores_copies_of_other_shapes_and_other_ops_on_the_pool():
    text = "\n".join([
        "  copy.1 = f32[1,40,16,2,16]{4,3,2,1,0} copy(f32[1,40,16,2,16]{4,3,2,1,0} slice.2)",  # one layer
        "  copy.2 = f32[16,2,16]{2,1,0} copy(f32[2,40,16,2,16]{4,3,2,1,0} v_pool.1)",  # reads the pool, writes a page
        "  scatter.3 = f32[2,40,16,2,16]{4,3,2,1,0} scatter(f32[2,40,16,2,16]{4,3,2,1,0} v_pool.1, s32[4,1] idx, f32[4,16] u)",
        "  copy.4 = f32[2,40,16,2,160]{4,3,2,1,0} copy(f32[2,40,16,2,160]{4,3,2,1,0} p)",  # a longer last dim
        "  copy-start.5 = (f32[2,40,16,2,16], f32[2,40,16,2,16], u32[]) copy-start(f32[2,40,16,2,16] v_pool.1)",
    ])
    assert pool_copies(text, POOL) == []


def test_aliased_params_names_the_donated_pools():
    text = "\n".join([
        "HloModule jit_step, input_output_alias={ {0}: (1, {}, may-alias), {1}: (2, {}, may-alias) }, "
        "entry_computation_layout={(f32[4]{0}, f32[2,40,16,2,16]{4,3,2,1,0}, f32[2,40,16,2,16]{4,3,2,1,0})->"
        "(f32[2,40,16,2,16]{4,3,2,1,0}, f32[2,40,16,2,16]{4,3,2,1,0})}",
        "",
        "ENTRY main.9 (x.1: f32[4], k_pool.2: f32[2,40,16,2,16], v_pool.3: f32[2,40,16,2,16]) -> (f32[2,40,16,2,16], f32[2,40,16,2,16]) {",
        "}",
    ])
    assert aliased_params(text) == {"k_pool.2", "v_pool.3"}
