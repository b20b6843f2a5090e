"""Tensors bigger than one storage binding (contract.slices): on an adapter whose
maxStorageBufferBindingSize is smaller than the vocabulary's tensors, the embedding and the head run a
dispatch per slice of the vocabulary's rows, each binding a slice of the tensors (BufferSlice), and
a GGUF's repack and a synthetic model's fill write such tensors a binding at a time.

The small binding is real: the device is opened with the limit lowered (wgpu then refuses any larger
binding), and the model must give the same weights, the same logits (bit for bit: every logit is
the same arithmetic whichever slice computes it) and the same ids as on the uncapped device, and
the float64 reference's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from app.bench.gguf_files import write_llama_gguf
from contract.model import ALL_MODEL_CONFIGS, MODEL_CONFIGS
from contract.slices import VOCAB_SLICE_ROWS, RowSlice, row_slices, vocab_slices
from convert.weights import load_artifact_weights
from model_glue.gpu.artifact import KernelLibrary, folder_readers
from model_glue.gpu.webgpu import BufferSlice
from model_glue.gpu.webgpu_native import WgpuDevice
from model_glue.loading import load_model, load_synthetic_model
from model_glue.model.generate import Sampling, generate
from model_glue.options import RunOptions
from model_reference import ReferenceLlama
from test_gguf_model import compare, load as load_gguf
from test_synthetic import dense_weights, logits_of, rel_l2

TINY_CHAT = __import__("conftest").STATIC / "artifacts" / "tiny_chat"  # 49,152 rows of 128: a 6 MiB embedding
# tiny_llama's widths with a vocabulary of 2,048 (a 512 KiB embedding) beside its 128 KiB layer matrices
WIDE_VOCAB = dataclasses.replace(ALL_MODEL_CONFIGS["tiny_llama"], vocab_size=2048)
SMALL_BINDING = 256 << 10  # tiny_llama's largest layer tensor (gate_up's codes) is 128 KiB
# ... and what of each model then fits it: the KV cache of a short context and short prefill passes
SMALL_OPTIONS = {"max_context": 128, "prefill_chunk": 32, "warm_up": False}


def open_capped(loop, binding: int) -> WgpuDevice:
    device = loop.run_until_complete(WgpuDevice.open(limit_caps={"maxStorageBufferBindingSize": binding}))
    assert device.limits["maxStorageBufferBindingSize"] == binding
    return device


@pytest.fixture(scope="module")
def small_gpu(loop):
    return open_capped(loop, SMALL_BINDING)


@pytest.fixture(scope="module")
def small_test_library(loop, small_gpu, test_artifact_dir):
    return loop.run_until_complete(KernelLibrary.from_folder(small_gpu, test_artifact_dir))


# -- the slices ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,row_bytes,limit,count", [
    (262144, 640, 128 << 20, 2),  # Gemma 3 270M's tied embedding (Q8: 160 MiB of codes)
    (128256, 4096, 128 << 20, 4),  # Llama 3.1 8B's head
    (128256, 2048, 128 << 20, 2),  # Llama 3.2 1B's tied embedding
    (49152, 576, 128 << 20, 1),  # SmolLM2's: one slice
    (49152, 128, 1 << 20, 6),
    (49152, 128, 1_000_000, 7),  # uneven: six of 7,168 rows and one of 6,144
    (1000, 4, 1024, 4),  # the last slice short of the quantum
])
def test_row_slices_are_aligned_even_and_within_the_limit(rows, row_bytes, limit, count):
    slices = row_slices(rows, row_bytes, limit)
    assert len(slices) == count
    assert slices[0].first == 0 and sum(s.rows for s in slices) == rows
    assert all(a.first + a.rows == b.first for a, b in zip(slices, slices[1:]))
    assert all(s.first % VOCAB_SLICE_ROWS == 0 and s.rows * row_bytes <= limit for s in slices)
    assert all(s.first * row_bytes % 256 == 0 for s in slices)  # every binding offset aligned
    # even: all but the last alike, the last short of them by less than a quantum a slice
    assert len({s.rows for s in slices[:-1]}) <= 1 and 0 <= slices[0].rows - slices[-1].rows < count * VOCAB_SLICE_ROWS


def test_one_slice_where_the_vocabulary_fits_and_a_refusal_where_no_slice_does():
    c = MODEL_CONFIGS["smollm2_135m"]
    assert vocab_slices(c, 128 << 20) == vocab_slices(c, None) == (RowSlice(0, c.vocab_size),)
    with pytest.raises(ValueError, match="256 rows of 576 bytes exceed a binding of 100000 bytes"):
        vocab_slices(c, 100_000)
    with pytest.raises(ValueError, match="multiple of 256"):
        BufferSlice(object(), 128, 1024)


# -- a converted model ----------------------------------------------------------------------------------
def load_tiny_chat(loop, device, library, **options):
    read_text, read_bytes = folder_readers(TINY_CHAT)
    return loop.run_until_complete(load_model(device, library, read_text, read_bytes, dtype="float32",
                                              options=RunOptions(**{"warm_up": False, **options})))


def steps_of(loop, model, prompt, steps):
    """The greedy ids and each pass's logits over a prompt and `steps` decode steps."""
    ids, logits = [loop.run_until_complete(model.forward(prompt))], [logits_of(loop, model)]
    for _ in range(steps):
        ids.append(loop.run_until_complete(model.forward([ids[-1]])))
        logits.append(logits_of(loop, model))
    return ids, logits


