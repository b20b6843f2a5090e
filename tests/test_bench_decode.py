"""`python -m app bench decode` natively (wgpu/lavapipe) on the tiny test model: the bench's own
entry, with contexts shorter than its warm-up prompt (the KV cache must hold the warm-up too)."""

import pytest

import app.bench.attention as attention_bench
import app.bench.decode as decode_bench
import app.bench.inputs as bench_inputs
from app.__main__ import build_parser
from convert.weights import write_random_artifact
from model_glue.gpu.artifact import folder_readers
from model_glue.loading import load_model
from model_glue.model import forward
from model_glue.model.generate import generate


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_bench")
    write_random_artifact("tiny_llama", folder, seed=5)
    return folder


def test_decode_bench_runs_a_context_shorter_than_its_warm_up(loop, gpu, test_library, test_artifact_dir, tiny_folder,
                                                              monkeypatch):
    async def inputs(args, tokenizer=False):  # the session's device and test kernels instead of opening new ones
        return gpu, test_library, args.model, "tiny_llama"

    monkeypatch.setattr(bench_inputs, "bench_inputs", inputs)
    monkeypatch.setattr(decode_bench, "WARMUP_SECONDS", 0.0)  # one warm-up round
    # A shorter warm-up than the bench's 300 + 16 tokens (lavapipe prefills ~100 tokens/s), still
    # longer than the context + steps: the warm-up's run sizes the cache. (Before the fix the cache
    # held max(contexts, 300) + steps + 4 = 307 tokens, and the 300 + 16-token warm-up did not fit.)
    monkeypatch.setattr(decode_bench, "WARMUP_PROMPT", 72)
    monkeypatch.setattr(decode_bench, "WARMUP_NEW_TOKENS", 4)
    assert 64 + 3 + 1 < decode_bench.WARMUP_PROMPT + decode_bench.WARMUP_NEW_TOKENS
    modes = ["default", "layout=shards", "attention=tiled", "time_attention_every=0",
             "time_attention_every=2,merge_in_o=off"]
    args = build_parser().parse_args(["bench", "decode", "--contexts", "64", "--steps", "3", "--dtype", "float32",
                                      "--model", str(tiny_folder), "--kernels", str(test_artifact_dir),
                                      *(arg for mode in modes for arg in ("--mode", mode))])
    result = loop.run_until_complete(decode_bench.run_decode_bench(args))
    rows = result["rows"]
    assert [row["mode"] for row in rows] == modes
    assert all(row["context"] == 64 for row in rows)
    assert all(row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 for row in rows)
    one_pass, timed = rows[3], rows[0]
    if gpu.has_timestamps:  # one pass: the step's GPU time, no attention time
        assert one_pass["gpu_ms"] > 0 and one_pass["attention_ms"] is None and timed["attention_ms"] > 0


