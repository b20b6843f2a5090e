"""The prefill kernels against float64: causal paged prefill attention (the whole prefix, and a
sliding window) and the tiled q4 matmul (its 128- and 32-token tiles), each also in its
subgroup-matrix build with the builtins emulated (tests/matrix_emulation.py).

Kernels come from the test artifact (tests/kernel_grid.py: TEST_PREFILL_ATTENTION, TEST_PREFILL_MATMULS).
f16 outputs must be within 2e-5 of their own floor (the f64 result rounded to f16) or 2.5e-4 relative
L2, f32 outputs within 1e-5; the matrix attention's within 2.5e-4 of the floor (its P is f16).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from contract.model import Q8A_BLOCK
from convert.weights import dequant_q4, dequant_q8a, pack_q4, pack_q8a
from kernel_grid import (GEMMA3_SHAPE, TEST_DECODE_MATMULS, TEST_MATMUL_SUBGROUP_LANES, TEST_MATRIX_ATTENTION_F32,
                         TEST_PREFILL_ATTENTION, TEST_PREFILL_MATMULS, TEST_PREFILL_TILES, grid_matmul_name,
                         grid_matmul_spec)
from model_glue.gpu.kernel import Kernel, evaluate
from model_glue.gpu.webgpu import SUBGROUP_MATRIX
from matrix_emulation import emulated
from kernels.build import build_kernel
from kernels.catalog import BUILDERS
from kernels.prefill_attention import dim_parts, prefill_layout
from kernels.wgsl import MAX_WORKGROUP_STORAGE
from contract.attention import MATRIX_PREFILL
from contract.kernels import PAGE_SIZE, WORKGROUP_STORAGE_BYTES, AttentionSpec
from attention_reference import relative_l2

TOLERANCE = {"float16": 2.5e-4, "float32": 1e-5}
NP_DTYPE = {"float16": np.float16, "float32": np.float32}
# (tokens cached before the chunk, chunk tokens): a fresh prompt, one token, chunks that start and end
# inside a page, chunks after a long cached prefix (multi-turn reuse), rows that leave a workgroup part-full.
CASES = [(0, 1), (0, 17), (0, 100), (5, 1), (5, 37), (16, 16), (300, 3), (200, 70)]
GROWING_KEY_CASES = [(0, 100), (200, 70)]
# the matrix build, emulated (slow on lavapipe): a chunk after a cached prefix that starts and ends
# inside a page, three tokens after a long prefix (with the growing keys below: rows that leave a
# workgroup part-full)
MATRIX_CASES = [(5, 37), (300, 3)]
# (tokens cached before the chunk, chunk tokens, window) for a sliding window (token i sees positions
# start + i - window + 1 .. start + i): a window of one (each token only itself); windows shorter
# than the prompt ending inside a page and a tile, or on a page edge (16); a long chunk whose later
# workgroups skip whole tiles; a window longer than the context (the causal prefix); windows that cut
# into the cached prefix, across tile (32) and page edges; Gemma 3's 512 after a long prefix.
WINDOW_CASES = [(0, 17, 1), (0, 100, 17), (0, 70, 16), (0, 300, 40), (5, 37, 512), (200, 70, 100), (300, 3, 33),
                (600, 90, 512)]
MATRIX_WINDOW_CASES = [(0, 17, 1), (0, 100, 17), (200, 70, 100), (300, 3, 33)]
# a case with rows whose window starts past their workgroup's first tile, again with K growing along
# the context and with flat scores: (label, K's growth, q's scale)
LATE_WINDOW_CASE = (200, 70, 100)
LATE_WINDOW_VARIANTS = [(", keys growing 1 + i / 32", 32, 2.0), (", flat scores", None, 0.05)]
# a K/V tile is at most this many positions (a divisor of it) in every build: positions below the
# first query's window start, rounded down to it, lie in tiles no workgroup may load
LARGEST_TILE = 32


def close_to(out, ref, dtype, label, extra=0.0):
    err = relative_l2(out, ref)
    floor = relative_l2(ref.astype(NP_DTYPE[dtype]), ref)
    assert err <= max(TOLERANCE[dtype], floor + 2e-5 + extra), f"{label}: rel L2 {err:.3e} (floor {floor:.3e})"


def skip_without_f16(gpu, dtype):
    if dtype == "float16" and not gpu.has_f16:
        pytest.skip("adapter has no shader-f16")


# -- attention -------------------------------------------------------------------------------------
def prefill_attention_f64(q, k, v, start, sm_scale, window=0):
    """q [n, H_qo, D]; k, v [H_kv, start + n, D] in position order: token i sees positions 0 .. start + i,
    with a window (> 0) only start + i - window + 1 .. start + i."""
    n, num_qo_heads, _ = q.shape
    group = num_qo_heads // k.shape[0]
    keys, positions = np.arange(start + n)[None, :], (start + np.arange(n))[:, None]
    visible = (keys <= positions) & ((window == 0) | (keys > positions - window))
    out = np.zeros(q.shape)
    for h in range(num_qo_heads):
        scores = q[:, h].astype(np.float64) @ k[h // group].T.astype(np.float64) * sm_scale
        scores = np.where(visible, scores, -np.inf)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[h // group].astype(np.float64)
    return out


def run_prefill_attention(loop, gpu, kernel, q, k, v, start, dtype, rng, stale=np.nan, window=0, unread=0):
    """Lay k, v out in shuffled pages (slots past the context hold `stale`, and so do the positions
    below `unread`, which no tile the kernel loads may hold) and run the kernel."""
    num_kv_heads, length, head_dim = k.shape
    used = -(-length // PAGE_SIZE)
    num_pages = used + 2  # pages the sequence does not own are never read
    pages = np.full((num_pages, 2, num_kv_heads, PAGE_SIZE, head_dim), stale, NP_DTYPE[dtype])
    page_ids = rng.permutation(num_pages)[:used].astype(np.int32)
    for i, page in enumerate(page_ids):
        rows = slice(max(i * PAGE_SIZE, unread), min((i + 1) * PAGE_SIZE, length))
        if rows.start < rows.stop:
            slots = slice(rows.start - i * PAGE_SIZE, rows.stop - i * PAGE_SIZE)
            pages[page, 0, :, slots] = k[:, rows]
            pages[page, 1, :, slots] = v[:, rows]
    q = q.astype(NP_DTYPE[dtype])

    def upload(array):
        return gpu.storage_buffer(array.nbytes, array.tobytes())

    out = gpu.storage_buffer(q.nbytes)
    bound = kernel.bind({"q": upload(q), "pages": upload(pages), "page_ids": upload(page_ids), "output": out},
                        {"n": q.shape[0], "num_pages": num_pages, "used_pages": used, "start": start,
                         "sm_scale": head_dim ** -0.5, "window": window})
    batch = gpu.batch()
    bound.dispatch(batch)
    batch.submit()
    raw = loop.run_until_complete(gpu.read(out, q.nbytes))
    bound.release()
    return np.frombuffer(raw, NP_DTYPE[dtype]).reshape(q.shape)


ATTENTION_CASES = [(shape, dtype, False) for shape, dtype in TEST_PREFILL_ATTENTION] + [
    (shape, "float16", True) for shape in dict.fromkeys(shape for shape, _dtype in TEST_PREFILL_ATTENTION)
    if shape.head_dim == 64 or shape.group > 1] + [(TEST_MATRIX_ATTENTION_F32, "float32", True)]
ATTENTION_IDS = [f"d{s.head_dim}-g{s.group}{'-smx' * m}-{d}" for s, d, m in ATTENTION_CASES]
# the matrix build's P is f16 (one rounding of each weight, up to 2^-11 of it, averaged over the keys;
# an f32 build's output shows it unrounded)
MATRIX_P_ROUNDING = 2.5e-4


def as_staged(matrix: bool, *arrays):
    """The matrix build's operands as its fragments hold them: f16 (an f32 build rounds its q, K and V)."""
    return [a.astype(np.float16) if matrix else a for a in arrays]


