"""The head's argmax in two dispatches (natively, wgpu/lavapipe): the head matmul writes the logits
and each workgroup's best (value, index), and argmax_partials reduces those pairs. The id must be
numpy's argmax of the logits the head wrote: the lowest index of the largest value, across a
workgroup and across workgroups; logits without a number (an f16 overflow's NaNs) give the
vocabulary size, as the one-dispatch argmax did."""

import struct

import numpy as np
import pytest

from contract.kernels import llama_kernels
from contract.model import MODEL_CONFIGS

CONFIG = MODEL_CONFIGS["tiny_chat"]  # SmolLM2's vocabulary and head shape: the kernels' real sizes
DTYPE = "float32"
BLOCK = 32


def q8_head(rng, tied_rows):
    """A random q8 head (u32 words of signed bytes, f32 scales) whose `tied_rows` are the same
    large row: their logits tie, above every other."""
    codes = rng.integers(-127, 128, (CONFIG.vocab_size, CONFIG.dim), dtype=np.int8)
    scales = np.full((CONFIG.vocab_size, CONFIG.dim // BLOCK), 1e-3, np.float32)
    codes[tied_rows] = 100
    scales[tied_rows] = 1.0
    return codes.view(np.uint32), scales, codes.astype(np.float64) * np.repeat(scales, BLOCK, axis=1)


def run_head(loop, gpu, library, x, words, scales):
    specs = llama_kernels(CONFIG, DTYPE)
    head = loop.run_until_complete(library.kernel(specs["lm_head"].name))
    argmax = loop.run_until_complete(library.kernel(specs["argmax"].name))
    groups = specs["lm_head"].workgroups
    buffers = {"x": gpu.storage_buffer(x.nbytes, x.tobytes()), "w": gpu.storage_buffer(words.nbytes, words.tobytes()),
               "scale": gpu.storage_buffer(scales.nbytes, scales.tobytes()),
               "y": gpu.storage_buffer(4 * CONFIG.vocab_size), "best": gpu.storage_buffer(8 * groups)}
    out = gpu.storage_buffer(4)
    batch = gpu.batch()
    bound = [head.bind(buffers, {"n": 1, **specs["lm_head"].values}),
             argmax.bind({"best": buffers["best"], "out": out}, specs["argmax"].values)]
    for kernel in bound:
        kernel.dispatch(batch)
    batch.submit()
    (token,) = struct.unpack("<i", loop.run_until_complete(gpu.read(out, 4)))
    logits = np.frombuffer(loop.run_until_complete(gpu.read(buffers["y"], 4 * CONFIG.vocab_size)), np.float32)
    for kernel in bound:
        kernel.release()
    return token, logits


@pytest.mark.parametrize("tied_rows", [[7, 9, 5000, 40000], [40000, 49151], [3, 4]],
                         ids=["within-and-across-groups", "across-groups", "neighbours"])
def test_the_argmax_is_the_lowest_index_of_the_largest_logit(loop, gpu, library, tied_rows):
    rng = np.random.default_rng(tied_rows[0])
    words, scales, weights = q8_head(rng, tied_rows)
    x = rng.uniform(0.5, 1.0, (1, CONFIG.dim)).astype(np.float32)  # positive: the tied rows' dot is the largest
    token, logits = run_head(loop, gpu, library, x, words, scales)
    want = weights @ x[0].astype(np.float64)
    assert np.linalg.norm(logits - want) / np.linalg.norm(want) < 1e-5
    assert len(set(logits[tied_rows].tolist())) == 1, "the tied rows' logits differ"
    assert token == int(np.argmax(logits)) == min(tied_rows)


def test_logits_without_a_number_give_the_vocabulary_size(loop, gpu, library):
    rng = np.random.default_rng(0)
    words, scales, _ = q8_head(rng, [1])
    x = np.full((1, CONFIG.dim), np.nan, np.float32)
    token, logits = run_head(loop, gpu, library, x, words, scales)
    assert np.isnan(logits).all() and token == CONFIG.vocab_size
