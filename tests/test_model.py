"""The model on WebGPU (wgpu/lavapipe): logits against the numpy reference, golden text, the
nest switch at 256 tokens, bad input. A tiny random-weight model (same code paths) keeps most
tests fast; the real SmolLM2 runs the golden and reference checks.
"""

import json
import shutil

import numpy as np
import pytest

from chat.session import ChatSession
from model_glue.sources import Artifact, open_model
from model_glue.gpu.artifact import folder_readers
from convert.weights import load_artifact_weights, write_random_artifact
from contract.attention import NESTS, AttentionChoice
from contract.model import TEST_MODEL_CONFIGS
from contract.kernels import Int8XForm
from model_glue.policy import DECODE_BATCH_MAX_TOKENS
from model_glue.errors import ModelError
from model_glue.model.generate import generate
from model_glue.loading import load_model
from model_glue.model.pass_plan import PassPlan
from model_glue.options import RunOptions
from model_reference import ReferenceLlama

ROOT_ARTIFACT = __import__("conftest").STATIC / "artifacts" / "smollm2"
GOLDEN_PROMPT = "What is the capital of France?"
TINY_VOCAB = TEST_MODEL_CONFIGS["tiny_llama"].vocab_size
GOLDEN_ANSWER = "The capital of France is Paris."
# Logit tolerances (relative L2 against the numpy reference over the whole vocab). f32 differs from
# the reference only in summation order: measured <= 2.3e-6 (tiny model). f16 rounds every
# activation and KV entry to 11 bits: measured <= 3.8e-3 (tiny) and <= 1.4e-3 (SmolLM2).
LOGIT_TOLERANCE = {"float32": 1e-4, "float16": 1e-2}
# The decode matmuls on int8 codes of x (MatmulSpec.int8_x) against the same reference, which keeps x
# exact: measured <= 1.8e-2 (f32) and 2.1e-2 (f16) over the tiny model's first decode steps
# (tests/test_int8_x.py checks the kernels against the int8 arithmetic itself, to f32 rounding).
INT8_LOGIT_TOLERANCE = 3e-2
# f16 logits of a split call merged by the o-projection against the merge kernel's (the same
# arithmetic; test_the_o_projection_merges_a_split_call_as_the_merge_kernel_does)
MERGE_ROUNDING_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_llama")
    write_random_artifact("tiny_llama", out, seed=3)
    return out


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir):
    config, weights = load_artifact_weights(tiny_dir)
    return ReferenceLlama(config, weights)


def load(loop, gpu, library, folder, dtype, **options):
    read_text, read_bytes = folder_readers(folder)
    return loop.run_until_complete(load_model(gpu, library, read_text, read_bytes, dtype=dtype,
                                              options=RunOptions(**options)))


def logits_of(loop, model):
    return np.frombuffer(loop.run_until_complete(model.read_logits()), np.float32).astype(np.float64)


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


MATMUL_BUILDS = {"lanes-in-memory": (False, False), "lanes-by-shuffles": (True, False), "int8-x": (True, True)}


