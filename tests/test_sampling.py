"""Top-k / top-p / temperature sampling on the GPU (natively, wgpu/lavapipe).

The kernel turns a uniform draw into a token id by inverse CDF over the filtered candidates, so it
is deterministic given the draw: each case is compared with the same rule in float64 numpy. Draws
that fall within float32 rounding of a boundary of the CDF (or a top-p cut) are skipped, and the
tests require that almost none are.
"""

import struct

import numpy as np
import pytest

from convert.weights import write_random_artifact
from model_glue.gpu.artifact import folder_readers
from contract.kernels import MAX_TOP_K, llama_kernels
from contract.model import MODEL_CONFIGS
from model_glue.errors import ModelError
from model_glue.model.generate import GREEDY, Sampling, generate
from model_glue.loading import load_model

VOCAB = MODEL_CONFIGS["tiny_chat"].vocab_size  # SmolLM2's vocabulary: the kernel's real size
SAMPLER = llama_kernels(MODEL_CONFIGS["tiny_chat"], "float32")["sample"]
KERNEL = SAMPLER.name
MARGIN = 1e-4  # relative distance to a boundary below which f32 and f64 may disagree


def reference_pick(logits, top_k, temperature, top_p, draw):
    """(token id, ambiguous) by the kernel's rule in float64."""
    order = np.lexsort((np.arange(len(logits)), -logits.astype(np.float64)))[:top_k]  # value desc, index asc
    weights = np.exp((logits[order].astype(np.float64) - logits[order[0]]) / temperature)
    total = weights.sum()
    cumulative = np.cumsum(weights)
    kept = 1
    while kept < top_k and cumulative[kept - 1] < top_p * total:
        kept += 1
    ambiguous = bool(np.any(np.abs(cumulative[:top_k] - top_p * total) < MARGIN * total)) and top_p < 1
    target = draw * cumulative[kept - 1]
    chosen = int(np.argmax(cumulative[:kept] > target)) if target < cumulative[kept - 1] else kept - 1
    ambiguous |= bool(np.any(np.abs(cumulative[:kept] - target) < MARGIN * total))
    return int(order[chosen]), ambiguous


def run_sampler(loop, gpu, kernel, logits_buffer, out_buffer, **values):
    bound = kernel.bind({"logits": logits_buffer, "out": out_buffer}, {**SAMPLER.values, **values})
    batch = gpu.batch()
    bound.dispatch(batch)
    batch.submit()
    (token,) = struct.unpack("<i", loop.run_until_complete(gpu.read(out_buffer, 4)))
    bound.release()
    return token


@pytest.mark.parametrize("top_k,temperature,top_p", [
    (1, 1.0, 1.0), (5, 1.0, 1.0), (40, 0.7, 1.0), (40, 1.0, 0.9), (MAX_TOP_K, 1.5, 0.5), (20, 0.05, 1.0)])
def test_sampler_matches_the_inverse_cdf_rule(loop, gpu, library, top_k, temperature, top_p):
    kernel = loop.run_until_complete(library.kernel(KERNEL))
    rng = np.random.default_rng(top_k)
    logits = rng.normal(0, 3, VOCAB).astype(np.float32)
    logits[rng.choice(VOCAB, 12, replace=False)] = logits.max()  # ties at the top: lower index first
    logits_buffer = gpu.storage_buffer(logits.nbytes, logits.tobytes())
    out_buffer = gpu.storage_buffer(4)
    draws = np.concatenate([[0.0, 0.999999], rng.random(30)])
    checked = 0
    for draw in draws:
        want, ambiguous = reference_pick(logits, top_k, temperature, top_p, float(np.float32(draw)))
        if ambiguous:
            continue
        got = run_sampler(loop, gpu, kernel, logits_buffer, out_buffer, top_k=top_k, temperature=temperature,
                          top_p=top_p, draw=float(draw))
        assert got == want, f"draw {draw}: GPU picked {got}, the rule picks {want}"
        checked += 1
    assert checked >= len(draws) - 3


def test_sampled_ids_follow_the_filtered_distribution(loop, gpu, library):
    """Evenly spaced draws hit each kept candidate in proportion to its probability."""
    kernel = loop.run_until_complete(library.kernel(KERNEL))
    logits = np.full(VOCAB, -20.0, np.float32)
    logits[[7, 1000, 30000, 49151]] = [2.0, 1.0, 0.0, 1.5]
    logits_buffer = gpu.storage_buffer(logits.nbytes, logits.tobytes())
    out_buffer = gpu.storage_buffer(4)
    draws = (np.arange(200) + 0.5) / 200
    counts = {}
    for draw in draws:
        token = run_sampler(loop, gpu, kernel, logits_buffer, out_buffer, top_k=3, temperature=1.0, top_p=1.0,
                            draw=float(draw))
        counts[token] = counts.get(token, 0) + 1
    p = np.exp([2.0, 1.5, 1.0])
    p /= p.sum()
    assert set(counts) == {7, 49151, 1000}  # top-3: the 4th token is never drawn
    for token, share in zip((7, 49151, 1000), p):
        assert abs(counts[token] / len(draws) - share) <= 1 / len(draws)


@pytest.fixture(scope="module")
def tiny(loop, gpu, test_library, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_sampling")
    write_random_artifact("tiny_llama", folder, seed=11)
    read_text, read_bytes = folder_readers(folder)
    return loop.run_until_complete(load_model(gpu, test_library, read_text, read_bytes, dtype="float32"))


def test_generation_with_a_seed_is_reproducible_and_top_k_1_is_greedy(loop, tiny):
    prompt = [5, 9, 17, 33, 65]

    def run(sampling):
        return loop.run_until_complete(generate(tiny, prompt, max_new_tokens=24, sampling=sampling))

    greedy = run(GREEDY)
    assert greedy.seed is None
    assert run(Sampling(temperature=1.0, top_k=1, seed=3)).token_ids == greedy.token_ids
    first, again = run(Sampling(temperature=1.2, top_k=40, seed=3)), run(Sampling(temperature=1.2, top_k=40, seed=3))
    assert first.token_ids == again.token_ids and first.seed == 3
    other = run(Sampling(temperature=1.2, top_k=40, seed=4))
    assert other.token_ids != first.token_ids  # 24 draws from ~40 candidates: equal only by accident
    assert first.token_ids != greedy.token_ids
    unseeded = run(Sampling(temperature=1.2, top_k=40))
    assert unseeded.seed is not None
    assert run(Sampling(temperature=1.2, top_k=40, seed=unseeded.seed)).token_ids == unseeded.token_ids


@pytest.mark.parametrize("sampling,message", [
    (Sampling(temperature=-1), "temperature"), (Sampling(temperature=1, top_k=0), "top-k"),
    (Sampling(temperature=1, top_k=MAX_TOP_K + 1), "top-k"), (Sampling(temperature=1, top_p=0), "top-p")])
def test_bad_sampling_settings_are_refused(loop, tiny, sampling, message):
    with pytest.raises(ModelError, match=message):
        loop.run_until_complete(generate(tiny, [5, 6], max_new_tokens=4, sampling=sampling))