@pytest.mark.parametrize("binding,slices", [(1 << 20, 6), (1_000_000, 7)], ids=["even", "uneven"])
@pytest.mark.parametrize("fold_norms", [True, False], ids=["norm-folded-head", "head-apart"])
def test_a_model_past_the_binding_gives_the_unsliced_logits_and_ids(loop, gpu, library, artifact_dir, binding, slices,
                                                                    fold_norms):
    """tiny_chat's embedding (6 MiB of codes) on bindings of 1 MiB: the same logits, bit for bit, and ids
    as on the whole adapter through a prompt, decode steps (their recorded replay included) and a
    sampled reply, and the f64 reference's logits."""
    options = {"max_context": 256, "fold_norms": fold_norms}
    whole = load_tiny_chat(loop, gpu, library, **options)
    small = open_capped(loop, binding)
    small_library = loop.run_until_complete(KernelLibrary.from_folder(small, artifact_dir))
    sliced = load_tiny_chat(loop, small, small_library, **options)
    try:
        assert whole.vocab_slices == (RowSlice(0, 49152),) and len(sliced.vocab_slices) == slices
        prompt = [int(t) for t in np.random.default_rng(2).integers(3, 49152, 40)]
        ids, logits = steps_of(loop, whole, prompt, 6)
        sliced_ids, sliced_logits = steps_of(loop, sliced, prompt, 6)
        assert sliced_ids == ids
        assert all(np.array_equal(a, b) for a, b in zip(sliced_logits, logits))
        config, weights = load_artifact_weights(TINY_CHAT)
        reference = ReferenceLlama(config, weights)
        want = reference.forward(prompt, 0)[-1]
        for step, got in enumerate(sliced_logits):
            assert rel_l2(got, want) < 1e-4, f"step {step}: {rel_l2(got, want):.2e}"
            assert ids[step] == int(np.argmax(want))
            want = reference.forward([ids[step]], reference.length)[-1]
        sampling = Sampling(temperature=0.8, top_k=20, seed=7)
        replies = []
        for model in (whole, sliced):
            model.reset()
            replies.append(loop.run_until_complete(generate(model, prompt, max_new_tokens=8, sampling=sampling)).token_ids)
        assert replies[0] == replies[1]
    finally:
        whole.release()
        sliced.release()