@pytest.mark.parametrize("in_pass", [False, True], ids=["own-passes", "in-pass"])
def test_decode_profile_accounts_for_every_dispatch_of_a_step(loop, gpu, test_library, test_artifact_dir, tiny_folder,
                                                              monkeypatch, in_pass):
    """`--profile`: one step's dispatches, each timed alone (in a pass of its own, or with
    `--profile-in-pass` inside the step's one pass), grouped by role; every dispatch of the step is
    counted once, attention reads the context's K/V and the matmuls their weights."""
    if not gpu.has_timestamps:
        pytest.skip("the adapter has no timestamp-query")
    if in_pass and not gpu.timestamps_inside_passes:
        pytest.skip("the adapter writes no timestamps inside passes")

    async def inputs(args, tokenizer=False):
        return gpu, test_library, args.model, "tiny_llama"

    real = decode_bench.profile_contexts

    async def quick_profile(model, device, library, contexts, repeats, in_pass):  # fewer timing calls on a CPU
        return await real(model, device, library, contexts, repeats, iters=2, in_pass=in_pass)

    monkeypatch.setattr(bench_inputs, "bench_inputs", inputs)
    monkeypatch.setattr(decode_bench, "profile_contexts", quick_profile)
    monkeypatch.setattr(attention_bench, "STREAM_WORDS", 1 << 20)  # 4 MiB streamed: enough to check the plumbing
    monkeypatch.setattr(decode_bench, "WARMUP_SECONDS", 0.0)
    monkeypatch.setattr(decode_bench, "WARMUP_PROMPT", 40)
    monkeypatch.setattr(decode_bench, "WARMUP_NEW_TOKENS", 4)
    args = build_parser().parse_args(["bench", "decode", "--contexts", "24", "--steps", "2", "--dtype", "float32",
                                      "--model", str(tiny_folder), "--kernels", str(test_artifact_dir),
                                      "--mode", "default", "--profile", "--profile-repeats", "1"]
                                     + ["--profile-in-pass"] * in_pass)
    result = loop.run_until_complete(decode_bench.run_decode_bench(args))
    assert result["profile"]["in_pass"] == in_pass
    (row,) = result["profile"]["contexts"]
    roles = row["roles"]
    layers = 2  # tiny_llama
    assert roles["attention"]["dispatches"] == layers and roles["rope_append"]["dispatches"] == layers
    assert sum(r["dispatches"] for r in roles.values()) == result["rows"][0]["dispatches"][0], roles
    kv_heads, head_dim = 2, 64
    assert row["step_context"] == 24 + 4  # the run's 24 + 3 cached tokens, then the profiled one
    assert roles["attention"]["bytes"] == layers * row["step_context"] * kv_heads * head_dim * 2 * 4  # K and V, f32
    assert roles["down_residual"]["bytes"] > 0 and roles["argmax"]["bytes"] == 0
    assert all(r["us"] >= 0 for r in roles.values()) and row["profiled_sum_ms"] > 0
    # each role's cost inside the step: the one-pass step against that pass without the role
    assert row["one_pass_step_ms"] > 0 and all(isinstance(r["in_step_us"], float) for r in roles.values())


def test_a_step_leaving_kernels_out_runs_without_them(loop, gpu, test_library, tiny_folder, monkeypatch):
    """The profile's in-step costs come from one decode step encoded with some kernels left out: the
    step names every kernel it dispatches, a pass leaving some out dispatches only the others, every
    pass is timed, and the cache is left as it was."""
    if not gpu.has_timestamps:
        pytest.skip("the adapter has no timestamp-query")
    dispatched = []
    real_dispatch = forward.dispatch_alone

    def counting(batch, kernel, buffers, values):
        dispatched.append(kernel.name)
        real_dispatch(batch, kernel, buffers, values)

    monkeypatch.setattr(forward, "dispatch_alone", counting)
    read_text, read_bytes = folder_readers(tiny_folder)
    model = loop.run_until_complete(load_model(gpu, test_library, read_text, read_bytes, dtype="float32"))
    try:
        run = loop.run_until_complete(generate(model, [5, 6, 7, 8], max_new_tokens=3))
        length = model.kv.length
        dispatched.clear()
        names, _ = loop.run_until_complete(model.time_decode_step_leaving_out(gpu.timestamps(2), [frozenset()]))
        assert len(names) == run.stats[-1].dispatches and "argmax" in " ".join(names) and dispatched == names
        left_out = frozenset(name for name in names if "argmax" in name or "attention" in name or "decode_" in name)
        assert left_out and left_out != set(names)
        dispatched.clear()
        _, seconds = loop.run_until_complete(
            model.time_decode_step_leaving_out(gpu.timestamps(6), [frozenset(), left_out, frozenset(names)]))
        assert dispatched == names + [name for name in names if name not in left_out]
        assert len(seconds) == 3 and all(s >= 0 for s in seconds)
        assert model.kv.length == length
    finally:
        model.release()
