"""Faults in the native runtime: each one ends in a message a user can act on, and loses nothing.

The same runtime code runs in the page; tests/test_browser_faults.py drives the page's side of
the same faults in Chromium.
"""

from __future__ import annotations

import json
import shutil
import statistics

import pytest

from chat.session import ChatSession
from model_glue.sources import Artifact, open_model
from model_glue.gpu.artifact import ArtifactError, KernelLibrary, folder_readers
from model_glue.errors import ModelError
from model_glue.model.generate import STOPPED_IN_PREFILL, generate
from model_glue.options import RunOptions
from model_glue.gpu.webgpu import AdapterLimitError, DeviceLostError
from model_glue.gpu.webgpu_native import WgpuDevice

TINY_CHAT = __import__("conftest").STATIC / "artifacts" / "tiny_chat"


def open_device(loop, **caps):
    return loop.run_until_complete(WgpuDevice.open(limit_caps=caps))


def load_chat(loop, device, library, folder=TINY_CHAT, max_context=1024):
    return ChatSession(loop.run_until_complete(open_model(device, library, Artifact(folder_readers(folder)),
                                                          dtype="float32", options=RunOptions(max_context=max_context))))


# -- an adapter below what the artifact needs ------------------------------------------------------
@pytest.mark.parametrize("limit,value,needed_by", [
    ("maxStorageBuffersPerShaderStage", 8, "kernel decode_tiled_d64_kv1_qo2_f32 needs 9 (storage buffers"),
    ("maxComputeWorkgroupStorageSize", 4096, "bytes of workgroup storage"),
    ("maxComputeInvocationsPerWorkgroup", 128, "invocations per workgroup"),
    # (tiny_chat's 6 MiB embedding is bound a slice of its vocabulary at a time: test_big_tensor_slices.py)
    ("maxStorageBufferBindingSize", 16 << 10, "the largest weight tensor needs"),
])
def test_adapter_limits_too_low_are_refused_at_load(loop, artifact_dir, limit, value, needed_by):
    device = open_device(loop, **{limit: value})
    assert device.limits[limit] == value
    library = loop.run_until_complete(KernelLibrary.from_folder(device, artifact_dir))
    with pytest.raises(AdapterLimitError) as caught:
        load_chat(loop, device, library)
    message = str(caught.value)
    assert f"{limit} is {value} on this adapter" in message and needed_by in message, message
    assert device.live_buffers == 0  # refused before any weight was uploaded


def test_long_context_beyond_the_binding_limit_names_the_kv_cache(loop, artifact_dir):
    # 8192 tokens of tiny_chat's f32 KV cache: 8192 * 2 * 64 * 4 bytes = 4 MiB per layer
    device = open_device(loop, maxStorageBufferBindingSize=3 << 20)
    library = loop.run_until_complete(KernelLibrary.from_folder(device, artifact_dir))
    with pytest.raises(AdapterLimitError, match="one layer's KV cache needs 4194304 bytes"):
        load_chat(loop, device, library, max_context=8192)


# -- a missing or truncated artifact, a kernel that does not compile --------------------------------
@pytest.fixture
def broken_model(tmp_path):
    folder = tmp_path / "tiny_chat"
    shutil.copytree(TINY_CHAT, folder)
    return folder


def test_missing_and_truncated_model_files(loop, gpu, library, broken_model):
    (broken_model / "weights.bin").unlink()
    with pytest.raises(ModelError, match="cannot download the weights: .*weights.bin"):
        load_chat(loop, gpu, library, broken_model)
    (broken_model / "manifest.json").write_text((TINY_CHAT / "manifest.json").read_text()[:500])
    with pytest.raises(ModelError, match="cannot read the model manifest"):
        load_chat(loop, gpu, library, broken_model)
    (broken_model / "tokenizer.json").write_text((TINY_CHAT / "tokenizer.json").read_text()[:1000])
    with pytest.raises(ModelError, match="cannot load the tokenizer"):
        load_chat(loop, gpu, library, broken_model)


@pytest.fixture
def broken_kernels(tmp_path, artifact_dir):
    folder = tmp_path / "kernels"
    shutil.copytree(artifact_dir, folder)
    return folder