def attention_kernel(loop, gpu, test_library, test_artifact_dir, shape, dtype, matrix):
    name = AttentionSpec("prefill", shape, dtype, tag=MATRIX_PREFILL if matrix else None).name
    return matrix_kernel(loop, gpu, test_library, test_artifact_dir, name) if matrix else \
        loop.run_until_complete(test_library.kernel(name))


def random_chunk(rng, shape, dtype, start, n, growth=None, q_scale=2.0):
    """q of the chunk's n tokens and the K/V of all start + n positions (K growing along the context)."""
    length = start + n
    k = rng.standard_normal((shape.num_kv_heads, length, shape.head_dim))
    if growth:
        k *= 1 + np.arange(length)[None, :, None] / growth
    k = k.astype(NP_DTYPE[dtype])
    v = rng.standard_normal((shape.num_kv_heads, length, shape.head_dim)).astype(NP_DTYPE[dtype])
    q = (q_scale * rng.standard_normal((n, shape.num_qo_heads, shape.head_dim))).astype(NP_DTYPE[dtype])
    return q, k, v


# head_dim 256's matrix build (slow to compile emulated) runs in the windowed test only, whose cases
# include a window longer than the context
PLAIN_CASES = [case for case in ATTENTION_CASES if not (case[2] and case[0].head_dim == 256)]


