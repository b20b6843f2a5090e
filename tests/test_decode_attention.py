"""Decode attention: both nests against the f64 reference, the nest choice, static WGSL checks.

Runs natively on wgpu (Mesa lavapipe on CI). f16 outputs must be within 2.5e-4 relative L2 of the
f64 reference (rounding the reference itself to f16 costs 2.04e-4), f32 within 1e-5, lse within
1e-3 (absolute, log2 domain).
"""

import re

import numpy as np
import pytest

from app.bench.harness import DecodeCall
from attention_reference import decode_attention_reference, make_paged_inputs, relative_l2, wgsl_block
from model_glue.contract import NESTS, TEST_SHAPES, AttentionShape, attention_kernel_name
from model_glue.attention import TILED_MAX_CONTEXT, context_length, pick_decode_nest, tiled_defect

CONTEXTS = [1, 15, 16, 17, 255, 256, 257, 1000, 3060]
TOLERANCE = {"float16": 2.5e-4, "float32": 1e-5}
# Inline RoPE at positions up to ~3600 in f32: the angle pos*inv_freq carries ~pos*2^-24 rad of
# rounding (TVM computes it the same way), which alone moves f32 outputs by ~5e-5.
ROPE_F32_TOLERANCE = 1e-4
LSE_TOLERANCE = 1e-3
# (head_dim, GQA group) where TVM 0.27's tiled kernel skips the last query head of every group
# (docs/tvm_tiled_gqa_repro.py); every other shape of the grid must pass.
TVM_TILED_WRONG = {(256, 5), (256, 7)}


def reference(inputs):
    return decode_attention_reference(
        inputs["q"], inputs["pages"], inputs["page_table_indptr"], inputs["page_table_values"],
        inputs["length_info"], inputs["sm_scale"],
        sliding_window=inputs["length_info"].ndim == 2,
        rotary_mode=inputs.get("rotary_mode", 0), rope_scale=inputs.get("rope_scale", 1.0),
        rope_theta=inputs.get("rope_theta", 1e4),
        q_rope_position=inputs["q_rope_position"], k_rope_pos_offset=inputs["k_rope_pos_offset"])


def check_against_reference(loop, gpu, library, name, inputs, dtype, tolerance=None, **rope):
    kernel = loop.run_until_complete(library.kernel(name))
    out, lse = loop.run_until_complete(DecodeCall(gpu, kernel, inputs, **rope).run())
    ref_out, ref_lse = reference({**inputs, **rope})
    tolerance = tolerance or TOLERANCE[dtype]
    assert relative_l2(out, ref_out) <= tolerance, f"{name}: whole batch rel L2 {relative_l2(out, ref_out):.3e}"
    for b, n in enumerate(inputs["kv_lens"]):
        err = relative_l2(out[b], ref_out[b])
        # One sequence has few outputs, so its share of the f16 rounding floor varies; bound it by
        # that sequence's own floor (the f64 result rounded to f16) plus a small margin.
        floor = relative_l2(ref_out[b].astype(out.dtype), ref_out[b])
        assert err <= max(tolerance, floor + 2e-5), f"{name}: sequence {b} (context {n}): rel L2 {err:.3e}"
        lse_err = float(np.max(np.abs(lse[b] - ref_lse[b])))
        assert lse_err <= LSE_TOLERANCE, f"{name}: sequence {b} (context {n}): lse error {lse_err:.3e}"


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("nest", NESTS)
@pytest.mark.parametrize("shape", TEST_SHAPES, ids=lambda s: f"d{s.head_dim}_g{s.num_qo_heads // s.num_kv_heads}")
def test_nest_matches_f64_reference(loop, gpu, library, shape, nest, dtype):
    """Every context of the grid in one batched call (shuffled, non-contiguous pages).

    Where the build marked TVM's tiled kernel defective, the test shows that it really is wrong
    (so a fixed TVM makes this fail and the mark can go) and that the host never picks it.
    """
    if dtype == "float16" and not gpu.has_f16:
        pytest.skip("adapter has no shader-f16")
    rng = np.random.default_rng(hash((shape, nest, dtype)) % 2**32)
    inputs = make_paged_inputs(rng, CONTEXTS, shape.num_kv_heads, shape.num_qo_heads, shape.head_dim, dtype)
    name = attention_kernel_name(nest, shape, dtype, False)
    group = shape.num_qo_heads // shape.num_kv_heads
    if (shape.head_dim, group) in TVM_TILED_WRONG:
        defect = tiled_defect(library.specs[attention_kernel_name("tiled", shape, dtype, False)])
        assert defect is not None and f"computes only {group - 1} of the {group} query heads" in defect
        assert pick_decode_nest([10], "auto", defect) == "sharded"
        with pytest.raises(ValueError, match="not run for this shape"):
            pick_decode_nest([10], "tiled", defect)
        if nest == "tiled":
            out, _ = loop.run_until_complete(DecodeCall(gpu, loop.run_until_complete(library.kernel(name)), inputs).run())
            assert relative_l2(out, reference(inputs)[0]) > 0.3  # one head in `group` never written
            return
    elif nest == "tiled":
        assert library.specs[name].meta.get("defect") is None
    check_against_reference(loop, gpu, library, name, inputs, dtype)


