"""The pipelined decode loop (natively, wgpu/lavapipe): steps t+1 .. t+depth-1 are submitted before
step t's id is read back. Its ids, cache and stats must equal a plain one-step-at-a-time loop's,
and a stop (stop token, user stop) must leave no trace of the steps that were already submitted."""

from array import array

import pytest

from convert.weights import write_random_artifact
from contract.model import TEST_MODEL_CONFIGS
from model_glue.errors import ModelError
from model_glue.model.generate import STOPPED_BY_USER, generate
from model_glue.options import MAX_PIPELINE_DEPTH, RunOptions
from model_glue.policy import ATTENTION_TIMING_EVERY, GPU_PIPELINE_DEPTH
from test_model import load

TINY_VOCAB = TEST_MODEL_CONFIGS["tiny_llama"].vocab_size
PROMPT = [(37 * i + 11) % (TINY_VOCAB - 3) + 3 for i in range(30)]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_pipeline")
    write_random_artifact("tiny_llama", folder, seed=11)
    return folder


@pytest.fixture(scope="module")
def tiny(loop, gpu, test_library, tiny_folder):
    return load(loop, gpu, test_library, tiny_folder, "float32")


def one_step_at_a_time(loop, model, prompt, steps):
    """The unpipelined loop: each step fed the id the host read back from the one before."""
    model.reset()
    ids = [loop.run_until_complete(model.forward(prompt))]
    for _ in range(steps):
        ids.append(loop.run_until_complete(model.forward([ids[-1]])))
    return ids


def test_on_logits_sees_each_predictions_own_logits(loop, tiny):
    """generate's on_logits hook (the comparison's margins at teacher-forced misses): each prediction
    is the argmax of the logits the hook reads, so no later step has overwritten them, and the ids
    equal the pipelined run's."""
    argmaxes = []

    async def read(index, token_id):
        row = array("f", await tiny.read_logits())
        argmaxes.append((index, token_id, row.index(max(row))))

    want = loop.run_until_complete(generate(tiny, PROMPT, max_new_tokens=12)).token_ids
    got = loop.run_until_complete(generate(tiny, PROMPT, max_new_tokens=12, on_logits=read)).token_ids
    assert got == want and [(i, t) for i, t, _ in argmaxes] == list(enumerate(got))
    assert all(token_id == best for _, token_id, best in argmaxes), argmaxes


@pytest.mark.parametrize("depth", [2, 3, 4, MAX_PIPELINE_DEPTH])
def test_pipelined_ids_equal_one_step_at_a_time(loop, tiny, depth):
    want = one_step_at_a_time(loop, tiny, PROMPT, 20)
    got = loop.run_until_complete(generate(tiny, PROMPT, max_new_tokens=21, options=RunOptions(pipeline_depth=depth)))
    assert got.token_ids == want
    assert tiny.kv.length == len(PROMPT) + 20  # the last id is never fed back
    assert tiny.cached_ids == PROMPT + want[:-1]
    decode = [s for s in got.stats if s.kind == "decode"]
    assert len(decode) == 20
    layers = tiny.config.n_layers
    # embed; per layer (rms_norm,) qkv, rope+append, attention, o+residual, (rms_norm,) gate/up
    # (, swiglu), down+residual; (rms_norm,) lm_head and argmax. GPUs fold the norms, SwiGLU, and
    # RoPE + the K/V append (into qkv): 5 per layer.
    per_layer, head = (5, 2) if tiny.run.fold_norms else (9, 3)
    assert {s.dispatches for s in decode} == {1 + per_layer * layers + head}
    assert all(s.encode_ms > 0 and s.wait_ms >= 0 for s in decode)
    if tiny.device.has_timestamps:  # attention timed in the first step and where the context is a multiple of N
        every = tiny.run.time_attention_every
        assert every == ATTENTION_TIMING_EVERY
        timed = [s for s in decode if s.attention_ms is not None]
        assert [s.context for s in timed] == [decode[0].context] + [
            s.context for s in decode[1:] if s.context % every == 0]
        assert len(timed) >= 2
        assert all(s.gpu_ms is not None for s in decode) and all(s.gpu_ms >= s.attention_ms for s in timed)
        assert all(s.timing_note.startswith("attention timed in sampled steps") for s in decode if s not in timed)
        # The GPU's idle time before a pass, from consecutive passes' timestamps: only for passes
        # submitted behind another (the first decode step waited for the prompt's id on the host).
        assert got.stats[0].gpu_gap_ms is None and decode[0].gpu_gap_ms is None
        assert all(s.gpu_gap_ms is not None and s.gpu_gap_ms >= 0 for s in decode[1:])


