"""Synthetic models (model_glue.synthetic): weights filled on the GPU by kernels.random_fill.

- each fill kernel writes exactly what a numpy PCG of the same (index, seed) gives, across the
  grid's stride and for every tensor role;
- a synthetic tiny model runs like a converted one: its logits equal the f64 reference computed
  from the weights read back from the GPU, and the nests agree;
- one layer of the Llama-3.2-1B and Llama-3.1-8B shapes (the served kernels of those shapes; the
  8B head is its own matrix, not the embedding) against the same reference.
"""

import dataclasses

import numpy as np
import pytest

from contract.model import (ALL_MODEL_CONFIGS, SYNTHETIC_CONFIGS, codes_tensor, matrix_format, model_tensors,
                            synthetic_config_name)
from contract.kernels import Int8XForm
from contract.slices import is_vocab_tensor
from convert.weights import dequant_q4, dequant_q8, dequant_q8a
from model_glue.errors import ModelError
from model_glue.model.generate import generate
from model_glue.loading import load_synthetic_model
from model_glue.options import RunOptions
from model_glue.synthetic import fill_dispatches
from model_reference import ReferenceLlama

M32 = np.uint64(0xFFFFFFFF)


def pcg_words(n: int, seed: int, stream: int) -> np.ndarray:
    """kernels.random_fill's random word of elements 0..n-1, in numpy (uint64 arithmetic, masked)."""
    def pcg(x):
        state = (x * np.uint64(747796405) + np.uint64(2891336453)) & M32
        word = (((state >> ((state >> np.uint64(28)) + np.uint64(4))) ^ state) * np.uint64(277803737)) & M32
        return (word >> np.uint64(22)) ^ word

    i = np.arange(n, dtype=np.uint64)
    return pcg((pcg(i * np.uint64(2) + np.uint64(stream)) + np.uint64(seed)) & M32).astype(np.uint32)


def unit(words: np.ndarray) -> np.ndarray:
    return (words >> 8).astype(np.float32) * np.float32(1.0 / (1 << 24))


def read(loop, gpu, buffer, nbytes, dtype):
    return np.frombuffer(loop.run_until_complete(gpu.read(buffer, nbytes)), dtype=dtype)


def test_fill_kernels_match_numpy(loop, gpu, test_library):
    """Lengths below, at and past the grid's stride; a seed with its top bit set in u32 arithmetic."""
    words, uniform, blocks = loop.run_until_complete(test_library.kernels(
        ["random_words", "random_uniform", "random_q4_blocks"]))
    spec = words.spec  # the grid's stride: every invocation of the fixed grid, once
    stride = spec.grid[0] * spec.invocations
    for n, seed in ((1000, 7), (stride, 123456789), (stride + 777, 2_000_000_011)):
        out, other = gpu.storage_buffer(4 * n), gpu.storage_buffer(4 * n)
        batch = gpu.batch()
        for kernel, buffers, values in ((words, {"out": out}, {"n": n, "seed": seed, "element_base": 0}),):
            kernel.bind(buffers, values).dispatch(batch)
        batch.submit()
        assert np.array_equal(read(loop, gpu, out, 4 * n, np.uint32), pcg_words(n, seed, 0)), (n, seed)

        batch = gpu.batch()
        uniform.bind({"out": out}, {"n": n, "seed": seed, "lo": -0.5, "hi": 2.0, "element_base": 0}).dispatch(batch)
        batch.submit()
        want = np.float32(-0.5) + np.float32(2.5) * unit(pcg_words(n, seed, 0))
        got = read(loop, gpu, out, 4 * n, np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-7, atol=1e-7)
        assert got.min() >= -0.5 and got.max() < 2.0

        batch = gpu.batch()
        blocks.bind({"scale": out, "wmin": other}, {"n": n, "seed": seed, "lo": 0.01, "hi": 0.03,
                                                     "element_base": 0}).dispatch(batch)
        batch.submit()
        scale = np.float32(0.01) + np.float32(0.02) * unit(pcg_words(n, seed, 0))
        wmin = -scale * (np.float32(7.3) + np.float32(0.4) * unit(pcg_words(n, seed, 1)))
        np.testing.assert_allclose(read(loop, gpu, out, 4 * n, np.float32), scale, rtol=1e-6)
        np.testing.assert_allclose(read(loop, gpu, other, 4 * n, np.float32), wmin, rtol=1e-6)
        gpu.destroy(out)
        gpu.destroy(other)