def test_missing_truncated_and_invalid_kernels(loop, gpu, broken_kernels):
    manifest = json.loads((broken_kernels / "manifest.json").read_text())
    wgsl = broken_kernels / manifest["kernels"]["rope_append_d64_f32"]["wgsl"]
    source = wgsl.read_text()
    wgsl.unlink()
    library = loop.run_until_complete(KernelLibrary.from_folder(gpu, broken_kernels))
    with pytest.raises(ArtifactError, match="kernel rope_append_d64_f32: .*No such file"):
        load_chat(loop, gpu, library)
    wgsl.write_text(source[: len(source) // 2])  # truncated: the compiler names the kernel
    library = loop.run_until_complete(KernelLibrary.from_folder(gpu, broken_kernels))
    with pytest.raises(RuntimeError, match="WGSL of rope_append_d64_f32 rejected"):
        load_chat(loop, gpu, library)
    (broken_kernels / "manifest.json").write_text("{\"format\": 1, \"kern")
    with pytest.raises(ArtifactError, match="cannot read the kernel manifest"):
        loop.run_until_complete(KernelLibrary.from_folder(gpu, broken_kernels))


# -- the device lost in the middle of a reply ---------------------------------------------------------
def test_device_lost_mid_reply_raises_a_clear_error_and_keeps_the_conversation(loop, artifact_dir):
    device = open_device(loop)
    library = loop.run_until_complete(KernelLibrary.from_folder(device, artifact_dir))
    chat = load_chat(loop, device, library)
    loop.run_until_complete(chat.reply("First turn", max_new_tokens=3))
    history = list(chat.messages)
    steps = []

    def lose_device_after_two_steps(stats):
        steps.append(stats)
        if len(steps) == 2:
            device._device.destroy()  # what a driver reset looks like from here

    with pytest.raises(DeviceLostError, match="the GPU device was lost"):
        loop.run_until_complete(chat.reply("Second turn", max_new_tokens=50, on_step=lose_device_after_two_steps))
    assert chat.messages == history  # the completed turns are untouched


# -- stop during prefill --------------------------------------------------------------------------------
def test_stop_during_prefill_ends_with_no_tokens_and_no_turn(loop, gpu, library):
    chat = load_chat(loop, gpu, library)
    prefilled = []
    long_message = " ".join(f"word{i}" for i in range(150))  # about 570 tokens: three prefill chunks
    result = loop.run_until_complete(chat.reply(
        long_message, max_new_tokens=8, on_prefill=lambda done, total: (prefilled.append(done), chat.request_stop())))
    assert result["stop_reason"] == STOPPED_IN_PREFILL and result["token_ids"] == [] and result["text"] == ""
    # Prefill chunks are pipelined: when the first chunk reports, the second is already submitted, so it
    # finishes (its K/V stay in the cache for the next turn) and no further chunk starts.
    assert prefilled == [256, 512] and prefilled[-1] < result["prompt_tokens"]
    assert chat.model.kv.length == 512
    assert chat.messages == []  # the turn is not part of the conversation


def test_generate_checks_stop_before_every_prefill_chunk(loop, gpu, library, tmp_path):
    chat = load_chat(loop, gpu, library)
    result = loop.run_until_complete(generate(chat.model, [5] * 600, max_new_tokens=4, should_stop=lambda: True))
    assert result.stop_reason == STOPPED_IN_PREFILL and chat.model.kv.length == 0


# -- no growth over many turns ----------------------------------------------------------------------------
def test_twenty_turns_keep_gpu_buffers_plans_and_dispatches_flat(loop, artifact_dir):
    device = open_device(loop)
    library = loop.run_until_complete(KernelLibrary.from_folder(device, artifact_dir))
    chat = load_chat(loop, device, library)
    live, plans, dispatches, step_ms = [], [], set(), []
    for turn in range(20):
        result = loop.run_until_complete(chat.reply(f"Turn {turn}: say something.", max_new_tokens=6,
                                                    options=RunOptions(attention="tiled")))
        decode = [s for s in result["stats"] if s["kind"] == "decode"]
        live.append(device.live_buffers)
        plans.append((len(chat.model._plans), len(chat.model._recorded)))
        dispatches |= {s["dispatches"] for s in decode}
        step_ms.append(statistics.median(s["step_ms"] for s in decode))
    # What would make later steps slower, checked as structure (a step's time on a busy machine is
    # the benchmarks' business, printed here): buffers, bound plans and recordings, dispatches a step.
    print(f"median decode step ms per turn: {[round(t, 2) for t in step_ms]}")
    assert len(set(live[1:])) == 1, f"live GPU buffers per turn: {live}"
    assert len(set(plans[1:])) == 1, f"bound plans and recordings per turn: {plans}"
    assert len(dispatches) == 1, f"dispatches per decode step: {sorted(dispatches)}"