@pytest.mark.parametrize("stop_after, depth", [(1, 4), (2, 2), (2, 3), (7, GPU_PIPELINE_DEPTH)])
def test_a_stop_token_leaves_no_trace_of_the_steps_run_ahead(loop, tiny, stop_after, depth):
    want = one_step_at_a_time(loop, tiny, PROMPT, 12)
    stop = want[stop_after - 1]
    first = want.index(stop) + 1  # the stop token may also occur earlier
    tiny.reset()
    got = loop.run_until_complete(generate(tiny, PROMPT, max_new_tokens=12, stop_ids={stop},
                                           options=RunOptions(pipeline_depth=depth)))
    assert got.stop_reason == "stop token"
    assert got.token_ids == want[:first]
    assert tiny.kv.length == len(PROMPT) + first - 1
    assert tiny.cached_ids == PROMPT + want[:first - 1]
    assert [s.kind for s in got.stats] == ["prefill"] + ["decode"] * (first - 1)
    # the next turn continues from exactly this cache
    again = loop.run_until_complete(generate(tiny, PROMPT + want[:first], max_new_tokens=3, reuse_cache=True))
    assert again.reused_tokens == len(PROMPT) + first - 1


def test_a_user_stop_leaves_no_trace_of_the_steps_run_ahead(loop, tiny):
    want = one_step_at_a_time(loop, tiny, PROMPT, 12)
    tiny.reset()
    seen = []

    async def on_token(token_id):
        seen.append(token_id)

    got = loop.run_until_complete(generate(tiny, PROMPT, max_new_tokens=12, on_token=on_token,
                                           should_stop=lambda: len(seen) >= 5))
    assert got.stop_reason == STOPPED_BY_USER
    assert got.token_ids == want[:5] == seen
    assert tiny.kv.length == len(PROMPT) + 4
    assert len([s for s in got.stats if s.kind == "decode"]) == 4


def test_folded_norms_make_five_dispatches_per_layer(loop, gpu, test_library, tiny_folder):
    """What a GPU runs: norm_qkv_rope_append, attention, o_residual, norm_gate_up_swiglu, down_residual."""
    model = load(loop, gpu, test_library, tiny_folder, "float32", fold_norms=True)
    run = loop.run_until_complete(generate(model, PROMPT, max_new_tokens=4))
    assert {s.dispatches for s in run.stats if s.kind == "decode"} == {1 + 5 * model.config.n_layers + 2}


def test_a_prefill_pass_is_bound_once_and_rewritten_for_the_next_prompt(loop, gpu, test_library, tiny_folder, tiny):
    """The prefill plan: a second prompt of another length makes no bind group (only its uniforms
    change), and its ids and logits equal those of a model whose first prompt it is."""
    tiny.reset()
    loop.run_until_complete(generate(tiny, PROMPT, max_new_tokens=3))  # binds the prefill and decode plans
    made = tiny.device.bind_groups_made
    shorter = PROMPT[:17]
    tiny.reset()
    again = loop.run_until_complete(generate(tiny, shorter, max_new_tokens=3))
    assert tiny.device.bind_groups_made == made, "the second prompt's passes were bound again"
    logits = loop.run_until_complete(tiny.read_logits())
    fresh = load(loop, gpu, test_library, tiny_folder, "float32")
    first = loop.run_until_complete(generate(fresh, shorter, max_new_tokens=3))
    assert again.token_ids == first.token_ids
    assert logits == loop.run_until_complete(fresh.read_logits())