def test_every_tensor_is_filled_once():
    """Every tensor of the 8B shape gets exactly one fill, a Q4 matrix's min with its scale, each with
    its own seed; the head of an untied model is a tensor of its own."""
    config = SYNTHETIC_CONFIGS["llama_3_1_8b"]
    tensors = {t.name for t in model_tensors(config)}
    written = [name for _kernel, names, _values in fill_dispatches(config, 0) for name in names]
    assert sorted(written) == sorted(tensors) and "head.q8" in tensors
    seeds = [values["seed"] for _kernel, _names, values in fill_dispatches(config, 0)]
    assert len(set(seeds)) == len(seeds)


def skip_past_binding_limit(gpu, name: str, overrides: dict | None = None) -> None:
    """Skip where a tensor of the shape that is bound whole exceeds the adapter's binding limit (lavapipe:
    128 MiB); the vocabulary's (a 128k-token embedding or head) are bound a slice at a time (contract.slices)."""
    config = dataclasses.replace(ALL_MODEL_CONFIGS[synthetic_config_name(name)], **(overrides or {}))
    largest = max(t.nbytes for t in model_tensors(config) if not is_vocab_tensor(t.name))
    if largest > gpu.limits["maxStorageBufferBindingSize"]:
        pytest.skip(f"{name}: a {largest / 2**20:.0f} MiB tensor exceeds this adapter's maxStorageBufferBindingSize "
                    f"({gpu.limits['maxStorageBufferBindingSize'] / 2**20:.0f} MiB)")


def dense_weights(loop, gpu, model) -> dict:
    """The model's weights read back from the GPU, dequantized like convert.weights does."""
    raw = {t.name: read(loop, gpu, model.weights[t.name], t.nbytes, np.uint32 if t.dtype == "uint32" else np.float32)
           .reshape(t.shape) for t in model_tensors(model.config)}
    def matrix(name):
        codes, scale = raw[codes_tensor(model.config, name)], raw[f"{name}.scale"]
        fmt = matrix_format(model.config, name)
        return dequant_q8(codes, scale) if fmt == "q8" else {"q4": dequant_q4, "q8a": dequant_q8a}[fmt](
            codes, scale, raw[f"{name}.min"])

    dense = {"embed": matrix("embed"), "final_norm": raw["final_norm"]}
    if not model.config.tied_embeddings:
        dense["head"] = matrix("head")
    for layer in range(model.config.n_layers):
        p = f"layers.{layer}"
        for m in ("qkv", "o", "gate_up", "down"):
            dense[f"{p}.{m}"] = matrix(f"{p}.{m}")
        # the family's vectors as they are: norms (pre, post, QK) and biases
        dense.update({t.name: raw[t.name] for t in model_tensors(model.config)
                      if t.name.startswith(f"{p}.") and t.name.count(".") == 2 and t.dtype == "float32"})
    return dense


