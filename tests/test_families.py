"""Each model family (contract.family) on WebGPU (wgpu/lavapipe) against the float64 reference, which
learns the family from the same description: a tiny random-weight model of each, prompts past Gemma's
sliding window and past the switch to the sharded nest, folded and apart, f32 and f16."""

import numpy as np
import pytest

from contract.family import ACTIVATIONS
from contract.gguf import config_from_metadata
from contract.kernels import GLU_NAMES, MatmulSpec
from contract.model import TEST_MODEL_CONFIGS
from convert.weights import load_artifact_weights, write_random_artifact
from model_glue.errors import ModelError
from model_glue.gpu.artifact import folder_readers
from model_glue.loading import load_model
from model_glue.options import RunOptions
from model_reference import ReferenceLlama

# Relative L2 of the logits against the reference: f32 differs in summation order only (measured
# <= 4.5e-6 over these models), f16 rounds every activation (<= 1.4e-3).
LOGIT_TOLERANCE = {"float32": 1e-4, "float16": 1e-2}
FAMILY_MODELS = ("tiny_gemma3", "tiny_qwen3", "tiny_qwen2")
CHUNK = 64  # the prompt in passes of this size: a head_dim 256 shape's prefill runs the decode kernels


@pytest.fixture(scope="module", params=FAMILY_MODELS)
def family_model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    write_random_artifact(request.param, out, seed=3)
    config, weights = load_artifact_weights(out)
    return request.param, out, ReferenceLlama(config, weights)


def run_and_compare(loop, gpu, library, folder, reference, vocab, dtype, prompt_tokens, steps=4, **options):
    read_text, read_bytes = folder_readers(folder)
    model = loop.run_until_complete(load_model(gpu, library, read_text, read_bytes, dtype=dtype,
                                               options=RunOptions(**options)))
    loop.run_until_complete(model.use(None))  # a forced layout's kernels
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, vocab, prompt_tokens)]
    for start in range(0, len(prompt), CHUNK):
        token = loop.run_until_complete(model.forward(prompt[start:start + CHUNK]))
    reference.reset()
    want = reference.forward(prompt, 0)[-1]
    nests = []
    for step in range(steps):
        got = np.frombuffer(loop.run_until_complete(model.read_logits()), np.float32).astype(np.float64)
        error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert error < LOGIT_TOLERANCE[dtype], f"step {step} at {model.kv.length} tokens: {error:.2e}"
        assert token == int(np.argmax(got))
        position, token_in = model.kv.length, token
        token = loop.run_until_complete(model.forward([token_in]))
        nests.append(model.stats[-1].nest)
        want = reference.forward([token_in], position)[-1]
    return model, nests


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("fold_norms", [True, False], ids=["norms-folded", "norms-apart"])
def test_family_logits_match_reference_past_the_window(loop, gpu, test_library, family_model, dtype, fold_norms):
    """40 tokens: past tiny Gemma's window of 32 in its sliding layers, the tiled nest; the family's
    QK-norm, biases, RoPE pairing and base per layer, post-norms and activation all in the logits."""
    name, folder, reference = family_model
    if dtype == "float16" and not gpu.has_f16:
        pytest.skip("adapter has no shader-f16")
    if dtype == "float16" and not TEST_MODEL_CONFIGS[name].arch.f16_activations:
        with pytest.raises(ModelError, match="activations overflow float16"):
            run_and_compare(loop, gpu, test_library, folder, reference, 0, dtype, 0)
        return
    model, nests = run_and_compare(loop, gpu, test_library, folder, reference, TEST_MODEL_CONFIGS[name].vocab_size,
                                   dtype, 40, fold_norms=fold_norms)
    assert set(nests) == {"tiled"}
    assert not any("_xi8" in kernel for kernel in model.kernel_names.values())  # int8 x is llama's layer only
    if fold_norms and TEST_MODEL_CONFIGS[name].arch.post_norms:
        # a decode step: embed; qkv (the post-norm and add before it folded in), RoPE, attention, o,
        # gate/up (likewise), down a layer; the last layer's post-norm, the head and argmax
        assert model.stats[-1].dispatches == 1 + 6 * model.config.n_layers + 3


@pytest.mark.parametrize("attention", ["auto", "tiled"])
def test_gemma_layers_past_the_switch(loop, gpu, test_library, family_model, attention):
    """300 tokens, f32: the sharded family over the whole context in the global layer and over the
    window in the sliding ones (or the tiled nest forced over both), equal to the reference."""
    name, folder, reference = family_model
    if name != "tiny_gemma3":
        pytest.skip("the sliding window is Gemma's")
    _, nests = run_and_compare(loop, gpu, test_library, folder, reference, TEST_MODEL_CONFIGS[name].vocab_size,
                               "float32", 300, steps=2, attention=attention)
    assert set(nests) == {"sharded" if attention == "auto" else "tiled"}