@pytest.mark.parametrize("shape,dtype,matrix", PLAIN_CASES,
                         ids=[f"d{s.head_dim}-g{s.group}{'-smx' * m}-{d}" for s, d, m in PLAIN_CASES])
def test_prefill_attention_matches_f64(loop, gpu, test_library, test_artifact_dir, shape, dtype, matrix):
    """Every (cached prefix, chunk) case; stale NaNs in the pages' unused slots must not leak. Then
    keys that grow along the context, so a row's max moves tile after tile (the matrix build's lazy
    rescale of O runs: a wrong one is off by orders of magnitude)."""
    skip_without_f16(gpu, dtype)
    kernel = attention_kernel(loop, gpu, test_library, test_artifact_dir, shape, dtype, matrix)
    rng = np.random.default_rng(shape.head_dim * 10 + shape.group)
    for growth, cases in ((None, MATRIX_CASES if matrix else CASES), (32, GROWING_KEY_CASES[-1:] if matrix else GROWING_KEY_CASES)):
        for start, n in cases:
            q, k, v = random_chunk(rng, shape, dtype, start, n, growth)
            out = run_prefill_attention(loop, gpu, kernel, q, k, v, start, dtype, rng)
            ref = prefill_attention_f64(*as_staged(matrix, q, k, v), start, shape.head_dim ** -0.5)
            label = f"start {start}, n {n}{f', keys growing 1 + i / {growth}' if growth else ''}"
            assert np.isfinite(out).all(), f"{label}: non-finite output"
            close_to(out.astype(np.float64), ref, dtype, label, MATRIX_P_ROUNDING if matrix else 0.0)


@pytest.mark.parametrize("shape,dtype,matrix", ATTENTION_CASES, ids=ATTENTION_IDS)
def test_prefill_attention_with_a_sliding_window_matches_f64(loop, gpu, test_library, test_artifact_dir, shape, dtype,
                                                             matrix):
    """Every windowed case (WINDOW_CASES), with the positions that lie in tiles wholly below the first
    query's window poisoned with NaN in the pages (a kernel that loads such a tile, even to mask it,
    gives NaN: the windowed layer must cost O(n * window)). Then rows whose window starts past their
    workgroup's first tile (they see no key of it) with keys growing along the context (the matrix
    build's lazy rescale runs with a window) and with scores so flat that no row's max ever moves by
    RESCALE_AFTER (no rescale pass would clean up a masked key that such a row gave a weight)."""
    skip_without_f16(gpu, dtype)
    kernel = attention_kernel(loop, gpu, test_library, test_artifact_dir, shape, dtype, matrix)
    rng = np.random.default_rng(shape.head_dim * 10 + shape.group + 1)
    cases = MATRIX_WINDOW_CASES if matrix else WINDOW_CASES
    variants = [("", None, 2.0, cases)] + [(what, growth, q_scale, [LATE_WINDOW_CASE])
                                           for what, growth, q_scale in LATE_WINDOW_VARIANTS]
    for what, growth, q_scale, case_list in variants:
        for start, n, window in case_list:
            q, k, v = random_chunk(rng, shape, dtype, start, n, growth, q_scale)
            unread = max(start - window + 1, 0) // LARGEST_TILE * LARGEST_TILE
            out = run_prefill_attention(loop, gpu, kernel, q, k, v, start, dtype, rng, window=window, unread=unread)
            ref = prefill_attention_f64(*as_staged(matrix, q, k, v), start, shape.head_dim ** -0.5, window)
            label = f"start {start}, n {n}, window {window} (positions below {unread} unread){what}"
            assert np.isfinite(out).all(), f"{label}: non-finite output"
            close_to(out.astype(np.float64), ref, dtype, label, MATRIX_P_ROUNDING if matrix else 0.0)