def test_the_warm_up_binds_the_first_prompts_passes_and_leaves_no_trace(loop, gpu, test_library, tiny_folder, tiny):
    """RunOptions.warm_up (GPUs' default): after the load, a first prompt of up to 255 tokens
    makes no bind group, and it answers exactly as on a model loaded without the warm-up."""
    warm = load(loop, gpu, test_library, tiny_folder, "float32", warm_up=True)
    assert warm.kv.length == 0 and warm.cached_ids == [] and warm.stats == []
    made = warm.device.bind_groups_made
    run = loop.run_until_complete(generate(warm, PROMPT, max_new_tokens=4))
    assert warm.device.bind_groups_made == made, "the first prompt's passes were bound after the warm-up"
    tiny.reset()
    assert run.token_ids == loop.run_until_complete(generate(tiny, PROMPT, max_new_tokens=4)).token_ids
    # a prompt past the switch, as long as a whole prefill chunk: its passes were bound too
    warm.reset()
    made = warm.device.bind_groups_made  # (the device is shared: `tiny` just bound its own)
    long_prompt = (PROMPT * 10)[:warm.run.prefill_chunk]
    loop.run_until_complete(generate(warm, long_prompt, max_new_tokens=3))
    assert warm.device.bind_groups_made == made, "a long prompt's passes were bound after the warm-up"


def test_continuing_from_the_gpu_needs_a_token_there(loop, tiny):
    tiny.reset()
    with pytest.raises(ModelError, match="no token on the GPU"):
        tiny.submit(None)



def test_later_decode_steps_replay_their_recorded_passes(loop, tiny):
    tiny.reset()
    loop.run_until_complete(generate(tiny, PROMPT, max_new_tokens=4))
    assert tiny.replayed_by == ["WgpuRecordedPasses"]  # wgpu-native called directly for the dispatches


def test_attention_is_timed_inside_the_steps_one_pass_or_in_passes_of_its_own(loop, gpu, test_library,
                                                                              tiny_folder, monkeypatch):
    """Attention is timed in sampled steps. Where the adapter writes timestamps inside passes
    (lavapipe does), a timed step is still one compute pass, each layer's attention bracketed by
    timestamps inside it; without that feature each timed layer's attention is a pass of its own."""
    if not gpu.has_timestamps:
        pytest.skip(f"{gpu.adapter_name} has no timestamp-query")
    for inside in (True, False):
        if not inside:
            monkeypatch.setattr(gpu, "timestamps_inside_passes", False)
        elif not gpu.timestamps_inside_passes:
            continue
        model = load(loop, gpu, test_library, tiny_folder, "float32")
        try:
            run = loop.run_until_complete(generate(model, PROMPT, max_new_tokens=ATTENTION_TIMING_EVERY + 2))
            decode = [s for s in run.stats if s.kind == "decode"]
            timed = [s for s in decode if s.attention_ms is not None]
            assert all(s.attention_ms > 0 for s in timed) and all(s.gpu_ms >= s.attention_ms for s in timed)
            assert 2 <= len(timed) < len(decode)
            tapes = [recorded.tape for key, recorded in model._recorded.items() if not key.prefill]
            layers = model.config.n_layers
            if inside:
                assert len(tapes) == 2 and all([op[0] for op in tape].count("begin") == 1 for tape in tapes)
                assert max([op[0] for op in tape].count("stamp") for tape in tapes) == 2 * layers + 2
            else:
                assert max([op[0] for op in tape].count("begin") for tape in tapes) > 2 * layers  # attention apart
                assert all("stamp" not in [op[0] for op in tape] for tape in tapes)
        finally:
            model.release()
