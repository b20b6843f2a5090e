"""kernels.gguf_repack on the GPU against the `gguf` package's own dequantizers (an independent reference).

Each GGUF type's raw blocks are random bytes with sane f16 fields (negative, subnormal and zero
scales among them), so every bit of every field is exercised:
- exact pairs (Q4_0 / Q4_1 / Q4_K -> Q4, Q8_0 -> Q8, every quantized type -> Q8A) keep the file's
  codes and their dequantized values equal gguf's to f32 rounding;
- every other pair requantizes: each weight is within half a quantization step of gguf's value.
The output lands at a block offset (`out_block`), as a fused matrix's later parts do.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from contract.gguf import EXACT_REPACKS, GGML_TYPES, REPACK_TARGETS, repack_kernel_name
from convert.weights import dequant_q4, dequant_q8, dequant_q8a, unpack_q8, unpack_q8a

# byte offsets of each block's f16 fields (d, dmin / m): they get sane values, the rest stays random
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}
OUT_BLOCK = 3  # output blocks before the tensor's: a fused matrix's later part


def random_raw(source: str, blocks32: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes of `blocks32` 32-weight blocks of `source`, gguf's dequantized f32 values)."""
    ggml = GGML_TYPES[source]
    n_blocks = blocks32 // ggml.sub_blocks
    if source in ("F32", "F16", "BF16"):
        values = (rng.standard_normal(blocks32 * 32) * 0.05).astype(np.float32)
        if source == "F32":
            raw = values.view(np.uint8)
        elif source == "F16":
            raw = values.astype(np.float16).view(np.uint8)
        else:
            raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        raw = rng.integers(0, 256, size=(n_blocks, ggml.block_bytes), dtype=np.uint8)
        for k, offset in enumerate(HALF_FIELDS[source]):
            halves = rng.uniform(0.002, 0.05, size=n_blocks).astype(np.float16)
            halves[::5] *= -1  # negative scales
            halves[1] = np.float16(3e-6)  # a subnormal f16
            halves[2] = 0
            raw[:, offset:offset + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
        raw = raw.reshape(-1)
    reference = dequantize(raw, GGMLQuantizationType[source]).astype(np.float32).reshape(-1)
    return np.ascontiguousarray(raw), reference


def run_repack(loop, gpu, kernel, target: str, raw: np.ndarray, blocks32: int) -> dict:
    padded = np.zeros((len(raw) + 3) // 4 * 4, np.uint8)
    padded[:len(raw)] = raw
    total = OUT_BLOCK + blocks32
    words, scales = {"q4": (4, 1), "q8": (8, 1), "q8a": (8, 2)}[target]  # a 32-weight block's
    out = {"raw": gpu.storage_buffer(len(padded), padded.tobytes()),
           target: gpu.storage_buffer(total * words * 4), "scale": gpu.storage_buffer(total * scales * 4)}
    if target != "q8":
        out["wmin"] = gpu.storage_buffer(total * scales * 4)
    batch = gpu.batch()
    kernel.bind(out, {"blocks": blocks32, "out_block": OUT_BLOCK}).dispatch(batch)
    batch.submit()

    def read(name, dtype):
        data = np.frombuffer(loop.run_until_complete(gpu.read(out[name], total * (words if name == target else scales) * 4)),
                             dtype)
        return data.reshape(total, -1)[OUT_BLOCK:]

    got = {name: read(name, np.uint32 if name == target else np.float32) for name in out if name != "raw"}
    for buffer in out.values():
        gpu.destroy(buffer)
    return got


@pytest.mark.parametrize("source", list(GGML_TYPES))
def test_repack_matches_gguf_dequantize(loop, gpu, test_library, source):
    rng = np.random.default_rng(sum(map(ord, source)))
    blocks32 = 8 * 37  # whole K-quant blocks; not a multiple of a workgroup
    raw, reference = random_raw(source, blocks32, rng)
    kernels = loop.run_until_complete(test_library.kernels([repack_kernel_name(source, t) for t in REPACK_TARGETS]))
    reference = reference.reshape(blocks32, 32)
    for target, kernel in zip(REPACK_TARGETS, kernels):
        got = run_repack(loop, gpu, kernel, target, raw, blocks32)
        if target == "q4":
            values = dequant_q4(got["q4"].reshape(1, -1), got["scale"].reshape(1, -1), got["wmin"].reshape(1, -1))
            step = np.abs(got["scale"])  # per block
        elif target == "q8a":
            values = dequant_q8a(got["q8a"].reshape(1, -1), got["scale"].reshape(1, -1), got["wmin"].reshape(1, -1))
            step = np.abs(got["scale"]).reshape(-1, 2).max(axis=1)  # the larger of a 32-block's two
        else:
            values = dequant_q8(got["q8"].reshape(1, -1), got["scale"].reshape(1, -1))
            step = got["scale"]
        values = values.reshape(blocks32, 32)
        span = np.abs(reference).max(axis=1, keepdims=True)
        if (source, target) in EXACT_REPACKS:
            np.testing.assert_allclose(values, reference, rtol=0, atol=1e-6 * span.max() + 1e-12,
                                       err_msg=f"{source} -> {target}")
            if source == "Q8_0":  # the code bytes themselves, in file order
                codes = raw.reshape(-1, 34)[:, 2:].view(np.int8)
                unpack = unpack_q8 if target == "q8" else unpack_q8a
                assert np.array_equal(unpack(got[target].reshape(1, -1)).reshape(-1, 32), codes)
        else:
            error = np.abs(values - reference)
            bound = 0.5 * step.reshape(-1, 1) * (1 + 1e-4) + 1e-6 * span
            assert (error <= bound).all(), f"{source} -> {target}: worst {np.max(error - bound)} over its half step"