@pytest.mark.parametrize("matmuls", list(MATMUL_BUILDS))
@pytest.mark.parametrize("fold_norms", [True, False], ids=["norms-folded", "norms-apart"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tiny_model_logits_match_reference(loop, gpu, test_library, tiny_dir, tiny_reference, dtype, fold_norms,
                                           matmuls):
    """Both forward layouts: RMSNorm folded into the next matmul (GPUs) and run apart (CPU
    rasterizers); the decode matmuls' (the RoPE epilogue's and the head's included) lanes meeting in
    workgroup memory, or by subgroup shuffles first (the test artifact's build for 8 lanes), and
    (with the norms folded) the decode step's q4 matmuls on int8 codes of x."""
    matmul_subgroups, int8_x = MATMUL_BUILDS[matmuls]
    if dtype == "float16" and not gpu.has_f16:
        pytest.skip("adapter has no shader-f16")
    if matmul_subgroups and not (gpu.subgroup_min_size or 0) >= 8:
        pytest.skip(f"{gpu.adapter_name} has no subgroups of 8 or more")
    if int8_x and not fold_norms:
        pytest.skip("the int8_x matmuls run only with the norms folded")
    model = load(loop, gpu, test_library, tiny_dir, dtype, fold_norms=fold_norms, matmul_subgroups=matmul_subgroups,
                 matmul_int8_x=int8_x)
    assert (model.matmul_subgroup_lanes is not None) == matmul_subgroups
    assert (model.int8_x is not None) == int8_x
    assert all(("_sg" in name) == matmul_subgroups for name in model.kernel_names.values()
               if name.startswith("matmul_decode"))
    assert any("_xi8" in model.kernels[role].name for role in model.kernels) == int8_x  # compiled: it runs
    tolerance = INT8_LOGIT_TOLERANCE if int8_x else LOGIT_TOLERANCE[dtype]
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, TINY_VOCAB, 40)]
    tiny_reference.reset()
    token = loop.run_until_complete(model.forward(prompt))
    want = tiny_reference.forward(prompt, 0)[-1]
    for step in range(6):  # after the prefill, then each decode step
        got = logits_of(loop, model)
        assert rel_l2(got, want) < tolerance, f"step {step}: {rel_l2(got, want):.2e}"
        assert token == int(np.argmax(got))
        assert int(np.argmax(want)) == token or np.sort(want)[-1] - np.sort(want)[-2] < 1e-2
        pos = model.kv.length
        token_in = token
        token = loop.run_until_complete(model.forward([token_in]))
        want = tiny_reference.forward([token_in], pos)[-1]


def test_a_chunked_prompt_matches_reference(loop, gpu, test_library, tiny_dir, tiny_reference):
    """300 tokens: two pipelined prefill passes (256 + 44; the second submitted before the first is
    read back, attending to its pages), then decode steps; then again in chunks of 37."""
    model = load(loop, gpu, test_library, tiny_dir, "float32")
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, TINY_VOCAB, 300)]
    run = loop.run_until_complete(generate(model, prompt, max_new_tokens=3))
    assert [s.tokens for s in run.stats if s.kind == "prefill"] == [256, 44]
    tiny_reference.reset()
    want = tiny_reference.forward(prompt + run.token_ids[:-1], 0)[-1]
    assert rel_l2(logits_of(loop, model), want) < LOGIT_TOLERANCE["float32"]
    # chunks that start and end inside pages: each attends to the pages of the ones before it
    model.reset()
    again = loop.run_until_complete(generate(model, prompt, max_new_tokens=3, options=RunOptions(prefill_chunk=37)))
    assert [s.tokens for s in again.stats if s.kind == "prefill"] == [37] * 8 + [4]
    assert again.token_ids == run.token_ids
    assert rel_l2(logits_of(loop, model), want) < LOGIT_TOLERANCE["float32"]


@pytest.mark.parametrize("cached", [40, 290], ids=["tiled-contexts", "sharded-contexts"])
def test_a_short_pass_runs_its_attention_as_a_decode_batch(loop, gpu, test_library, tiny_dir, tiny_reference, cached):
    """A follow-up pass of SHORT_PREFILL_TOKENS or fewer after a cached prefix runs the decode
    kernels over a batch of its tokens, each over its own prefix (LlamaModel.prefill_attention):
    its logits and the next step's match the float64 reference, as the causal prefill kernel's do."""
    model = load(loop, gpu, test_library, tiny_dir, "float32")
    prompt = [int(t) for t in np.random.default_rng(11).integers(3, TINY_VOCAB, cached + 9)]
    tiny_reference.reset()
    want = tiny_reference.forward(prompt, 0)[-2:]  # after the short pass, after the step that follows
    for decode_batch, nest in ((True, "tiled" if cached + 9 <= 256 else "sharded"), (False, "prefill")):
        model.reset()
        loop.run_until_complete(model.use(RunOptions(short_prefill_decode_attention=decode_batch)))
        loop.run_until_complete(model.forward(prompt[:cached]))
        token = loop.run_until_complete(model.forward(prompt[cached:-1]))
        assert (model.stats[-1].kind, model.stats[-1].tokens, model.stats[-1].nest) == ("prefill", 8, nest)
        assert rel_l2(logits_of(loop, model), want[0]) < LOGIT_TOLERANCE["float32"], decode_batch
        assert token == int(np.argmax(want[0]))
        loop.run_until_complete(model.forward(prompt[-1:]))
        assert rel_l2(logits_of(loop, model), want[1]) < LOGIT_TOLERANCE["float32"], decode_batch