def test_the_window_reference_is_the_causal_one_cut():
    """prefill_attention_f64 with a window: 0 and a window past the context are the causal prefix;
    a window of one is each token's own V; otherwise each row equals causal attention over its
    window's keys alone."""
    rng = np.random.default_rng(0)
    start, n = 20, 9
    q, k, v = (rng.standard_normal(shape) for shape in ((n, 4, 8), (1, start + n, 8), (1, start + n, 8)))
    causal = prefill_attention_f64(q, k, v, start, 0.3)
    assert np.allclose(prefill_attention_f64(q, k, v, start, 0.3, start + n), causal)
    assert np.allclose(prefill_attention_f64(q, k, v, start, 0.3, 1), np.broadcast_to(v[0, start:, None], q.shape))
    windowed = prefill_attention_f64(q, k, v, start, 0.3, 5)
    for i in range(n):  # token i: positions start + i - 4 .. start + i, i.e. the last of a 5-key context
        lo = start + i - 4
        alone = prefill_attention_f64(q[i:i + 1], k[:, lo:start + i + 1], v[:, lo:start + i + 1], 4, 0.3)
        assert np.allclose(windowed[i], alone[0])


def test_prefill_attention_tiles_fit_the_default_limits():
    """K/V tiles of two pages (head_dim 64, f16) down to a quarter page (256, f32) beside the merge's
    8 KiB fill exactly WebGPU's default 16 KiB; at head_dim 256 a row's dims are split over two of
    its threads (so that a thread keeps 32 vectors of q and O, as at 128); above 256 the build refuses."""
    for head_dim, dtype, tile_keys in ((64, "float16", 32), (64, "float32", 16), (128, "float16", 16),
                                       (128, "float32", 8), (256, "float16", 8), (256, "float32", 4)):
        assert prefill_layout(head_dim, dtype) == {"tile_keys": tile_keys, "workgroup_storage": 16384}
    assert [dim_parts(d) for d in (64, 128, 256)] == [1, 1, 2]
    for head_dim in (260, 512):
        with pytest.raises(ValueError):
            prefill_layout(head_dim, "float16")


def test_prefill_attention_declares_its_window():
    """Both builds take the window as an i32 PODArg (the runtime packs the values by name)."""
    specs = [AttentionSpec("prefill", GEMMA3_SHAPE, dtype, tag=tag) for dtype, tag in
             (("float16", None), ("float32", None), ("float16", MATRIX_PREFILL))]
    for spec in specs:
        built = build_kernel(spec.name, BUILDERS["prefill_attention_matrix" if spec.tag else "prefill_attention"](
            GEMMA3_SHAPE.num_kv_heads, GEMMA3_SHAPE.num_qo_heads, GEMMA3_SHAPE.head_dim, spec.dtype), {},
            spec.buffers, MAX_WORKGROUP_STORAGE if spec.tag else WORKGROUP_STORAGE_BYTES)
        assert {"name": "window", "type": "i32"} in built.spec.pod, (spec.name, built.spec.pod)
        assert {p["name"] for p in built.spec.pod} == {"n", "start", "sm_scale", "window"}, spec.name