@pytest.mark.parametrize("nest", NESTS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_mixed_batch_of_three_with_rope(loop, gpu, library, head_dim, nest):
    """A batch of 3 mixed lengths, inline RoPE on (rotate-half, as TVM defines it) at offsets."""
    dtype = "float32"
    shape = AttentionShape(1, 4, head_dim)
    rng = np.random.default_rng(head_dim)
    inputs = make_paged_inputs(rng, [3060, 17, 300], 1, 4, head_dim, dtype, rope_offset_range=500)
    check_against_reference(loop, gpu, library, attention_kernel_name(nest, shape, dtype, False), inputs,
                            dtype, ROPE_F32_TOLERANCE, rotary_mode=1, rope_scale=1.0, rope_theta=1e4)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("nest", NESTS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", [{"window": 64, "sink": 4}, {"window": 300, "sink": 0}], ids=["w64s4", "w300"])
def test_sliding_window_matches_reference(loop, gpu, library, head_dim, nest, dtype, window):
    if dtype == "float16" and not gpu.has_f16:
        pytest.skip("adapter has no shader-f16")
    shape = AttentionShape(1, 4, head_dim)
    rng = np.random.default_rng(head_dim + window["window"])
    inputs = make_paged_inputs(rng, [40, 70, 1000, 3060], 1, 4, head_dim, dtype, sliding_window=window,
                               fill_unused=1e4)  # a stray read of an evicted slot would blow up
    check_against_reference(loop, gpu, library, attention_kernel_name(nest, shape, dtype, True), inputs, dtype)


def test_unused_slots_are_never_read(loop, gpu, library):
    """Poison every slot outside the contexts: any stray read shows up as a huge error."""
    shape = AttentionShape(1, 4, 128)
    rng = np.random.default_rng(7)
    inputs = make_paged_inputs(rng, [257, 33], 1, 4, 128, "float32", fill_unused=1e4)
    for nest in NESTS:
        check_against_reference(loop, gpu, library, attention_kernel_name(nest, shape, "float32", False),
                                inputs, "float32")


# -- the nest choice ------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,expected", [(255, "tiled"), (256, "tiled"), (257, "sharded"), (1, "tiled"), (8192, "sharded")])
def test_auto_choice_at_the_threshold(tokens, expected):
    assert TILED_MAX_CONTEXT == 256
    num_pages = (tokens + 15) // 16
    assert context_length(num_pages, tokens - (num_pages - 1) * 16) == tokens
    assert pick_decode_nest([tokens]) == expected


def test_override_and_mixed_batch():
    assert pick_decode_nest([3000], "tiled") == "tiled"
    assert pick_decode_nest([10], "sharded") == "sharded"
    assert pick_decode_nest([10, 300, 5]) == "sharded"  # the longest sequence decides
    assert pick_decode_nest([]) == "tiled"
    with pytest.raises(ValueError, match="override"):
        pick_decode_nest([10], "fast")


# -- static checks on the built sharded WGSL --------------------------------------------------------
def _context_loop_body(wgsl: str) -> str:
    """The text of the sharded kernel's loop over the context (`for (var trip ...) { ... }`)."""
    return wgsl_block(wgsl, "for (var trip")


def test_sharded_wgsl_static_properties(library, artifact_dir):
    sharded = library.names(kind="decode_attention", nest="sharded")
    assert len(sharded) >= 30
    for name in sharded:
        spec = library.specs[name]
        wgsl = (artifact_dir / spec.wgsl).read_text()
        size = spec.workgroup_size
        assert size[0] * size[1] * size[2] == 256, name
        assert re.search(r"@workgroup_size\((\d+), (\d+), (\d+)\)", wgsl).groups() == tuple(map(str, size))
        assert spec.workgroup_storage_bytes <= 16384, name
        lanes = spec.meta["head_dim"] // 64
        body = _context_loop_body(wgsl)
        # two position steps per trip: one barrier per position with split lanes, none with D=64
        expected = 2 if lanes > 1 else 0
        assert body.count("workgroupBarrier()") == expected, f"{name}: barriers in the context loop"
