"""Split-context decode attention (kernels.decode_attention_split): partial + merge vs the f64 reference.

The kernels are built here, at import, with kernels.build.build_kernel (never into the artifact),
compiled with model_glue.kernel.Kernel.compile on the `gpu` fixture and bound with Kernel.bind:
the runtime's own path. Tolerances as tests/test_decode_attention.py: f16 within 2.5e-4 relative
L2 of the f64 reference overall and each sequence within its own f16 rounding floor + 2e-5, f32
within 1e-5, lse within 1e-3 (absolute, log2 domain).
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from attention_reference import decode_attention_reference, make_paged_inputs, relative_l2, wgsl_block
from kernels.build import build_kernel
from app.bench.harness import DecodeCall
from kernels.decode_attention_split import MASKED_SCORE, decode_attention_split_merge, decode_attention_split_partial
from model_glue.attention import AttentionChoice, pick_sharded_variant, split_workspace_bytes
from model_glue.contract import DTYPE_TAGS, MAX_SPLITS, AttentionShape, KernelSpec
from model_glue.kernel import Kernel

CONTEXTS = [1, 15, 16, 17, 255, 256, 257, 1000, 3060]
TOLERANCE = {"float16": 2.5e-4, "float32": 1e-5}
ROPE_F32_TOLERANCE = 1e-4  # the RoPE angle's f32 rounding at positions ~3600 (as the sharded test)
LSE_TOLERANCE = 1e-3
# 64 (the most the host picks) > the pages of every context but 1,000 and 3,060: most of their splits
# are empty.
SPLITS = [1, 2, 7, 16, MAX_SPLITS]
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 3, 4, 8)
DTYPES = ("float16", "float32")
# Lavapipe spends ~3 s compiling each partial kernel on first use (Mesa caches it on disk after),
# so by default every (head_dim, group) runs in one dtype, alternating so that every head_dim and
# every group meets both; SPLIT_FULL_GRID=1 runs all 24. Each shape runs one or two S; the
# SmolLM2-like shape (64, 3) runs all of SPLITS. S >= 64 costs seconds on lavapipe (a workgroup
# merge per split), so the other shapes keep S <= 16.
FULL_GRID = os.environ.get("SPLIT_FULL_GRID") == "1"
_ROTATE = [[1, 2], [7], [16], [2], [1, 16], [7]]
MAIN_GRID = {}  # (head_dim, group, dtype) -> S values to run
for _i, (_d, _group) in enumerate((d, g) for d in HEAD_DIMS for g in GROUPS):
    for _dtype in DTYPES if FULL_GRID else [DTYPES[(_i + _i // len(GROUPS)) % 2]]:
        MAIN_GRID[_d, _group, _dtype] = SPLITS if (_d, _group) == (64, 3) else _ROTATE[len(MAIN_GRID) % len(_ROTATE)]
# One workgroup per GQA group: SmolLM2's (64, 3), and (256, 3), with split lanes and 192
# invocations that sum the stage two dims per thread.
GROUP_HEADS = {(64, 3, "float16"): [1, 7], (256, 3, "float32"): [3]}
WINDOWED = {64: "float32", 256: "float16"}  # sliding window, GQA group 4


# -- build (module scope): name -> (manifest entry, WGSL) ---------------------------------------------
def _partial_name(group, d, dtype, sliding_window=False, group_heads=False):
    return (f"split_partial_d{d}_kv1_qo{group}_{DTYPE_TAGS[dtype]}"
            f"{'_sw' if sliding_window else ''}{'_grp' if group_heads else ''}")


def _merge_name(group, d, dtype):
    return f"split_merge_d{d}_qo{group}_{DTYPE_TAGS[dtype]}"


def _recipes():
    wanted = {}

    def add(d, group, dtype, sliding_window=False, group_heads=False):
        wanted[_partial_name(group, d, dtype, sliding_window, group_heads)] = (
            decode_attention_split_partial, (1, group, d, dtype, sliding_window), {"group_heads": group_heads})
        wanted[_merge_name(group, d, dtype)] = (decode_attention_split_merge, (group, d, dtype), {})

    for d, group, dtype in MAIN_GRID:
        add(d, group, dtype)
    for d, group, dtype in GROUP_HEADS:
        add(d, group, dtype, group_heads=True)
    for d, dtype in WINDOWED.items():
        add(d, 4, dtype, sliding_window=True)
    built = {}
    for name, (builder, args, kwargs) in wanted.items():
        kernel = build_kernel(name, builder(*args, **kwargs))
        built[name] = (kernel.spec.to_json(), kernel.wgsl)
    return built


BUILT = _recipes()


# -- host side: bind and run partial + merge (what the runtime will do) ------------------------------
_COMPILED: dict[str, Kernel] = {}


def compiled(loop, gpu, name) -> Kernel:
    if name not in _COMPILED:
        entry, wgsl = BUILT[name]
        _COMPILED[name] = loop.run_until_complete(Kernel.compile(gpu, KernelSpec.from_json(entry), wgsl))
    return _COMPILED[name]


def reference(inputs, **rope):
    return decode_attention_reference(
        inputs["q"], inputs["pages"], inputs["page_table_indptr"], inputs["page_table_values"],
        inputs["length_info"], inputs["sm_scale"], sliding_window=inputs["length_info"].ndim == 2,
        q_rope_position=inputs["q_rope_position"], k_rope_pos_offset=inputs["k_rope_pos_offset"], **rope)


def check(label, out, lse, ref_out, ref_lse, kv_lens, tolerance):
    assert relative_l2(out, ref_out) <= tolerance, f"{label}: whole batch rel L2 {relative_l2(out, ref_out):.3e}"
    for b, n in enumerate(kv_lens):
        err = relative_l2(out[b], ref_out[b])
        # A sequence has few outputs, so its share of the f16 rounding floor varies (as the sharded test).
        floor = relative_l2(ref_out[b].astype(out.dtype), ref_out[b])
        assert err <= max(tolerance, floor + 2e-5), f"{label}: sequence {b} (context {n}): rel L2 {err:.3e}"
        lse_err = float(np.max(np.abs(lse[b] - ref_lse[b])))
        assert lse_err <= LSE_TOLERANCE, f"{label}: sequence {b} (context {n}): lse error {lse_err:.3e}"


def split_call(loop, gpu, partial_name, merge_name, inputs, **rope) -> DecodeCall:
    """The runtime's binding path (app.bench.harness.DecodeCall) over a partial + merge pair."""
    return DecodeCall(gpu, (compiled(loop, gpu, partial_name), compiled(loop, gpu, merge_name)), inputs, **rope)


