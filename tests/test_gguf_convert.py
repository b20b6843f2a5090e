"""`python -m app convert --gguf FILE` (app.convert_gguf): a GGUF saved as a model artifact through the
runtime's own loader. The artifact must be the model the file opens as: the same weights on the GPU
to the byte, the file's tokenizer and chat template, the same greedy reply."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from app.bench.gguf_files import write_llama_gguf
from app.convert_gguf import convert_gguf_file
from chat.session import ChatSession
from model_glue.sources import Artifact, GGUFFile, open_model
from contract.artifacts import GGUF_TOKENIZER_FILE, MANIFEST
from contract.model import ALL_MODEL_CONFIGS, model_tensors
from convert.weights import load_artifact_weights
from model_glue.gpu.artifact import folder_readers
from model_glue.errors import ModelError
from model_glue.formats.gguf_file import file_reader
from model_glue.options import RunOptions

TINY = ALL_MODEL_CONFIGS["tiny_llama"]
CHATML = "{% for m in messages %}<|im_start|>{{m.role}}\n{{m.content}}<|im_end|>\n{% endfor %}"
OPTIONS = RunOptions(max_context=512, warm_up=False)


@pytest.mark.parametrize("types,tokenizer,untied", [
    ({"matrix": "Q4_K", "embed": "Q8_0"}, "llama", False),  # exact repacks, SentencePiece
    ({"matrix": "Q6_K", "embed": "F16", "head": "Q4_0", "norm": "F16"}, "gpt2", True),  # requantized, BPE
], ids=["q4_k-sentencepiece", "q6_k-bpe-untied"])
def test_a_converted_gguf_is_the_model_the_file_opens_as(loop, gpu, test_library, tmp_path, types, tokenizer, untied):
    config = dataclasses.replace(TINY, tied_embeddings=not untied)
    path = tmp_path / "model.gguf"
    files = write_llama_gguf(path, config, types=types, tokenizer=tokenizer, chat_template=CHATML, seed=9)
    out = tmp_path / "artifact"
    manifest = loop.run_until_complete(convert_gguf_file(gpu, test_library, path, out, log=lambda message: None))
    _, dense = load_artifact_weights(out)  # each matrix read back in its format: the file's own values
    for name in ("layers.0.qkv", "layers.1.down"):
        np.testing.assert_allclose(dense[name], files[name], rtol=0, atol=1e-6 * np.abs(files[name]).max())
    assert manifest["config_name"] == "tiny_llama" and manifest["tokenizer"] == GGUF_TOKENIZER_FILE
    assert json.loads((out / GGUF_TOKENIZER_FILE).read_text())["tokenizer.ggml.model"] == tokenizer
    converted = ChatSession(loop.run_until_complete(open_model(gpu, test_library, Artifact(folder_readers(out)),
                                                               dtype="float32", options=OPTIONS)))
    read, size = file_reader(path)
    direct = ChatSession(loop.run_until_complete(open_model(gpu, test_library, GGUFFile(read, size), dtype="float32",
                                                            options=OPTIONS)))
    try:
        assert converted.model.config == direct.model.config and converted.template == direct.template
        for spec in model_tensors(direct.model.config):  # the bytes the GPU holds, tensor by tensor
            ours, theirs = (loop.run_until_complete(gpu.read(m.model.weights[spec.name], spec.nbytes))
                            for m in (converted, direct))
            assert ours == theirs, spec.name
        message = "Hello there, how are you?"
        assert converted.prompt_ids([{"role": "user", "content": message}]) == \
            direct.prompt_ids([{"role": "user", "content": message}])
        replies = [loop.run_until_complete(chat.reply(message, max_new_tokens=6)) for chat in (converted, direct)]
        assert replies[0]["token_ids"] == replies[1]["token_ids"] and replies[0]["text"] == replies[1]["text"]
    finally:
        converted.model.release()
        direct.model.release()


def test_a_file_the_runtime_cannot_open_is_refused_before_anything_is_written(loop, gpu, test_library, tmp_path):
    path = tmp_path / "wide.gguf"
    write_llama_gguf(path, dataclasses.replace(TINY, ffn_dim=768), dense=False)
    with pytest.raises(ModelError, match="no kernels for this model's shape"):
        loop.run_until_complete(convert_gguf_file(gpu, test_library, path, tmp_path / "out", log=lambda m: None))
    assert not (tmp_path / "out").exists()


def test_the_cli_converts_and_names_a_refusal(tmp_path, test_artifact_dir):
    """`python -m app convert --gguf FILE --out DIR --kernels DIR`: an artifact, or exit 1 with the reason."""
    from conftest import ROOT

    good, bad = tmp_path / "good.gguf", tmp_path / "truncated.gguf"
    write_llama_gguf(good, TINY, dense=False)
    bad.write_bytes(good.read_bytes()[:4096])
    for path, out in ((good, tmp_path / "good"), (bad, tmp_path / "bad")):
        run = subprocess.run([sys.executable, "-m", "app", "convert", "--gguf", str(path), "--out", str(out),
                              "--kernels", str(test_artifact_dir)], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        if path is good:
            assert run.returncode == 0, run.stderr
            assert json.loads((out / MANIFEST).read_text())["config_name"] == "tiny_llama"
        else:
            assert run.returncode == 1 and run.stderr.startswith("error: ") and not out.exists(), run.stderr