def test_nest_switches_past_256_and_text_is_unchanged(loop, gpu, test_library, tiny_dir):
    """A context that crosses 256 tokens switches nest at the right step; auto == tiled-forced."""
    model = load(loop, gpu, test_library, tiny_dir, "float32")
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, TINY_VOCAB, 240)]
    runs = {}
    # auto (on this CPU adapter: subgroup where its subgroups hold 8 lanes, else shards_group; S=1),
    # tiled forced, and the sharded family held to each variant split (split kernel + merge; every
    # kernel alone runs in test_decode_attention.py): the greedy text must not change.
    overrides = ["shards:8", "shards_group:3"] + (["subgroup:5"] if model.runs_subgroups else [])
    for label, attention, override in [("auto", "auto", None), ("tiled", "tiled", None)] + [
            (o, "auto", o) for o in overrides]:
        runs[label] = loop.run_until_complete(generate(model, prompt, max_new_tokens=84,
                                                       options=RunOptions(attention=attention, layout=override)))
    auto = runs["auto"]
    decode = [s for s in auto.stats if s.kind == "decode"]
    assert {s.nest for s in decode if s.context <= 256} == {"tiled"}
    assert {s.nest for s in decode if s.context > 256} == {"sharded"}
    assert {s.kernel for s in decode if s.context > 256} == {"subgroup" if model.runs_subgroups else "shards_group"}
    assert {s.kernel for s in runs["shards:8"].stats if s.context > 256} == {"shards S=8"}
    switch = next(i for i, s in enumerate(decode) if s.nest == "sharded")
    assert decode[switch].context == 257
    steps_past_switch = len(decode) - switch
    assert steps_past_switch >= 64
    for label, run in runs.items():
        first = next((i for i, (x, y) in enumerate(zip(run.token_ids, runs["tiled"].token_ids)) if x != y), None)
        assert first is None, f"greedy text of {label} diverges from tiled at generated token {first}"


def test_bad_requests_get_clear_errors(loop, gpu, test_library, tiny_dir):
    model = load(loop, gpu, test_library, tiny_dir, "float32", max_context=64)
    with pytest.raises(ModelError, match="empty"):
        loop.run_until_complete(generate(model, [], max_new_tokens=4))
    with pytest.raises(ModelError, match="exceeds the context of 64"):
        loop.run_until_complete(generate(model, [5] * 60, max_new_tokens=10))
    # a stop request keeps what was generated so far
    calls = []
    result = loop.run_until_complete(generate(model, [5, 6, 7], max_new_tokens=20,
                                              should_stop=lambda: len(calls) >= 3,
                                              on_token=_collect(calls)))
    assert result.stop_reason == "stopped by user" and len(result.token_ids) == 3


def _collect(sink):
    async def on_token(token_id):
        sink.append(token_id)
    return on_token