def logits_of(loop, model):
    return np.frombuffer(loop.run_until_complete(model.read_logits()), np.float32).astype(np.float64)


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name,overrides,dtype,tolerance,int8_x", [
    ("tiny_llama", None, "float32", 1e-4, False),
    ("tiny_llama", {"tied_embeddings": False}, "float16", 1e-2, False),  # the head's own matrix, as in the 8B shape
    ("llama-3.2-1b", {"n_layers": 1}, "float16", 1e-2, False),
    ("llama-3.1-8b", {"n_layers": 1, "vocab_size": 32768}, "float16", 1e-2, False),  # its layer: the 1B and 3B bind a whole vocabulary in slices
    # the int8_x decode matmuls: gate/up's epilogue quantizes down's x (16 columns a workgroup), qkv and
    # gate/up quantize theirs in their prologues; a smaller vocabulary keeps the embedding within
    # lavapipe's binding limit
    ("llama-3.2-1b", {"n_layers": 1, "vocab_size": 16384}, "float16", 3e-2, True),
], ids=["tiny-f32", "tiny-untied-f16", "llama-3.2-1b-one-layer", "llama-3.1-8b-one-layer", "llama-3.2-1b-int8-x"])
def test_synthetic_model_matches_reference(loop, gpu, test_library, name, overrides, dtype, tolerance, int8_x):
    """Prefill then decode steps; the f64 reference runs on the weights the GPU filled."""
    if dtype == "float16" and not gpu.has_f16:
        pytest.skip("adapter has no shader-f16")
    if int8_x and not (gpu.subgroup_min_size or 0) >= 8:
        pytest.skip(f"{gpu.adapter_name} has no subgroups of 8 or more")
    skip_past_binding_limit(gpu, name, overrides)
    model = loop.run_until_complete(load_synthetic_model(
        gpu, test_library, name, dtype=dtype, seed=5, overrides=overrides,
        options=RunOptions(max_context=512, warm_up=False, **(
            {"fold_norms": True, "matmul_subgroups": True, "matmul_int8_x": True} if int8_x else {}))))
    try:
        assert model.int8_x == (Int8XForm(True, True) if int8_x else None)
        dense = dense_weights(loop, gpu, model)
        assert ("head" in dense) == (not model.config.tied_embeddings)
        reference = ReferenceLlama(model.config.to_dict(), dense)
        prompt = [int(t) for t in np.random.default_rng(1).integers(3, min(model.config.vocab_size, 49152), 20)]
        token = loop.run_until_complete(model.forward(prompt))
        want = reference.forward(prompt, 0)[-1]
        for step in range(3):
            got = logits_of(loop, model)
            assert np.all(np.isfinite(got))
            assert rel_l2(got, want) < tolerance, f"{name} step {step}: {rel_l2(got, want):.2e}"
            assert token == int(np.argmax(got))
            want = reference.forward([token], reference.length)[-1]
            token = loop.run_until_complete(model.forward([token]))
    finally:
        model.release()


def test_synthetic_text_is_the_same_through_both_nests(loop, gpu, test_library):
    """The comparison's claim on a synthetic model: greedy ids through the switch at 256 agree."""
    model = loop.run_until_complete(load_synthetic_model(
        gpu, test_library, "tiny_llama", dtype="float32", seed=9, options=RunOptions(max_context=512, warm_up=False)))
    try:
        prompt = [int(t) for t in np.random.default_rng(2).integers(3, model.config.vocab_size, 240)]
        runs = {}
        for nest in ("tiled", "sharded"):
            model.reset()
            runs[nest] = loop.run_until_complete(generate(model, prompt, max_new_tokens=30,
                                                          options=RunOptions(attention=nest))).token_ids
        assert runs["tiled"] == runs["sharded"]
    finally:
        model.release()