# -- tiled matmul ------------------------------------------------------------------------------------
def random_q4(rng, rows, cols):
    codes = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
    scale = (rng.random((rows, cols // 32)) * 0.05).astype(np.float32)
    minv = (-rng.random((rows, cols // 32)) * 0.4).astype(np.float32)
    return pack_q4(codes), scale, minv


def random_matrix(rng, rows, cols, weights: str):
    """(packed codes, scale, min, the dequantized matrix in f64) of random q4 or q8a weights."""
    if weights == "q4":
        words, scale, minv = random_q4(rng, rows, cols)
        return words, scale, minv, dequant_q4(words, scale, minv).astype(np.float64)
    codes = rng.integers(-128, 128, (rows, cols)).astype(np.int8)
    scale = (rng.random((rows, cols // Q8A_BLOCK)) * 0.004).astype(np.float32)
    minv = (rng.standard_normal((rows, cols // Q8A_BLOCK)) * 0.05).astype(np.float32)
    words = pack_q8a(codes)
    return words, scale, minv, dequant_q8a(words, scale, minv).astype(np.float64)


F32_STREAM_SCALE = 1e5  # an f32 residual stream past f16's range (Gemma 3's is: docs/benchmarks.md)
MATMUL_CASES = [(flags, None, dtype, tile, matrix) for flags in TEST_PREFILL_MATMULS
                for dtype, tiles in TEST_PREFILL_TILES.items() for tile, matrix in tiles] + [
    (flags, lanes, dtype, 128, False) for flags in TEST_DECODE_MATMULS for lanes in (None, *TEST_MATMUL_SUBGROUP_LANES)
    for dtype in ("float16", "float32")]


_EMULATED: dict[tuple, Kernel] = {}  # (device, name) -> kernel: the emulated builds compile slowly on lavapipe


def matrix_kernel(loop, gpu, test_library, test_artifact_dir, name):
    """A subgroup-matrix kernel of the test artifact with its builtins emulated (the adapter has none),
    compiled once a session."""
    key = (id(gpu), name)
    if key not in _EMULATED:
        spec = test_library.specs[name]
        assert SUBGROUP_MATRIX in spec.features and spec.meta["source"] == "wgsl"
        wgsl = emulated((test_artifact_dir / spec.wgsl).read_text())
        plain = dataclasses.replace(spec, features=[f for f in spec.features if f != SUBGROUP_MATRIX])
        _EMULATED[key] = loop.run_until_complete(Kernel.compile(gpu, plain, wgsl))
    return _EMULATED[key]


@pytest.mark.parametrize("flags,subgroup_lanes,dtype,token_tile,matrix", MATMUL_CASES,
                         ids=[f"{flags}{f'-sg{lanes}' if lanes else ''}{'-smx' * matrix}"
                              f"{f'-t{tile}' if tile != 128 else ''}-{dtype}"
                              for flags, lanes, dtype, tile, matrix in MATMUL_CASES])
def test_prefill_matmul_matches_f64(loop, gpu, test_library, test_artifact_dir, flags, subgroup_lanes, dtype,
                                    token_tile, matrix):
    """y = x @ W^T with each fold, for token counts below, at and past a token tile (the tiled
    prefill matmul: 128-token tiles, 32-token tiles for short passes, and the subgroup-matrix build,
    emulated here, whose f16 fragments round the dequantized weight and x times the norm's weight to
    f16: its reference does too), and the decode matmul on rows of 96-4,096 weights, with one, two and four
    weight rows a thread (the grid says which: each doubling halves the workgroups), its lanes'
    partials meeting in workgroup memory or first S at a time by subgroup shuffles (where the
    adapter's subgroups hold S)."""
    skip_without_f16(gpu, dtype)
    if subgroup_lanes and not (gpu.subgroup_min_size and subgroup_lanes <= gpu.subgroup_min_size):
        pytest.skip(f"{gpu.adapter_name}'s subgroups ({gpu.subgroup_min_size or 'none'}) hold no run of "
                    f"{subgroup_lanes} lanes")
    decode = flags in TEST_DECODE_MATMULS
    out_features, in_features, residual, norm, swiglu = (TEST_DECODE_MATMULS if decode else TEST_PREFILL_MATMULS)[flags]
    name = grid_matmul_name(flags, dtype, subgroup_lanes, token_tile=token_tile, matrix=matrix)
    kernel = matrix_kernel(loop, gpu, test_library, test_artifact_dir, name) if matrix else \
        loop.run_until_complete(test_library.kernel(name))
    # out_features and eps are the kernel's runtime values
    spec = grid_matmul_spec(flags, dtype, subgroup_lanes, token_tile=token_tile, matrix=matrix)
    if decode:
        rows_per_thread = {"paired": 2, "quad": 4}.get(flags.split("_")[0], 1)
        columns = out_features // 2 if swiglu else out_features
        grid = evaluate(kernel.spec.grid[0], spec.values)
        assert grid == columns // (8 * rows_per_thread // (2 if swiglu else 1)), kernel.spec.grid
    rng = np.random.default_rng(len(flags))
    words, scale, minv, w = random_matrix(rng, out_features, in_features, spec.weights)
    norm_weight = (1 + 0.2 * rng.standard_normal(in_features)).astype(np.float32)
    if matrix:  # the f16 fragments: the dequantized weight rounded to f16 (and x times the norm's weight, below)
        w = w.astype(np.float16)
    w = w.astype(np.float64)
    columns = out_features // 2 if swiglu else out_features
    # the emulated 128-token matrix tiles are slow on lavapipe: one token, and 300 (two full tiles, one part-full)
    for n in ((1, 2) if decode else (1, 300) if matrix and token_tile == 128 else (1, 31, 37, 128, 300)):
        # an f32 normed x as large as Gemma 3's residual stream, past f16's range: it must be scaled before f16
        x = (rng.standard_normal((n, in_features)) * (F32_STREAM_SCALE if norm and dtype == "float32" else 1)
             ).astype(NP_DTYPE[dtype])
        resid = rng.standard_normal((n, columns)).astype(NP_DTYPE[dtype])
        xf = x.astype(np.float64)
        if norm:
            inv_rms = 1 / np.sqrt((xf ** 2).mean(axis=1, keepdims=True) + 1e-5)
            if matrix and dtype == "float32":  # staged as f16 after the norm's 1 / rms
                xf = (x.astype(np.float32) * norm_weight * inv_rms.astype(np.float32)).astype(np.float16).astype(np.float64)
            else:  # f16 x times the norm's weight staged, 1 / rms on the results
                xf = (x.astype(np.float32) * norm_weight).astype(np.float16) if matrix else xf * norm_weight
                xf = xf.astype(np.float64) * inv_rms
        elif matrix:  # the fragments' x is f16 (an f32 build rounds it)
            xf = x.astype(np.float16).astype(np.float64)
        ref = xf @ w.T
        if swiglu:
            gate, up = ref[:, :columns], ref[:, columns:]
            ref = gate / (1 + np.exp(-gate)) * up
        if residual:
            ref = ref + resid

        def upload(array):
            return gpu.storage_buffer(array.nbytes, np.ascontiguousarray(array).tobytes())

        y = gpu.storage_buffer(n * columns * x.itemsize)
        buffers = {"x": upload(x), "w": upload(words), "scale": upload(scale), "wmin": upload(minv), "y": y}
        if norm:
            buffers["norm"] = upload(norm_weight)
        if residual:
            buffers["resid"] = upload(resid)
        bound = kernel.bind(buffers, {"n": n, **spec.values})
        batch = gpu.batch()
        bound.dispatch(batch)
        batch.submit()
        out = np.frombuffer(loop.run_until_complete(gpu.read(y, n * columns * x.itemsize)), NP_DTYPE[dtype])
        bound.release()
        close_to(out.reshape(n, columns).astype(np.float64), ref, dtype, f"{flags} n={n}")