def test_corrupted_weights_are_refused(loop, gpu, test_library, tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    offset = manifest["tensors"]["layers.1.down.q4"]["offset"]
    data = bytearray((broken / "weights.bin").read_bytes())
    data[offset + 5] ^= 0xFF
    (broken / "weights.bin").write_bytes(bytes(data))
    with pytest.raises(ModelError, match="layers.1.down.q4 is corrupted"):
        load(loop, gpu, test_library, broken, "float32")
    # a whole-file hash the caller checked skips the per-tensor hashes only if it is the manifest's
    read_text, read_bytes = folder_readers(broken)
    with pytest.raises(ModelError, match="layers.1.down.q4 is corrupted"):
        loop.run_until_complete(load_model(gpu, test_library, read_text, read_bytes, dtype="float32",
                                           verified_sha256="0" * 64))
    (broken / "weights.bin").write_bytes(bytes(data[:1000]))
    with pytest.raises(ModelError, match="incomplete download or corrupted"):
        load(loop, gpu, test_library, broken, "float32")


# -- the real model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(loop, gpu, library):
    if not (ROOT_ARTIFACT / "manifest.json").exists():
        pytest.fail("the SmolLM2 artifact is missing: run `make test` (it converts the GGUF)")
    dtype = "float16" if gpu.has_f16 else "float32"
    return ChatSession(loop.run_until_complete(open_model(gpu, library, Artifact(folder_readers(ROOT_ARTIFACT)),
                                                          dtype=dtype)))


def test_golden_answer_through_both_nests(loop, smollm2):
    """The comparison mode on the golden prompt: both nests answer exactly, identically."""
    smollm2.messages = []
    result = loop.run_until_complete(smollm2.compare(GOLDEN_PROMPT, max_new_tokens=16))
    for nest in NESTS:
        run = result["runs"][nest]
        assert run["text"].strip() == GOLDEN_ANSWER, (nest, run["text"])
        assert run["stop_reason"] == "stop token"
        # every step through the nest compared; the short prompt too (a decode batch: DECODE_BATCH_MAX_TOKENS)
        assert {s["nest"] for s in run["stats"] if s["kind"] == "decode"} == {nest}
        assert [(s["nest"], s["tokens"] <= DECODE_BATCH_MAX_TOKENS) for s in run["stats"] if s["kind"] == "prefill"] \
            == [(nest, True)]
    assert result["identical"] and result["first_divergence"] is None
    assert smollm2.messages == []  # comparing does not change the conversation


def test_real_model_logits_match_reference(loop, smollm2):
    """GPU logits after the prefill and after two decode steps vs numpy on the same weights."""
    config, weights = load_artifact_weights(ROOT_ARTIFACT)
    reference = ReferenceLlama(config, weights)
    model = smollm2.model
    model.reset()
    prompt = smollm2.prompt_ids([{"role": "user", "content": GOLDEN_PROMPT}])
    token = loop.run_until_complete(model.forward(prompt))
    want = reference.forward(prompt, 0)[-1]
    for step in range(3):
        got = logits_of(loop, model)
        assert rel_l2(got, want) < LOGIT_TOLERANCE[model.dtype], f"step {step}: {rel_l2(got, want):.2e}"
        assert token == int(np.argmax(want)), f"step {step}: top-1 differs"
        if step == 2:
            break
        pos = model.kv.length
        token_in = token
        token = loop.run_until_complete(model.forward([token_in]))
        want = reference.forward([token_in], pos)[-1]


# -- the decode plan ------------------------------------------------------------------------------
def test_decode_plan_rewrites_only_what_is_declared_per_step(loop, gpu, test_library, tiny_dir):
    model = load(loop, gpu, test_library, tiny_dir, "float32")
    loop.run_until_complete(generate(model, [5, 6, 7], max_new_tokens=6, options=RunOptions(attention="tiled")))
    plan = model._plans[PassPlan(1, AttentionChoice("tiled"), greedy=True, fold_norms=model.run.fold_norms)]
    attention = model.attention.tiled
    assert plan.per_step_kernels == [attention] * model.config.n_layers  # the context grows, nothing else
    assert plan.uniform_writes_per_step == 1  # every layer's attention reads the same uniform


def test_a_new_split_count_replays_the_same_plan(loop, gpu, test_library, tiny_dir):
    """S is a per-step value: decode steps at S=2 and S=4 share one bound plan and one recording
    (a plan per S would re-bind every pass each time the host's rule doubles S): one for the steps
    that time attention, one for those that run as one pass."""
    model = load(loop, gpu, test_library, tiny_dir, "float32")
    for layout in ("shards:2", "shards:4"):
        run = loop.run_until_complete(generate(model, [5, 6, 7], max_new_tokens=4,
                                               options=RunOptions(attention="sharded", layout=layout)))
        assert {s.kernel for s in run.stats if s.kind == "decode"} == {f"shards S={layout[-1]}"}
    # the tiny model's o-projection merges the splits at S = 2 and 4 (contract.kernels.o_merges_splits)
    passes = (False, True)
    keys = [PassPlan(1, AttentionChoice("sharded", "shards", 2), True, model.run.fold_norms, one_pass, o_merges=True)
            for one_pass in passes]
    assert keys == [PassPlan(1, AttentionChoice("sharded", "shards", 4), True, model.run.fold_norms, one_pass,
                             o_merges=True).key for one_pass in passes]
    decode_plans = [k for k in model._plans if k.attention.nest == "sharded" and not k.prefill]  # not the prompt's
    assert sorted(decode_plans, key=lambda k: k.one_pass) == keys and all(k in model._recorded for k in keys)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("matmul_subgroups", [False, True], ids=["lanes-in-memory", "lanes-by-shuffles"])
def test_the_o_projection_merges_a_split_call_as_the_merge_kernel_does(loop, gpu, test_library, tiny_dir,
                                                                       tiny_reference, dtype, matmul_subgroups):
    """A split attention call's partial states merged inside the o-projection (RunOptions.merge_in_o)
    give the merge dispatch's logits (to f16 rounding) and the f64 reference's, with one dispatch a layer
    fewer; the merging o-projection is a per-step kernel of the plan (S may change)."""
    if dtype == "float16" and not gpu.has_f16:
        pytest.skip("adapter has no shader-f16")
    if matmul_subgroups and not (gpu.subgroup_min_size or 0) >= 8:
        pytest.skip(f"{gpu.adapter_name} has no subgroups of 8 or more")
    model = load(loop, gpu, test_library, tiny_dir, dtype, matmul_subgroups=matmul_subgroups)
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, TINY_VOCAB, 70)]
    runs = {}
    for merge_in_o in (True, False):
        model.reset()
        run = loop.run_until_complete(generate(model, prompt, max_new_tokens=5, options=RunOptions(
            attention="sharded", layout="shards:4", merge_in_o=merge_in_o)))
        decode = [s for s in run.stats if s.kind == "decode"]
        runs[merge_in_o] = run.token_ids, logits_of(loop, model), {s.dispatches for s in decode}
        assert all(("o-projection" in s.timing_note) == merge_in_o for s in decode if s.attention_ms is not None)
    (ids, logits, dispatches), (ids_apart, logits_apart, dispatches_apart) = runs[True], runs[False]
    assert ids == ids_apart
    # f32: the same logits to the bit. f16: lavapipe's are too, but on the H200 a merged element may
    # round to f16 one way in the o-projection and the other in the merge kernel (likely NVIDIA's
    # compiler contracting each kernel's arithmetic its own way): measured rel L2 6.5e-4 / 6.8e-4, with
    # and without the matmul subgroup build, the ids the same. The 1e-3 allowed is about two f16 steps (2^-11 = 4.9e-4).
    merged_apart = rel_l2(logits, logits_apart)
    assert merged_apart == 0 if dtype == "float32" else merged_apart < MERGE_ROUNDING_TOLERANCE, (
        f"{int(np.sum(logits != logits_apart))} of {logits.size} logits differ, rel L2 {merged_apart:.3g}")
    assert len(dispatches) == 1 and dispatches == {d - model.config.n_layers for d in dispatches_apart}
    tiny_reference.reset()
    want = tiny_reference.forward(prompt + ids[:-1], 0)[-1]
    assert rel_l2(logits, want) < LOGIT_TOLERANCE[dtype]
    merging = model.kernels["o_residual_merge_decode"].name
    plans = [plan for key, plan in model._plans.items() if key.o_merges]
    assert plans and all(plan.per_step_kernels.count(merging) == model.config.n_layers for plan in plans)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_int8_x_quantizer_merges_a_split_call(loop, gpu, test_library, tiny_dir, tiny_reference, dtype):
    """With the int8_x matmuls a split call's partial states are merged by the o-projection's
    quantizer (no merge dispatch, no merging o-projection): the reference's logits to the int8
    tolerance, 7 dispatches a layer (qkv and gate/up quantize their own x: a quantizer before o and
    down only), the merging quantizer a per-step kernel of the plan (S may change)."""
    if dtype == "float16" and not gpu.has_f16:
        pytest.skip("adapter has no shader-f16")
    if not (gpu.subgroup_min_size or 0) >= 8:
        pytest.skip(f"{gpu.adapter_name} has no subgroups of 8 or more")
    model = load(loop, gpu, test_library, tiny_dir, dtype, fold_norms=True, matmul_subgroups=True, matmul_int8_x=True)
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, TINY_VOCAB, 70)]
    run = loop.run_until_complete(generate(model, prompt, max_new_tokens=5, options=RunOptions(
        attention="sharded", layout="shards:4", merge_in_o=True)))  # merge_in_o gives way to the quantizer
    decode = [s for s in run.stats if s.kind == "decode"]
    assert model.int8_x == Int8XForm(normed_x_in_prologue=True, down_codes_from_gate_up=False)
    assert {s.dispatches for s in decode} == {7 * model.config.n_layers + 3}  # + embed, head, argmax
    assert all("quantizer" in s.timing_note for s in decode if s.attention_ms is not None)
    tiny_reference.reset()
    want = tiny_reference.forward(prompt + run.token_ids[:-1], 0)[-1]
    assert rel_l2(logits_of(loop, model), want) < INT8_LOGIT_TOLERANCE
    merging = model.kernels["quantize_merge_decode"].name
    plans = [plan for key, plan in model._plans.items() if key.attention.split and key.attention.nest == "sharded"]
    assert plans and all(plan.per_step_kernels.count(merging) == model.config.n_layers for plan in plans)
    assert all(model.attention.merge not in plan.per_step_kernels for plan in plans)