def run_with_splits(loop, call, num_splits):
    call.set_splits(num_splits)
    return loop.run_until_complete(call.run())


def run_and_check(loop, gpu, partial_name, merge_name, inputs, dtype, splits, tolerance=None, **rope):
    call = split_call(loop, gpu, partial_name, merge_name, inputs, **rope)
    ref_out, ref_lse = reference(inputs, **rope)
    try:
        for num_splits in splits:
            out, lse = run_with_splits(loop, call, num_splits)
            check(f"{partial_name} S={num_splits}", out, lse, ref_out, ref_lse, inputs["kv_lens"],
                  tolerance or TOLERANCE[dtype])
    finally:
        call.release()
    return out, lse


def _skip_without_f16(gpu, dtype):
    if dtype == "float16" and not gpu.has_f16:
        pytest.skip("adapter has no shader-f16")


# -- against the f64 reference ------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim,group,dtype", list(MAIN_GRID), ids=lambda v: str(v))
def test_split_matches_f64_reference(loop, gpu, head_dim, group, dtype):
    """Every context of the grid in one batch (shuffled pages, one KV head), for the shape's S."""
    _skip_without_f16(gpu, dtype)
    rng = np.random.default_rng(head_dim * 100 + group * 10 + len(dtype))
    inputs = make_paged_inputs(rng, CONTEXTS, 1, group, head_dim, dtype)
    run_and_check(loop, gpu, _partial_name(group, head_dim, dtype), _merge_name(group, head_dim, dtype),
                  inputs, dtype, MAIN_GRID[head_dim, group, dtype])


