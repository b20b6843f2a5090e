"""x as int8 codes for the decode q4 and q8a matmuls (kernels.quantize_x, MatmulSpec.int8_x) against float64.

The quantizer's codes and stats are checked against the same rule in float64 (a code may differ by
one where v / d sits on a rounding boundary in f32); the matmul fed by it against the f64 product of
the dequantized weights with the dequantized codes of x (what the kernel computes, up to f32 sums),
and against the unquantized product with the looser tolerance that int8 codes of x cost.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from attention_reference import relative_l2
from contract.kernels import QUANTIZED_X, Role, int8_x_form, llama_kernels
from contract.model import SYNTHETIC_CONFIGS
from kernel_grid import (TEST_DECODE_MATMULS, TEST_MATMUL_SUBGROUP_LANES, TEST_PROLOGUE_MATMULS, TEST_QUANTIZERS,
                         TEST_QUANTIZING_MATMUL, grid_matmul_name, grid_matmul_spec)
from kernels.quantize_x import CHUNK, CODE_MAX
from model_glue.model.forward import forward_roles
from test_prefill_kernels import NP_DTYPE, random_matrix, random_q4, skip_without_f16

LANES = TEST_MATMUL_SUBGROUP_LANES[0]
# The int8 path against the f64 product of the quantized x (f32 sums of exact integer dots):
# measured <= 2.6e-7 (f32 outputs), <= 3.1e-4 (f16 outputs, which add their own rounding).
QUANTIZED_TOLERANCE = {"float32": 2e-5, "float16": 1e-3}
# ... and against the product of the unquantized x: int8 codes of 16 values keep ~8 bits of each.
INT8_COST = 2e-2


def quantize_f64(v: np.ndarray):
    """kernels.quantize_x's rule in float64: per 16 values d = max|v| / 127, codes floor(0.5 + v / d);
    (codes, d, d * sum of the codes)."""
    chunks = v.reshape(v.shape[0], -1, CHUNK)
    amax = np.abs(chunks).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, CODE_MAX / np.where(amax > 0, amax, 1), 0)
    codes = np.floor(0.5 + chunks * inv)
    d = amax[..., 0] / CODE_MAX
    return codes, d, d * codes.sum(axis=2)


def unpack_codes(xq: np.ndarray, n: int) -> np.ndarray:
    """xq's words back to codes in element order: word 0's even elements, its odd ones, word 1's."""
    b = xq.view(np.int8).reshape(n, -1, 4, 4).astype(np.float64)  # [n, chunk, word (e0, o0, e1, o1), byte]
    codes = np.empty((n, b.shape[1], CHUNK))
    for u in range(2):
        codes[:, :, 8 * u + 0:8 * u + 8:2] = b[:, :, 2 * u]
        codes[:, :, 8 * u + 1:8 * u + 8:2] = b[:, :, 2 * u + 1]
    return codes


def upload(gpu, array):
    return gpu.storage_buffer(array.nbytes, np.ascontiguousarray(array).tobytes())


def run(loop, gpu, kernel, buffers, values, outputs):
    bound = kernel.bind(buffers, values)
    batch = gpu.batch()
    bound.dispatch(batch)
    batch.submit()
    got = [loop.run_until_complete(gpu.read(buffers[name], nbytes)) for name, nbytes in outputs]
    bound.release()
    return got