@pytest.mark.parametrize("attention", ["sharded", "auto"])
def test_gemma_o_projection_merges_a_split_call(loop, gpu, test_library, family_model, attention):
    """S = 4 over 300 tokens, f32, equal to the reference: with both calls split (the sharded nest
    forced), the o-projection before the post-norm merges the partial states (Matmul.O_MERGE), one
    dispatch a layer fewer than the merge kernel; with the window's call unsplit (auto: tiled over 32
    tokens) the merge kernel runs."""
    name, folder, reference = family_model
    if name != "tiny_gemma3":
        pytest.skip("the post-norm after o and the window are Gemma's")
    dispatches = {}
    for merge_in_o in (True, False):
        model, _ = run_and_compare(loop, gpu, test_library, folder, reference, TEST_MODEL_CONFIGS[name].vocab_size,
                                   "float32", 300, steps=2, attention=attention, layout="shards:4",
                                   merge_in_o=merge_in_o, time_attention_every=1)
        dispatches[merge_in_o] = model.stats[-1].dispatches
        assert ("o-projection" in model.stats[-1].timing_note) == (merge_in_o and attention == "sharded")
    saved = model.config.n_layers if attention == "sharded" else 0
    assert dispatches[True] == dispatches[False] - saved


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_a_family_gguf_opens_as_its_reference(loop, gpu, test_library, tmp_path, name):
    """A GGUF of the family (app.bench.gguf_files writes its keys, norms and biases by llama.cpp's names)
    opens through the runtime's own reader and matches the reference over the `gguf` package's reading."""
    from app.bench.gguf_files import write_llama_gguf
    from gguf_reference import load_gguf_weights
    from model_glue.formats.gguf_file import file_reader
    from model_glue.sources import GGUFFile, open_model

    path = tmp_path / f"{name}.gguf"
    write_llama_gguf(path, TEST_MODEL_CONFIGS[name], types={"matrix": "Q4_0", "embed": "Q8_0"}, seed=5, dense=False)
    reference = ReferenceLlama(*load_gguf_weights(path))
    opened = loop.run_until_complete(open_model(gpu, test_library, GGUFFile(*file_reader(path)), dtype="float32"))
    assert opened.model.config.family == TEST_MODEL_CONFIGS[name].family
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 500, 40)]
    token = loop.run_until_complete(opened.model.forward(ids))
    got = np.frombuffer(loop.run_until_complete(opened.model.read_logits()), np.float32).astype(np.float64)
    want = reference.forward(ids, 0)[-1]
    assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < LOGIT_TOLERANCE["float32"]
    assert token == int(np.argmax(want))


def test_a_family_config_from_gguf_metadata():
    """A gemma3 file's header gives the family, the window and head_dim wider than dim / heads."""
    metadata = {"general.architecture": "gemma3", "gemma3.embedding_length": 640, "gemma3.block_count": 18,
                "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
                "gemma3.attention.key_length": 256, "gemma3.feed_forward_length": 2048,
                "gemma3.rope.freq_base": 1e6, "gemma3.attention.layer_norm_rms_epsilon": 9.99999997e-07,
                "gemma3.attention.sliding_window": 512, "tokenizer.ggml.tokens": ["a"] * 262144}
    config = config_from_metadata(metadata, has_output_head=False)
    assert (config.family, config.sliding_window, config.head_dim, config.rms_eps) == ("gemma3", 512, 256, 1e-6)


def test_an_unsupported_architecture_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'phi3' \(it needs fused QKV.*runs llama, qwen2, qwen3, gemma3"):
        config_from_metadata({"general.architecture": "phi3"}, has_output_head=False)


def test_a_matmul_gate_is_one_key():
    """MatmulSpec.glu: the gate's activation or None; each is a kernel branch and names its fold."""
    from tvm.script import tirx as T

    from kernels.llama_common import gated

    assert set(GLU_NAMES) == set(ACTIVATIONS)
    assert "glu" not in MatmulSpec(512, 128, "float16").name
    for activation in ACTIVATIONS:
        gated(T.float32(1), T.float32(2), activation)  # the kernels have the activation
        assert f"_{GLU_NAMES[activation]}_" in MatmulSpec(512, 128, "float16", glu=activation).name
    with pytest.raises(ValueError, match="glu is one of"):
        MatmulSpec(512, 128, "float16", glu="relu")


def test_the_pages_prefill_check_gates_with_the_familys_activation():
    """app.page_bench.prefill_check's float64 reference of a gated matmul uses the spec's activation (GeGLU too)."""
    from app.page_bench.prefill_check import _activation
    from model_reference import ACTIVATIONS

    gates = np.linspace(-6, 6, 25)
    for glu, reference in ACTIVATIONS.items():
        assert np.allclose([_activation(glu, float(g)) for g in gates], reference(gates), rtol=1e-12, atol=1e-15)