# -- a GGUF, repacked on the GPU --------------------------------------------------------------------------
@pytest.mark.parametrize("types,untied", [
    ({"matrix": "Q4_0", "embed": "Q8_0"}, False),  # Q8 embedding, repacked exactly
    ({"matrix": "Q4_K", "embed": "Q6_K", "head": "Q6_K"}, True),  # Q8A embedding and head (wide)
    ({"matrix": "Q4_0", "embed": "F16"}, False),  # Q8 requantized from floats
], ids=["q8", "q8a-untied", "f16-requantized"])
def test_a_gguf_past_the_binding_is_the_same_model(loop, gpu, test_library, small_gpu, small_test_library, tmp_path,
                                                   types, untied):
    """A vocabulary of 2,048 rows (a 512 KiB embedding) on 256 KiB bindings: each chunk's repack binds
    the slices of the outputs it writes; the weights read back, logits and ids equal the unsliced load's,
    and the file's f64 model's."""
    config = dataclasses.replace(WIDE_VOCAB, tied_embeddings=not untied)
    path = tmp_path / "model.gguf"
    dense = write_llama_gguf(path, config, types=types, seed=9)
    whole = load_gguf(loop, gpu, test_library, path, **SMALL_OPTIONS)
    sliced = load_gguf(loop, small_gpu, small_test_library, path, **SMALL_OPTIONS)
    try:
        assert len(whole.vocab_slices) == 1 and len(sliced.vocab_slices) > 1
        want, got = dense_weights(loop, gpu, whole), dense_weights(loop, small_gpu, sliced)
        assert want.keys() == got.keys() and all(np.array_equal(got[name], want[name]) for name in want)
        prompt = [int(t) for t in np.random.default_rng(3).integers(3, config.vocab_size, 12)]
        ids, logits = steps_of(loop, whole, prompt, 3)
        sliced_ids, sliced_logits = steps_of(loop, sliced, prompt, 3)
        assert sliced_ids == ids and all(np.array_equal(a, b) for a, b in zip(sliced_logits, logits))
        sliced.reset()
        # the file's f64 model; requantized from floats, the weights the GPU holds (read back)
        worst, agree = compare(loop, sliced, want if "F16" in types.values() else dense)
        assert worst < 1e-4 and agree == 4, (worst, agree)
    finally:
        whole.release()
        sliced.release()


# -- a synthetic model, filled on the GPU ------------------------------------------------------------------
def test_a_synthetic_model_past_the_binding_fills_the_same_weights(loop, gpu, test_library, small_gpu,
                                                                   small_test_library):
    """Each fill past a binding runs a slice at a time from its element on (element_base): the same
    weights, logits and ids as the unsliced fill."""
    overrides = {"vocab_size": WIDE_VOCAB.vocab_size, "tied_embeddings": False}
    models = [loop.run_until_complete(load_synthetic_model(device, lib, "tiny_llama", dtype="float32", seed=5,
                                                           overrides=overrides, options=RunOptions(**SMALL_OPTIONS)))
              for device, lib in ((gpu, test_library), (small_gpu, small_test_library))]
    whole, sliced = models
    try:
        assert len(whole.vocab_slices) == 1 and len(sliced.vocab_slices) > 1
        want, got = dense_weights(loop, gpu, whole), dense_weights(loop, small_gpu, sliced)
        assert all(np.array_equal(got[name], want[name]) for name in want)
        prompt = [int(t) for t in np.random.default_rng(4).integers(3, WIDE_VOCAB.vocab_size, 10)]
        ids, logits = steps_of(loop, whole, prompt, 3)
        sliced_ids, sliced_logits = steps_of(loop, sliced, prompt, 3)
        assert sliced_ids == ids and all(np.array_equal(a, b) for a, b in zip(sliced_logits, logits))
    finally:
        whole.release()
        sliced.release()