def quantize_on_gpu(loop, gpu, test_library, dtype, x, norm=None):
    """The quantizer's (xq, xstats) of x [n, width], as GPU buffers and as arrays."""
    n, width = x.shape
    kernel = loop.run_until_complete(test_library.kernel(TEST_QUANTIZERS[(dtype, norm is not None, None)]))
    xq, xstats = gpu.storage_buffer(n * width), gpu.storage_buffer(n * width // CHUNK * 16)
    buffers = {"x": upload(gpu, x.astype(NP_DTYPE[dtype])), "xq": xq, "xstats": xstats}
    if norm is not None:
        buffers["norm"] = upload(gpu, norm)
    raw_q, raw_s = run(loop, gpu, kernel, buffers, {"n": n, "vecs": width // 4}, [("xq", n * width),
                                                                                   ("xstats", n * width // CHUNK * 16)])
    return (xq, xstats), np.frombuffer(raw_q, np.uint32), np.frombuffer(raw_s, np.float32).reshape(n, -1, 4)


@pytest.mark.parametrize("normed", [False, True], ids=["plain", "normed"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_quantizer_matches_f64(loop, gpu, test_library, dtype, normed):
    """Codes, d, sum v and sum x^2 of widths that leave the last workgroup part-full, a zero chunk
    included (d = 0, codes 0)."""
    skip_without_f16(gpu, dtype)
    rng = np.random.default_rng(7)
    n, width = 2, 1344  # 84 chunks: a workgroup and a third
    x = (rng.standard_normal((n, width)) * rng.uniform(0.1, 3, (n, width // CHUNK, 1)).repeat(CHUNK, 2).reshape(n, width))
    x[1, 32:48] = 0
    x = x.astype(NP_DTYPE[dtype])
    norm = (1 + 0.2 * rng.standard_normal(width)).astype(np.float32) if normed else None
    _, xq, stats = quantize_on_gpu(loop, gpu, test_library, dtype, x, norm)
    xf = x.astype(np.float64)
    v = xf * norm if normed else xf
    codes, d, sums = quantize_f64(v)
    got = unpack_codes(xq, n)
    assert np.abs(got - codes).max() <= 1 and (got != codes).mean() < 1e-3
    assert np.allclose(stats[..., 0], d, rtol=1e-6, atol=0)
    assert np.allclose(stats[..., 1], sums, rtol=1e-6, atol=2 * d.max())  # a code off by one at most
    assert np.allclose(stats[..., 2], (xf.reshape(n, -1, CHUNK) ** 2).sum(axis=2), rtol=1e-5)
    assert np.all(stats[..., 3] == 0)
    assert np.all(got[1, 2] == 0) and stats[1, 2, 0] == 0


def test_quantizer_merges_a_split_call_as_the_merge_kernel_does(loop, gpu, test_library):
    """The merging quantizer's x is the merge of the partial states (online softmax over splits,
    the division), rounded to dtype, then quantized: checked against that merge in float64."""
    rng = np.random.default_rng(11)
    dtype, n, heads, splits, head_dim = "float32", 1, 6, 5, 64
    partial_o = rng.standard_normal((n, heads, splits, head_dim)).astype(np.float32)
    stats = np.stack([rng.uniform(-3, 3, (n, heads, splits)), rng.uniform(0.5, 4, (n, heads, splits))], -1)
    stats = stats.astype(np.float32)
    stats[0, 2, 1] = (-5e4, 0)  # an empty split adds nothing
    partial_o[0, 2, 1] = 0
    width = heads * head_dim
    kernel = loop.run_until_complete(test_library.kernel(TEST_QUANTIZERS[(dtype, False, head_dim)]))
    buffers = {"partial_o": upload(gpu, partial_o), "partial_stats": upload(gpu, stats),
               "xq": gpu.storage_buffer(n * width), "xstats": gpu.storage_buffer(n * width // CHUNK * 16)}
    raw_q, raw_s = run(loop, gpu, kernel, buffers, {"n": n, "vecs": width // 4, "heads": heads, "num_splits": splits},
                       [("xq", n * width), ("xstats", n * width // CHUNK * 16)])
    m = stats[..., 0].astype(np.float64)
    weight = np.exp2(m - m.max(axis=2, keepdims=True))
    merged = (partial_o * weight[..., None]).sum(2) / (stats[..., 1] * weight).sum(2)[..., None]
    codes, d, sums = quantize_f64(merged.reshape(n, width))
    got = unpack_codes(np.frombuffer(raw_q, np.uint32), n)
    assert np.abs(got - codes).max() <= 1 and (got != codes).mean() < 1e-2
    assert np.allclose(np.frombuffer(raw_s, np.float32).reshape(n, -1, 4)[..., 0], d, rtol=1e-5)


@pytest.mark.parametrize("flags", list(TEST_DECODE_MATMULS))
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_int8_x_matmul_matches_f64(loop, gpu, test_library, flags, dtype):
    """The quantizer, then the decode matmul reading its codes (each fold; 1, 2 and 4 weight rows a
    thread; one token and two), against float64; a normed matmul's quantizes_x build (x's codes made
    in its prologue) gives the same y, to the bit."""
    skip_without_f16(gpu, dtype)
    if not (gpu.subgroup_min_size and LANES <= gpu.subgroup_min_size):
        pytest.skip(f"{gpu.adapter_name}'s subgroups ({gpu.subgroup_min_size or 'none'}) hold no run of {LANES} lanes")
    out_features, in_features, residual, norm, swiglu = TEST_DECODE_MATMULS[flags]
    kernel = loop.run_until_complete(test_library.kernel(grid_matmul_name(flags, dtype, LANES, int8_x=True)))
    spec = grid_matmul_spec(flags, dtype, LANES, int8_x=True)
    assert set(QUANTIZED_X) <= set(kernel.buffer_names) and "x" not in kernel.buffer_names
    prologue = None
    if flags in TEST_PROLOGUE_MATMULS:
        prologue = loop.run_until_complete(test_library.kernel(grid_matmul_name(flags, dtype, LANES, int8_x=True,
                                                                                quantizes_x=True)))
        assert {"x", "norm"} <= set(prologue.buffer_names) and not set(QUANTIZED_X) & set(prologue.buffer_names)
    rng = np.random.default_rng(len(flags))
    words, scale, minv, w = random_matrix(rng, out_features, in_features, spec.weights)
    norm_weight = (1 + 0.2 * rng.standard_normal(in_features)).astype(np.float32) if norm else None
    columns = out_features // 2 if swiglu else out_features
    for n in (1, 2):
        x = rng.standard_normal((n, in_features)).astype(NP_DTYPE[dtype])
        resid = rng.standard_normal((n, columns)).astype(NP_DTYPE[dtype])
        (xq, xstats), _, _ = quantize_on_gpu(loop, gpu, test_library, dtype, x, norm_weight)
        xf = x.astype(np.float64)
        v = xf * norm_weight if norm else xf
        codes, d, _ = quantize_f64(v)
        inv_rms = 1 / np.sqrt((xf ** 2).mean(axis=1, keepdims=True) + 1e-5) if norm else 1

        def finish(dots):
            ref = dots * inv_rms
            if swiglu:
                gate, up = ref[:, :columns], ref[:, columns:]
                ref = gate / (1 + np.exp(-gate)) * up
            return ref + resid if residual else ref

        quantized = finish((codes * d[..., None]).reshape(n, in_features) @ w.T)  # the dequantized codes' product
        exact = finish(v @ w.T)
        y = gpu.storage_buffer(n * columns * x.itemsize)
        buffers = {"xq": xq, "xstats": xstats, "w": upload(gpu, words), "scale": upload(gpu, scale),
                   "wmin": upload(gpu, minv), "y": y}
        if residual:
            buffers["resid"] = upload(gpu, resid)
        raw, = run(loop, gpu, kernel, buffers, {"n": n, **spec.values}, [("y", n * columns * x.itemsize)])
        out = np.frombuffer(raw, NP_DTYPE[dtype]).reshape(n, columns).astype(np.float64)
        assert relative_l2(out, quantized) <= QUANTIZED_TOLERANCE[dtype], f"{flags} n={n}: {relative_l2(out, quantized):.2e}"
        assert relative_l2(out, exact) <= INT8_COST, f"{flags} n={n} against unquantized x"
        if prologue is not None:
            del buffers["xq"], buffers["xstats"]
            buffers.update({"x": upload(gpu, x), "norm": upload(gpu, norm_weight)})
            raw, = run(loop, gpu, prologue, buffers, {"n": n, **spec.values}, [("y", n * columns * x.itemsize)])
            assert np.array_equal(np.frombuffer(raw, NP_DTYPE[dtype]).reshape(n, columns), out.astype(NP_DTYPE[dtype])), \
                f"{flags} n={n}: the prologue's codes differ from the quantizer's"


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_matmul_quantizing_y_writes_what_the_quantizer_would(loop, gpu, test_library, dtype):
    """MatmulSpec.quantizes_y (gate/up's epilogue writes down's codes): its yq and ystats equal the
    quantizer's run on its own y, to the bit, and y is still written."""
    skip_without_f16(gpu, dtype)
    if not (gpu.subgroup_min_size and LANES <= gpu.subgroup_min_size):
        pytest.skip(f"{gpu.adapter_name}'s subgroups ({gpu.subgroup_min_size or 'none'}) hold no run of {LANES} lanes")
    flags = TEST_QUANTIZING_MATMUL
    out_features, in_features, _, _, _ = TEST_DECODE_MATMULS[flags]
    columns = out_features // 2
    spec = grid_matmul_spec(flags, dtype, LANES, int8_x=True, quantizes_y=True)
    kernel = loop.run_until_complete(test_library.kernel(grid_matmul_name(flags, dtype, LANES, True, True)))
    rng = np.random.default_rng(5)
    words, scale, minv = random_q4(rng, out_features, in_features)
    for n in (1, 2):
        x = rng.standard_normal((n, in_features)).astype(NP_DTYPE[dtype])
        norm = (1 + 0.2 * rng.standard_normal(in_features)).astype(np.float32)
        (xq, xstats), _, _ = quantize_on_gpu(loop, gpu, test_library, dtype, x, norm)
        buffers = {"xq": xq, "xstats": xstats, "w": upload(gpu, words), "scale": upload(gpu, scale),
                   "wmin": upload(gpu, minv), "y": gpu.storage_buffer(n * columns * x.itemsize),
                   "yq": gpu.storage_buffer(n * columns), "ystats": gpu.storage_buffer(n * columns)}
        y, yq, ystats = run(loop, gpu, kernel, buffers, {"n": n, **spec.values},
                            [("y", n * columns * x.itemsize), ("yq", n * columns), ("ystats", n * columns)])
        y = np.frombuffer(y, NP_DTYPE[dtype]).reshape(n, columns)
        _, want_q, want_stats = quantize_on_gpu(loop, gpu, test_library, dtype, y)
        assert np.array_equal(np.frombuffer(yq, np.uint32), want_q)
        assert np.array_equal(np.frombuffer(ystats, np.float32).reshape(n, -1, 4)[..., :2], want_stats[..., :2])
        codes, d, _ = quantize_f64(y.astype(np.float64))
        assert np.abs(unpack_codes(np.frombuffer(yq, np.uint32), n) - codes).max() <= 1


def test_the_normed_matmuls_quantize_x_themselves_only_where_the_codes_fit_workgroup_memory():
    """MatmulSpec.quantizes_x: the 8B shape's qkv and gate/up make x's codes in their prologues (no
    quantize_norm dispatch); a model too wide for its codes beside the partials in 16 KiB keeps the
    quantizer before them, and its forward pass still compiles that role."""
    eight_b = SYNTHETIC_CONFIGS["llama_3_1_8b"]
    wide = replace(eight_b, dim=8192, n_heads=64)
    for config, fits in ((eight_b, True), (wide, False)):
        specs = llama_kernels(config, "float16", 32, int8_x=True)
        assert int8_x_form(specs).normed_x_in_prologue == fits
        assert all(spec.prologue_fits == fits for role, spec in specs.items() if role.startswith("norm_")
                   and role.endswith("_xi8"))
        roles = forward_roles(True, int8_x=int8_x_form(specs))
        assert (Role.QUANTIZE_NORM in roles) == (not fits) and Role.QUANTIZE_MERGE in roles
