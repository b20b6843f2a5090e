"""Multi-turn KV reuse (natively, wgpu/lavapipe): a new turn prefills only what the cache lacks,
and its logits equal both the numpy reference and a full re-prefill's. Also the comparison's
teacher-forced misses, read from both runs' logits."""

from array import array

import numpy as np
import pytest
from conftest import STATIC

from chat.session import NEAR_TIE_LOGITS, ChatSession, is_near_tie, pick_figures
from model_glue.sources import Artifact, open_model
from convert.weights import load_artifact_weights, write_random_artifact
from model_glue.gpu.artifact import folder_readers
from contract.model import TEST_MODEL_CONFIGS
from model_glue.errors import ModelError
from model_glue.model.generate import generate
from model_glue.loading import load_model
from model_glue.options import RunOptions
from model_reference import ReferenceLlama
from page_hooks import break_sharded_nest, mend_sharded_nest
from test_model import LOGIT_TOLERANCE, logits_of, rel_l2

TINY_VOCAB = TEST_MODEL_CONFIGS["tiny_llama"].vocab_size
DTYPE = "float32"  # lavapipe has no shader-f16; the f16 bound is the same test with a looser tolerance
# Two prefills of the same ids over different chunkings differ only in summation order.
SAME_IDS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny(loop, gpu, test_library, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_cache")
    write_random_artifact("tiny_llama", folder, seed=5)
    read_text, read_bytes = folder_readers(folder)
    model = loop.run_until_complete(load_model(gpu, test_library, read_text, read_bytes, dtype=DTYPE))
    config, weights = load_artifact_weights(folder)
    return model, ReferenceLlama(config, weights)


def prefill_logits(loop, model, ids, reuse_cache):
    """Run `ids` with max_new_tokens=1 (prefill only) and return the last position's logits."""
    result = loop.run_until_complete(generate(model, ids, max_new_tokens=1, reuse_cache=reuse_cache))
    return result, logits_of(loop, model)


def reference_logits(reference, ids):
    reference.reset()
    return reference.forward(ids, 0)[-1]


def test_a_new_turn_prefills_only_the_new_tokens_and_matches_a_full_prefill(loop, tiny):
    model, reference = tiny
    rng = np.random.default_rng(7)
    turn1 = [int(t) for t in rng.integers(3, TINY_VOCAB, 50)]
    first = loop.run_until_complete(generate(model, turn1, max_new_tokens=12))
    assert model.cached_ids == turn1 + first.token_ids[:-1]  # the last id was never fed back
    # turn 2: the whole first turn, its reply, then new tokens
    turn2 = turn1 + first.token_ids + [int(t) for t in rng.integers(3, TINY_VOCAB, 30)]
    reused, got = prefill_logits(loop, model, turn2, reuse_cache=True)
    kept = len(turn1) + len(first.token_ids) - 1
    assert reused.reused_tokens == kept and reused.prefill_tokens == len(turn2) - kept
    assert sum(s.tokens for s in reused.stats if s.kind == "prefill") == len(turn2) - kept
    want = reference_logits(reference, turn2)
    assert rel_l2(got, want) < LOGIT_TOLERANCE[DTYPE]
    full, again = prefill_logits(loop, model, turn2, reuse_cache=False)
    assert full.reused_tokens == 0 and full.prefill_tokens == len(turn2)
    assert rel_l2(got, again) < SAME_IDS_TOLERANCE


def test_a_prompt_that_diverges_rolls_back_to_the_common_prefix(loop, tiny):
    model, reference = tiny
    rng = np.random.default_rng(8)
    base = [int(t) for t in rng.integers(3, TINY_VOCAB, 40)]
    loop.run_until_complete(generate(model, base + [11, 12, 13], max_new_tokens=5))
    # the same first 40 tokens, then other ones (as when the template re-tokenizes a reply)
    changed = base + [21, 22, 23, 24]
    result, got = prefill_logits(loop, model, changed, reuse_cache=True)
    assert result.reused_tokens == 40 and result.prefill_tokens == 4
    assert model.cached_ids == changed and model.kv.length == len(changed)
    assert rel_l2(got, reference_logits(reference, changed)) < LOGIT_TOLERANCE[DTYPE]
    # a prompt wholly inside the cache still runs its last token (its logits give the next one)
    result, got = prefill_logits(loop, model, changed[:30], reuse_cache=True)
    assert result.reused_tokens == 29 and result.prefill_tokens == 1
    assert [s.kind for s in result.stats] == ["prefill"]  # a one-token prefill is still a prefill
    assert rel_l2(got, reference_logits(reference, changed[:30])) < LOGIT_TOLERANCE[DTYPE]


def test_rolling_back_across_a_page_boundary_rewrites_the_right_slots(loop, tiny):
    model, reference = tiny
    rng = np.random.default_rng(9)
    ids = [int(t) for t in rng.integers(3, TINY_VOCAB, 70)]
    loop.run_until_complete(generate(model, ids, max_new_tokens=1))
    pages_before = list(model.kv.pages)
    other = ids[:33] + [int(t) for t in rng.integers(3, TINY_VOCAB, 40)]  # diverges on the 3rd page
    result, got = prefill_logits(loop, model, other, reuse_cache=True)
    assert result.reused_tokens == 33
    assert model.kv.pages == pages_before[:len(model.kv.pages)]  # the kept pages stay where they were
    assert rel_l2(got, reference_logits(reference, other)) < LOGIT_TOLERANCE[DTYPE]


# -- the chat session (SmolLM2's tokenizer and chat template, tiny random weights) ------------
@pytest.fixture(scope="module")
def tiny_chat(loop, gpu, library):
    source = Artifact(folder_readers(STATIC / "artifacts" / "tiny_chat"))
    return ChatSession(loop.run_until_complete(open_model(gpu, library, source, dtype=DTYPE,
                                                          options=RunOptions(max_context=512))))


def test_chat_turns_reuse_the_conversation_and_new_chat_resets_it(loop, tiny_chat):
    chat = tiny_chat
    chat.reset()
    first = loop.run_until_complete(chat.reply("Hello there.", max_new_tokens=8))
    assert first["speed"]["reused_tokens"] == 0 and first["speed"]["prefill_tokens"] == first["prompt_tokens"]
    second = loop.run_until_complete(chat.reply("And then?", max_new_tokens=8))
    speed = second["speed"]
    # everything up to the first reply's text is reused (its end-of-turn tokens may be re-tokenized)
    assert speed["reused_tokens"] >= first["prompt_tokens"]
    assert speed["prefill_tokens"] == second["prompt_tokens"] - speed["reused_tokens"]
    assert speed["ttft_ms"] > 0 and speed["prefill_tok_s"] > 0
    assert speed["decode_tok_s"] is None or speed["decode_tok_s"] > 0
    # the same turn without reuse gives the same greedy text
    history = list(chat.messages[:2])
    chat.messages = history
    again = loop.run_until_complete(chat.reply("And then?", max_new_tokens=8, reuse_cache=False))
    assert again["token_ids"] == second["token_ids"]
    assert again["speed"]["reused_tokens"] == 0
    chat.reset()
    assert chat.model.cached_ids == [] and chat.model.kv.length == 0


def test_a_context_full_error_resets_the_cache(loop, tiny_chat):
    chat = tiny_chat
    chat.reset()
    loop.run_until_complete(chat.reply("Hello there.", max_new_tokens=4))
    assert chat.model.cached_ids
    with pytest.raises(ModelError, match="exceeds the context of 512 tokens. Start a new chat"):
        loop.run_until_complete(chat.reply("Tell me more.", max_new_tokens=500))
    assert chat.model.cached_ids == [] and chat.model.kv.length == 0
    chat.reset()


# -- the comparison's teacher-forced misses -------------------------------------------------------
def test_pick_figures_and_near_ties():
    """A run's figures where the picks differ: its top-1 minus top-2 logit, how far its pick led the
    other's, where it ranks the other's; a near-tie needs both runs' leads within NEAR_TIE_LOGITS."""
    row = array("f", [0.5, 3.0, 2.75, -1.0, 2.875])
    assert pick_figures(row, 1, 2) == {"margin": 0.125, "lead": 0.25, "other_rank": 3}
    assert pick_figures(row, 1, 4) == {"margin": 0.125, "lead": 0.125, "other_rank": 2}
    close = {"margin": NEAR_TIE_LOGITS / 2, "lead": NEAR_TIE_LOGITS / 2, "other_rank": 2}
    far = {"margin": 0.01, "lead": 2 * NEAR_TIE_LOGITS, "other_rank": 40}
    assert is_near_tie(close, close) and not is_near_tie(close, far) and not is_near_tie(far, close)


def test_a_comparison_reads_both_runs_logits_at_each_teacher_forced_miss(loop, tiny_chat):
    """A sharded nest made wrong on purpose (the final norm's weights scaled unevenly in its runs
    only): every teacher-forced miss carries both runs' figures from the logits the GPU computed, and
    misses this large are no near-ties. The tiled run, repeated for its logits, picks its tokens again."""
    chat = tiny_chat
    chat.reset()
    loop.run_until_complete(break_sharded_nest(chat))
    try:
        result = loop.run_until_complete(chat.compare("Hello there.", max_new_tokens=6))
    finally:
        mend_sharded_nest(chat)
    forced, tiled = result["teacher_forced"], result["runs"]["tiled"]["token_ids"]
    misses = forced["misses"]
    assert not result["identical"] and misses and len(misses) == forced["steps"] - forced["matches"]
    assert forced["tiled_repeated"] is True and forced["near_tie_logits"] == NEAR_TIE_LOGITS
    for miss in misses:
        assert miss["tiled_id"] == tiled[miss["step"]] != miss["sharded_id"]
        for run in ("tiled", "sharded"):
            figures = miss[run]
            assert figures["lead"] >= figures["margin"] > 0 and figures["other_rank"] >= 2, miss
        assert miss["logits_rel_l2"] > 0.1 and not miss["near_tie"], miss
    chat.reset()
