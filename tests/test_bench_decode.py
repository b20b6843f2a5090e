"""`python -m app bench decode` natively (wgpu/lavapipe) on the tiny test model: the bench's own
entry, with contexts shorter than its warm-up prompt (the KV cache must hold the warm-up too)."""

import argparse

import pytest

import app.bench.decode as decode_bench
from convert.weights import write_random_artifact


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_bench")
    write_random_artifact("tiny_llama", folder, seed=5)
    return folder


def test_decode_bench_runs_a_context_shorter_than_its_warm_up(loop, gpu, test_library, test_artifact_dir, tiny_folder,
                                                              monkeypatch):
    async def inputs(args):  # the session's device and test kernels instead of opening new ones
        return gpu, test_library, args.model, "tiny_llama"

    monkeypatch.setattr(decode_bench, "bench_inputs", inputs)
    monkeypatch.setattr(decode_bench, "WARMUP_SECONDS", 0.0)  # one warm-up round
    # A shorter warm-up than the bench's 300 + 16 tokens (lavapipe prefills ~100 tokens/s), still
    # longer than the context + steps: the warm-up's run sizes the cache. (Before the fix the cache
    # held max(contexts, 300) + steps + 4 = 307 tokens, and the 300 + 16-token warm-up did not fit.)
    monkeypatch.setattr(decode_bench, "WARMUP_PROMPT", 72)
    monkeypatch.setattr(decode_bench, "WARMUP_NEW_TOKENS", 4)
    assert 64 + 3 + 1 < decode_bench.WARMUP_PROMPT + decode_bench.WARMUP_NEW_TOKENS
    args = argparse.Namespace(contexts=[64], steps=3, dtype="float32", synthetic=False, sample=False, json=None,
                              model=tiny_folder, kernels=test_artifact_dir)
    result = loop.run_until_complete(decode_bench.run_decode_bench(args))
    rows = result["rows"]
    assert len(rows) == 3 and all(row["context"] == 64 for row in rows)  # auto, auto held to shards, tiled
    assert all(row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 for row in rows)