@pytest.mark.parametrize("head_dim,group,dtype", list(GROUP_HEADS), ids=lambda v: str(v))
def test_group_heads_matches_f64_reference(loop, gpu, head_dim, group, dtype):
    """One workgroup per (sequence, KV head, split) serving the whole GQA group."""
    _skip_without_f16(gpu, dtype)
    inputs = make_paged_inputs(np.random.default_rng(head_dim + group), CONTEXTS, 1, group, head_dim, dtype)
    run_and_check(loop, gpu, _partial_name(group, head_dim, dtype, group_heads=True),
                  _merge_name(group, head_dim, dtype), inputs, dtype, GROUP_HEADS[head_dim, group, dtype])


def test_empty_and_one_token_sequences(loop, gpu):
    """Sequences without pages give output 0 and lse -5e4 (as tiled and sharded do), for every S;
    one-token sequences have every split but the first empty."""
    dtype, group, head_dim = "float32", 4, 128
    rng = np.random.default_rng(5)
    inputs = make_paged_inputs(rng, [0, 1, 0, 1, 33, 0], 1, group, head_dim, dtype, fill_unused=1e4)
    out, lse = run_and_check(loop, gpu, _partial_name(group, head_dim, dtype), _merge_name(group, head_dim, dtype),
                             inputs, dtype, [1, 3, 64])
    empty = [b for b, n in enumerate(inputs["kv_lens"]) if n == 0]
    assert np.all(out[empty] == 0) and np.all(lse[empty] == MASKED_SCORE)


def test_all_sequences_empty(loop, gpu):
    """No sequence has a page (page_table_values gets one unused entry: WebGPU has no empty buffers)."""
    dtype, group, head_dim = "float32", 3, 64
    inputs = make_paged_inputs(np.random.default_rng(6), [0, 0], 1, group, head_dim, dtype)
    call = split_call(loop, gpu, _partial_name(group, head_dim, dtype), _merge_name(group, head_dim, dtype), inputs)
    try:
        for num_splits in (1, 4):
            out, lse = run_with_splits(loop, call, num_splits)
            assert np.all(out == 0) and np.all(lse == MASKED_SCORE)
    finally:
        call.release()


@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 4), (256, 3)])
def test_mixed_batch_with_rope(loop, gpu, head_dim, group):
    """Inline RoPE (rotate-half, as TVM defines it) at random offsets, in f32 (as the sharded test)."""
    dtype = "float32"
    inputs = make_paged_inputs(np.random.default_rng(head_dim), [3060, 17, 300], 1, group, head_dim, dtype,
                               rope_offset_range=500)
    rope = {"rotary_mode": 1, "rope_scale": 1.0, "rope_theta": 1e4}
    merge = _merge_name(group, head_dim, dtype)
    run_and_check(loop, gpu, _partial_name(group, head_dim, dtype), merge, inputs, dtype, [1, 6],
                  ROPE_F32_TOLERANCE, **rope)
    if (head_dim, group, dtype) in GROUP_HEADS:
        run_and_check(loop, gpu, _partial_name(group, head_dim, dtype, group_heads=True), merge, inputs, dtype,
                      [6], ROPE_F32_TOLERANCE, **rope)


@pytest.mark.parametrize("head_dim,dtype", list(WINDOWED.items()))
def test_sliding_window(loop, gpu, head_dim, dtype):
    """[3, B] length_info (last page length, window offset, sink): splits cut the attended rows."""
    _skip_without_f16(gpu, dtype)
    for seed, window in enumerate(({"window": 64, "sink": 4}, {"window": 300, "sink": 0})):
        inputs = make_paged_inputs(np.random.default_rng(head_dim + seed), [40, 70, 1000, 3060], 1, 4, head_dim,
                                   dtype, sliding_window=window, fill_unused=1e4)  # stray reads would blow up
        run_and_check(loop, gpu, _partial_name(4, head_dim, dtype, sliding_window=True),
                      _merge_name(4, head_dim, dtype), inputs, dtype, [1, 3, 40] if seed else [2, 5])