def test_unknown_shape_and_f32_are_refused(loop, gpu, test_library):
    with pytest.raises(ModelError, match="no synthetic shape 'llama-9b'.*llama-3.1-8b"):
        loop.run_until_complete(load_synthetic_model(gpu, test_library, "llama-9b"))
    with pytest.raises(ModelError, match="float16 only"):
        loop.run_until_complete(load_synthetic_model(gpu, test_library, "llama-3.2-1b", dtype="float32"))
    assert "llama_3_1_8b" in ALL_MODEL_CONFIGS


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b"])
def test_whole_synthetic_shapes_stay_finite_and_agree_across_the_nests(loop, gpu, test_library, name):
    """Every layer of the shape (16 / 32): the logits stay finite (random weights with a common bias
    once overflowed f16 by the last layer, and argmax then returned the vocabulary size), and through
    the switch at 256 the sharded nest fed the tiled run's ids (teacher forcing) picks the same top-1 at
    >= 14 of 16 steps: random weights leave near-tied logits, where f16 rounding in either nest may
    flip a greedy id (the 8B shape's texts parted at step 10 once Llama 3's RoPE scaling changed the
    rotations). Needs a GPU (skipped on CPU rasterizers, where a whole shape's prompts take minutes)."""
    if not gpu.has_f16:
        pytest.skip("adapter has no shader-f16")
    if gpu.is_cpu:
        pytest.skip(f"{name}: every layer of the shape is too slow on {gpu.adapter_name}")
    config = ALL_MODEL_CONFIGS[synthetic_config_name(name)]
    skip_past_binding_limit(gpu, name)
    model = loop.run_until_complete(load_synthetic_model(gpu, test_library, name, seed=0,
                                                         options=RunOptions(max_context=512, warm_up=False)))
    try:
        prompt = [int(t) for t in np.random.default_rng(3).integers(3, config.vocab_size, 250)]
        runs = {}
        for nest in ("tiled", "sharded"):
            model.reset()
            runs[nest] = loop.run_until_complete(generate(model, prompt, max_new_tokens=16,
                                                          options=RunOptions(attention=nest))).token_ids
            logits = logits_of(loop, model)
            assert np.all(np.isfinite(logits)), f"{name} {nest}: {np.count_nonzero(~np.isfinite(logits))} logits not finite"
            assert all(0 <= t < config.vocab_size for t in runs[nest])
        model.reset()
        forced = loop.run_until_complete(generate(model, prompt, max_new_tokens=16, forced_ids=runs["tiled"],
                                                  options=RunOptions(attention="sharded"))).token_ids
        assert sum(a == b for a, b in zip(forced, runs["tiled"])) >= 14, (forced, runs["tiled"])
        assert len(set(runs["tiled"])) > 1  # not one id repeated (what NaN logits gave)
    finally:
        model.release()


@pytest.mark.parametrize("name", ["smollm2-360m", "smollm2-1.7b", "tinyllama-1.1b", "llama-3.2-3b", "qwen2.5-0.5b",
                                  "qwen3-0.6b"])
def test_the_served_shapes_run_one_layer_against_the_reference(loop, gpu, library, name):
    """The other served shapes (f16 kernels only, so that a user's GGUF of that shape runs): one layer
    with random weights from the served artifact, a prompt and decode steps, against the f64 reference
    on the weights read back. 15 query heads over 5 KV heads (SmolLM2-360M), 32 over 32 (1.7B), 32 over 4
    with a head of its own (TinyLlama), head_dim 128 with 24 over 8 (Llama-3.2-3B: needs more than
    lavapipe's binding limit), Qwen 2.5's 14 over 2 with QKV biases, Qwen 3's 16 x 128 over 8 on a
    1,024-wide model with QK-norm."""
    if not gpu.has_f16:
        pytest.skip("adapter has no shader-f16")
    config = ALL_MODEL_CONFIGS[synthetic_config_name(name)]
    skip_past_binding_limit(gpu, name)
    model = loop.run_until_complete(load_synthetic_model(gpu, library, name, seed=4, overrides={"n_layers": 1},
                                                         options=RunOptions(max_context=512, warm_up=False)))
    try:
        reference = ReferenceLlama(model.config.to_dict(), dense_weights(loop, gpu, model))
        prompt = [int(t) for t in np.random.default_rng(6).integers(3, config.vocab_size, 24)]
        token = loop.run_until_complete(model.forward(prompt))
        want = reference.forward(prompt, 0)[-1]
        for step in range(2):
            got = logits_of(loop, model)
            assert rel_l2(got, want) < 1e-2, f"{name} step {step}: {rel_l2(got, want):.2e}"
            want = reference.forward([token], reference.length)[-1]
            token = loop.run_until_complete(model.forward([token]))
    finally:
        model.release()