def test_int8_x_asked_for_where_it_cannot_run_is_refused(loop, gpu, test_library, tiny_dir, monkeypatch):
    """matmul_int8_x=True with the norms apart (no int8 roles exist for that path), or on a device whose
    WGSL lacks dot4I8Packed, is a clear ModelError at load, never a silent f16 run or a shader error."""
    if not (gpu.subgroup_min_size or 0) >= 8:
        pytest.skip(f"{gpu.adapter_name} has no subgroups of 8 or more")
    with pytest.raises(ModelError, match="norms folded"):
        load(loop, gpu, test_library, tiny_dir, "float32", fold_norms=False, matmul_subgroups=True, matmul_int8_x=True)
    monkeypatch.setattr(gpu, "has_packed_int8_dot", False)
    with pytest.raises(ModelError, match="dot4I8Packed"):
        load(loop, gpu, test_library, tiny_dir, "float32", fold_norms=True, matmul_subgroups=True, matmul_int8_x=True)


def test_a_value_change_that_is_not_declared_per_step_is_refused(loop, gpu, library):
    from model_glue.gpu.kernel import DispatchPlan, StaleBindingError

    kernel = loop.run_until_complete(library.kernel("row_sum_probe"))
    buffers = {"x": gpu.storage_buffer(8 * 256 * 4), "out": gpu.storage_buffer(8 * 4)}
    plan = DispatchPlan()
    for scale in (0.5, 0.5):  # the same values replay
        plan.start()
        plan.dispatch(gpu.batch(), kernel, buffers, {"n": 8, "scale": scale})
    plan.start()
    with pytest.raises(StaleBindingError, match=r"values \['scale'\] changed between steps"):
        plan.dispatch(gpu.batch(), kernel, buffers, {"n": 8, "scale": 0.25})
    replan = DispatchPlan()
    for scale in (0.5, 0.25):
        replan.start()
        for _ in range(2):  # per-step dispatches of one kernel with the same values in its first pass
            replan.dispatch(gpu.batch(), kernel, buffers, {"n": 8, "scale": scale}, per_step=True)
    assert replan.entries[0].values["scale"] == replan.entries[1].values["scale"] == 0.25
    assert replan.uniform_writes_per_step == 1
    replan.start()  # ... share a uniform, so within a pass they must agree
    replan.dispatch(gpu.batch(), kernel, buffers, {"n": 8, "scale": 0.5}, per_step=True)
    with pytest.raises(StaleBindingError, match="must share values"):
        replan.dispatch(gpu.batch(), kernel, buffers, {"n": 8, "scale": 0.125}, per_step=True)