def test_unused_slots_are_never_read(loop, gpu):
    """Poison every slot outside the contexts; splits ending inside a page must stop there. S goes
    down as well as up: the workspace keeps stale partials of a larger S, which must not be read."""
    dtype = "float32"
    inputs = make_paged_inputs(np.random.default_rng(7), [257, 33, 1], 1, 4, 128, dtype, fill_unused=1e4)
    run_and_check(loop, gpu, _partial_name(4, 128, dtype), _merge_name(4, 128, dtype), inputs, dtype, [17, 2, 5, 1])


# -- host-side choice of S -------------------------------------------------------------------------------------
def test_pick_sharded_variant():
    llama8b, smollm2 = AttentionShape(8, 32, 128), AttentionShape(3, 9, 64)
    # About SPLIT_TARGET_WORKGROUPS workgroups (H_qo * S), powers of two, at least 64 rows a split.
    assert pick_sharded_variant([8192], llama8b, is_cpu=False) == AttentionChoice("split", 4)
    assert pick_sharded_variant([3000], smollm2, is_cpu=False) == AttentionChoice("split", 8)
    assert pick_sharded_variant([3000], AttentionShape(4, 8, 256), is_cpu=False) == AttentionChoice("split", 16)
    assert pick_sharded_variant([257], AttentionShape(4, 8, 256), is_cpu=False) == AttentionChoice("split", 4)
    assert pick_sharded_variant([8192] * 32, llama8b, is_cpu=False).num_splits == 1  # the batch fills the GPU
    assert pick_sharded_variant([8192] * 4, smollm2, is_cpu=False, max_rows=8).num_splits == 2  # the workspace
    assert pick_sharded_variant([8192], llama8b, is_cpu=True) == AttentionChoice("split_group", 1)  # lavapipe
    assert pick_sharded_variant([8192], llama8b, is_cpu=False, override="split_group:32") == \
        AttentionChoice("split_group", 32)
    with pytest.raises(ValueError, match="sharded variant"):
        pick_sharded_variant([8192], llama8b, is_cpu=False, override="fast:2")


def test_workspace_bytes():
    assert split_workspace_bytes(2 * 16, AttentionShape(8, 32, 128)) == \
        {"partial_o": 2 * 32 * 16 * 128 * 4, "partial_stats": 2 * 32 * 16 * 2 * 4}


# -- static checks on the built WGSL -------------------------------------------------------------------------
def test_wgsl_static_properties():
    for name, (entry, wgsl) in BUILT.items():
        spec = KernelSpec.from_json(entry)
        assert spec.workgroup_storage_bytes <= 16384, name
        assert re.search(r"@workgroup_size\((\d+), (\d+), (\d+)\)", wgsl).groups() == tuple(map(str, spec.workgroup_size))
        assert "num_splits" in [p["name"] for p in spec.pod], name  # a runtime scalar, never baked in
        if name.startswith("split_merge"):
            assert spec.grid[1] == "B" and spec.barriers == 0, name
            continue
        head_dim = int(re.search(r"_d(\d+)_", name).group(1))
        assert spec.grid[1] == ["*", "B", "num_splits"], name
        if "_grp" not in name:
            assert spec.invocations == 256, name
        assert len(spec.buffers) == 9, name  # as the sharded nest: the adapter must offer 9 (ask for 10)
        body = wgsl_block(wgsl, "for (var trip")
        # two row steps per trip: one barrier per row with split lanes, none at head_dim 64
        assert body.count("workgroupBarrier()") == (2 if head_dim > 64 else 0), name
        # no division by the runtime num_splits inside the row loop
        assert "num_splits" not in body, name
