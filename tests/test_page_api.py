"""chat.page's plain functions, natively: what the page is told (no browser needed)."""

import json

import pytest

from chat.page import NVIDIA_F16_FLAG, parse_request, shader_f16_note
from contract.attention import LayoutChoice
from model_glue.errors import ModelError
from model_glue.options import RunOptions, load_time_options, option_kinds
from model_glue.policy import CPU_PIPELINE_DEPTH, GPU_PIPELINE_DEPTH


def test_an_nvidia_adapter_without_shader_f16_is_told_why_and_the_flag():
    note = shader_f16_note("nvidia", False)
    assert "f32 kernels" in note and "crbug.com/42251215" in note and NVIDIA_F16_FLAG in note
    assert shader_f16_note("nvidia", True) == "yes (f16 kernels)"
    assert shader_f16_note("Google / swiftshader", False) == "no (f32 kernels)"  # no NVIDIA advice elsewhere


def test_a_request_becomes_checked_options_and_sampling():
    settings = parse_request(json.dumps({"max_new_tokens": 12, "options": {"attention": "tiled"},
                                         "sampling": {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3}}))
    assert settings["options"] == RunOptions(attention="tiled") and settings["max_new_tokens"] == 12
    assert settings["sampling"].seed == 3 and settings["sampling"].top_k == 5
    with pytest.raises(ModelError, match="attention must be one of"):
        parse_request(json.dumps({"max_new_tokens": 4, "options": {"attention": "fastest"}}))
    with pytest.raises(ModelError, match="unknown run options"):
        parse_request(json.dumps({"max_new_tokens": 4, "options": {"atention": "tiled"}}))
    with pytest.raises(ModelError, match="bad request setting"):
        parse_request(json.dumps({"options": {}}))


def test_options_resolve_per_adapter_and_max_context_is_fixed_at_load():
    loaded = RunOptions(max_context=100_000).resolved(is_cpu=True, context_length=8192)
    assert loaded.max_context == 8192 and loaded.fold_norms is False and loaded.prefill_chunk == 256
    gpu = RunOptions().resolved(is_cpu=False, context_length=8192)
    assert gpu.fold_norms is True and gpu.prefill_chunk == 4096
    assert loaded.merged(RunOptions(layout="shards:8")).layout == LayoutChoice("shards", 8)  # parsed once, here
    assert RunOptions.from_json('{"layout": "subgroup:4"}').to_json()["layout"] == "subgroup:4"
    assert loaded.merged(RunOptions(prefill_chunk=37)).prefill_chunk == 37
    assert loaded.pipeline_depth == CPU_PIPELINE_DEPTH and gpu.pipeline_depth == GPU_PIPELINE_DEPTH
    assert loaded.merged(RunOptions(pipeline_depth=2)).pipeline_depth == 2
    assert gpu.warm_up is True and loaded.warm_up is False  # seconds on a CPU rasterizer
    with pytest.raises(ModelError, match="pipeline_depth must be 2"):
        RunOptions(pipeline_depth=1).check()
    with pytest.raises(ModelError, match="chosen when the model loads"):
        loaded.merged(RunOptions(max_context=64))
    with pytest.raises(ModelError, match="number of splits"):
        RunOptions(layout="shards:999")
    with pytest.raises(ModelError, match="sharded layout must be one of"):
        RunOptions.from_json('{"layout": "fast:2"}')


def test_every_request_option_merges_and_every_load_time_option_is_held():
    """merged and per_request read each field's metadata (model_glue.options.option): a request's value of
    every per-request field reaches the merged options, a None of an adapter-default field keeps the loaded
    value, and a load-time field may only be repeated; per_request leaves exactly the load-time ones."""
    loaded = RunOptions().resolved(is_cpu=False, context_length=8192)
    other = {"max_context": 64, "attention": "tiled", "layout": "shards:8", "prefill_chunk": 37, "pipeline_depth": 3,
             "time_attention_every": 5}
    for name, kind in option_kinds().items():
        value = other.get(name, not getattr(loaded, name))  # the flags: the other one (None's is True)
        request = RunOptions(**{name: value})
        if name in load_time_options():
            with pytest.raises(ModelError, match=f"{name} is chosen when the model loads"):
                loaded.merged(request)
            assert getattr(request.per_request(), name) is None
        else:
            assert getattr(loaded.merged(request), name) == getattr(request, name), name
            assert getattr(request.per_request(), name) == getattr(request, name), name
        if kind in ("auto-on-off", "count"):  # a request's None keeps what loaded
            assert getattr(loaded.merged(RunOptions()), name) == getattr(loaded, name), name
    assert set(load_time_options()) == {"max_context", "warm_up", "matmul_subgroups", "matmul_int8_x"}
