"""The prefill pass on subgroup matrices (kernels.prefill_matmul_matrix, kernels.prefill_attention_matrix):
where the loader picks the builds, what the build checks of their WGSL, the tiny model running them
and the page's check of them (app.page_bench.prefill_check) with the builtins emulated (tests/matrix_emulation.py:
the tests' adapter has no subgroup matrices; a GPU that has them runs the same check through
`python -m app bench page --prefill` or tools/gpu_prefill.py).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest

from chat.page import prefill_matmuls_note
from app.page_bench.prefill_check import check_prefill_kernels
from contract.attention import MATRIX_PREFILL
from contract.kernels import MATRIX_CONFIG, MATRIX_SUFFIX, AttentionSpec, MatmulSpec, llama_kernels, matrix_roles
from contract.model import MODEL_CONFIGS, TEST_MODEL_CONFIGS
from convert.weights import load_artifact_weights, write_random_artifact
from kernels.build import build_wgsl_kernel
from kernels.prefill_matmul_matrix import matrix_matmul
from kernels.wgsl import MAX_WORKGROUP_STORAGE
from matrix_emulation import emulated
from model_glue.gpu.artifact import KernelLibrary
from model_glue.gpu.kernel import Kernel
from model_glue.errors import ModelError
from model_glue.options import RunOptions
from model_glue.policy import pick_prefill_matrix, why_no_prefill_matrix
from model_glue.gpu.webgpu import SUBGROUP_MATRIX
from model_reference import ReferenceLlama
from test_model import LOGIT_TOLERANCE, TINY_VOCAB, load, logits_of, rel_l2, tiny_dir, tiny_reference  # noqa: F401

TINY = TEST_MODEL_CONFIGS["tiny_llama"]


def adapter(features=(SUBGROUP_MATRIX,), configs=(MATRIX_CONFIG,), subgroups=(32, 32), f16=True):
    return SimpleNamespace(features=frozenset(features), subgroup_matrix_configs=tuple(configs),
                           subgroup_min_size=subgroups[0], subgroup_max_size=subgroups[1], has_f16=f16)


ADAPTERS = {  # name: (adapter, dtype, fold_norms, why it cannot run them or None)
    "offers-them": (adapter(), "float16", True, None),
    "no-feature": (adapter(features=()), "float16", True, "no subgroup matrices"),
    "other-shapes": (adapter(configs=[("f16", "f32", 16, 8, 16), ("i8", "i32", 16, 16, 32)]), "float16", True,
                     "no f16->f32 16x16x16 shape (it offers f16->f32 16x8x16, i8->i32 16x16x32)"),
    "subgroups-vary": (adapter(subgroups=(16, 64)), "float16", True, "subgroups of exactly 32"),
    "f32-model": (adapter(), "float32", True, "built in float16 and it runs in float32"),
    "norms-apart": (adapter(), "float16", False, "fold the norms"),
    "no-shader-f16": (adapter(f16=False), "float32", True, "no shader-f16"),
}


@pytest.mark.parametrize("case", list(ADAPTERS))
def test_the_loader_picks_the_matrix_builds_where_they_run(test_library, case):
    """Auto: wherever they run; required: a ModelError saying why not; never: not even where they run."""
    device, dtype, fold_norms, why = ADAPTERS[case]
    reason = why_no_prefill_matrix(test_library, TINY, dtype, device, fold_norms)
    assert (reason is None) == (why is None) and (why is None or why in reason), reason
    assert pick_prefill_matrix(test_library, TINY, dtype, device, None, fold_norms) == (why is None)
    assert pick_prefill_matrix(test_library, TINY, dtype, device, False, fold_norms) is False
    if why is None:
        assert pick_prefill_matrix(test_library, TINY, dtype, device, True, fold_norms) is True
    else:
        with pytest.raises(ModelError, match="prefill_matrix was asked for, but"):
            pick_prefill_matrix(test_library, TINY, dtype, device, True, fold_norms)


def test_an_artifact_without_the_matrix_builds_is_named(test_library):
    lacking = SimpleNamespace(specs={name: spec for name, spec in test_library.specs.items() if "_smx" not in name})
    reason = why_no_prefill_matrix(lacking, TINY, "float16", adapter())
    assert "no subgroup-matrix build" in reason and "_smx" in reason


def test_every_served_model_has_matrix_builds_that_fit_32_kib(library):
    """The served artifact's matrix builds, matmuls and attention for every model shape in f16: the
    features their WGSL enables, 4 subgroups
    of 32, within the 32 KiB of workgroup storage the tests' adapter and the H200's both offer."""
    matrix = [spec for spec in library.specs.values() if SUBGROUP_MATRIX in spec.features]
    for config in MODEL_CONFIGS.values():
        assert AttentionSpec("prefill", config.attention_shape, "float16", tag=MATRIX_PREFILL).name in library.specs
    for spec in matrix:
        attention = spec.meta["kind"] == "prefill_attention"
        assert ("_smx" in spec.name) != attention, spec.name
        assert spec.features == [SUBGROUP_MATRIX, "shader-f16"], spec.name
        assert spec.workgroup_size == [128, 1, 1] and spec.workgroup_storage_bytes <= MAX_WORKGROUP_STORAGE
        assert spec.meta["source"] == "wgsl"


def test_the_build_refuses_wgsl_that_differs_from_its_declared_abi():
    """The WGSL kernel's manifest entry comes from its declared ABI, checked against its text."""
    spec = MatmulSpec(256, 128, "float16", norm_eps=1e-5, glu="silu", tiled=True, matrix=True)
    kernel = matrix_matmul(spec)
    built = build_wgsl_kernel(spec.name, kernel, {}, spec.buffers, MAX_WORKGROUP_STORAGE)
    assert built.spec.buffer_names == ["x", "norm", "w", "scale", "wmin", "y"]
    assert [p["name"] for p in built.spec.pod] == ["n", "out_features", "eps"]
    assert built.spec.grid == [["//", ["+", ["//", "out_features", 2], 63], 64], ["//", ["+", "n", 127], 128]]
    swapped = dataclasses.replace(kernel, buffers=(kernel.buffers[1], kernel.buffers[0], *kernel.buffers[2:]))
    pod = dataclasses.replace(kernel, pod=kernel.pod[:2])
    size = dataclasses.replace(kernel, workgroup_size=(256, 1, 1))
    for wrong, message in ((swapped, "storage bindings"), (pod, "PODArgs"), (size, "workgroup size")):
        with pytest.raises(ValueError, match=message):
            build_wgsl_kernel(spec.name, wrong, {}, spec.buffers, MAX_WORKGROUP_STORAGE)
    with pytest.raises(ValueError, match="binds"):  # the names the runtime binds come from the spec
        build_wgsl_kernel(spec.name, kernel, {}, spec.buffers[1:], MAX_WORKGROUP_STORAGE)
    with pytest.raises(ValueError, match="workgroup storage"):
        build_wgsl_kernel(spec.name, kernel, {}, spec.buffers, 16384)
    flag = kernel.wgsl.replace("var<workgroup>", "var<workgroup> flag : atomic<u32>;\nvar<workgroup>", 1)
    with pytest.raises(ValueError, match=r"\{'flag': 4\} \(bytes\) are not multiples of 16"):
        build_wgsl_kernel(spec.name, dataclasses.replace(kernel, wgsl=flag), {}, spec.buffers, MAX_WORKGROUP_STORAGE)


# -- the tiny model through the matrix builds, emulated ---------------------------------------------------
@contextmanager
def offering_subgroup_matrices(gpu):
    """The tests' device, saying it has subgroup matrices of the kernels' shape in subgroups of 32
    (the emulated kernels need neither)."""
    saved = gpu.features, gpu.subgroup_matrix_configs, gpu.subgroup_min_size, gpu.subgroup_max_size
    gpu.features = gpu.features | {SUBGROUP_MATRIX}
    gpu.subgroup_matrix_configs, gpu.subgroup_min_size, gpu.subgroup_max_size = (MATRIX_CONFIG,), 32, 32
    try:
        yield gpu
    finally:
        gpu.features, gpu.subgroup_matrix_configs, gpu.subgroup_min_size, gpu.subgroup_max_size = saved


_EMULATED: dict = {}  # kernel name -> its emulated build: they compile slowly on lavapipe, so once a module


class EmulatingLibrary:
    """The test artifact's kernels (compiled once, by the session's library) with the subgroup-matrix
    kernels' builtins emulated."""

    def __init__(self, library: KernelLibrary, folder):
        self.library, self.folder = library, folder
        self.specs = {name: dataclasses.replace(spec, features=[f for f in spec.features if f != SUBGROUP_MATRIX])
                      for name, spec in library.specs.items()}
        self.matrix = {name for name, spec in library.specs.items() if SUBGROUP_MATRIX in spec.features}
        self._emulated = _EMULATED

    async def kernel(self, name: str):
        if name not in self.matrix:
            return await self.library.kernel(name)
        if name not in self._emulated:
            spec = self.specs[name]
            wgsl = emulated((self.folder / spec.wgsl).read_text())
            self._emulated[name] = await Kernel.compile(self.library.device, spec, wgsl)
        return self._emulated[name]

    async def kernels(self, names) -> list:
        return [await self.kernel(name) for name in names]

    def names(self, **meta) -> list[str]:
        return self.library.names(**meta)


def tiny_on_emulated_matrices(loop, gpu, test_library, test_artifact_dir, tiny_dir, **options):
    """The tiny model in f16 on the test artifact's matrix builds, emulated (skips without shader-f16)."""
    if not gpu.has_f16:
        pytest.skip("adapter has no shader-f16")
    with offering_subgroup_matrices(gpu):
        library = EmulatingLibrary(test_library, test_artifact_dir)
        return load(loop, gpu, library, tiny_dir, "float16", fold_norms=True, matmul_subgroups=False,
                    prefill_matrix=True, **options)


def test_tiny_model_prefills_on_the_matrix_builds(loop, gpu, test_library, test_artifact_dir, tiny_dir, tiny_reference):
    """f16: a 70-token prompt (128-token tiles), then a 40-token turn (two 32-token tiles), through the
    matrix builds of the matmuls and (by default, beside them) of attention; the logits as close to the
    f64 reference as the scalar kernels' (their W is f16 too); the overlay's prefill rows name the path;
    a request for the scalar kernels runs them. (The short turn's attention is held to the prefill
    kernel: by default the decode kernels run it, RunOptions.short_prefill_decode_attention.)"""
    model = tiny_on_emulated_matrices(loop, gpu, test_library, test_artifact_dir, tiny_dir,
                                      short_prefill_decode_attention=False)
    assert model.has_prefill_matrix and model.options.prefill_matrix is True
    assert {role for role in model.kernels if role.endswith(MATRIX_SUFFIX)} == set(
        matrix_roles(llama_kernels(TINY, "float16"), TINY.arch))
    rng = np.random.default_rng(5)
    tiny_reference.reset()
    history = []
    for turn, (n, tiles) in enumerate([(70, "128-token"), (40, "32-token")]):
        prompt = [int(t) for t in rng.integers(3, TINY_VOCAB, n)]
        position = len(history)
        token = loop.run_until_complete(model.forward(prompt))
        want = tiny_reference.forward(prompt, position)[-1]
        got = logits_of(loop, model)
        assert rel_l2(got, want) < LOGIT_TOLERANCE["float16"], f"turn {turn}: {rel_l2(got, want):.2e}"
        assert model.stats[-1].kernel == f"prefill (subgroup-matrix) · subgroup-matrix matmuls, {tiles} tiles"
        history += prompt
        assert token == int(np.argmax(got))
    assert prefill_matmuls_note(model) == "subgroup matrices (tensor cores): matmuls and attention"
    # the scalar attention where asked for (RunOptions.prefill_attention_matrix), then no matrix build
    loop.run_until_complete(model.use(dataclasses.replace(model.options, prefill_attention_matrix=False)))
    loop.run_until_complete(model.forward([5, 6, 7]))
    assert model.stats[-1].kernel == "prefill · subgroup-matrix matmuls, 32-token tiles"
    assert prefill_matmuls_note(model).endswith("matmuls; scalar attention (prefill_attention_matrix is false)")
    with pytest.raises(ModelError, match="it runs only beside the subgroup-matrix matmuls"):
        loop.run_until_complete(model.use(dataclasses.replace(model.options, prefill_matrix=False,
                                                              prefill_attention_matrix=True)))
    loop.run_until_complete(model.use(dataclasses.replace(model.options, prefill_matrix=False)))
    loop.run_until_complete(model.forward([5, 6, 7]))
    assert model.stats[-1].kernel == "prefill · scalar matmuls, 32-token tiles"


def test_gemma_prefills_in_f32_on_the_matrix_builds(loop, gpu, test_library, test_artifact_dir, tmp_path):
    """Gemma's family runs in f32 (its activations overflow f16); its matrix builds read and write f32 and
    multiply in f16 as the f16 builds do. Tiny Gemma 3 (a window of 32) loads them and its attention's;
    a 40-token prompt, past the window, on the 32-token tiles of the matmuls (the emulated long tiles and head_dim
    256 attention compile for minutes on lavapipe: test_prefill_kernels checks both builds' f32 forms),
    as close to the f64 reference as the f16 models' matrix builds are."""
    if not gpu.has_f16:
        pytest.skip("adapter has no shader-f16")
    write_random_artifact("tiny_gemma3", tmp_path, seed=3)
    reference = ReferenceLlama(*load_artifact_weights(tmp_path))
    config = TEST_MODEL_CONFIGS["tiny_gemma3"]
    with offering_subgroup_matrices(gpu):
        model = load(loop, gpu, EmulatingLibrary(test_library, test_artifact_dir), tmp_path, "float32",
                     fold_norms=True, matmul_subgroups=False, prefill_matrix=True, short_prefill_decode_attention=False,
                     prefill_attention_matrix=False, warm_up=False)
    by_default = dataclasses.replace(model.options, prefill_attention_matrix=None)
    assert model.runs_prefill_attention_matrix(by_default) and model.attention.prefill_matrix.endswith("_f32")
    assert {role for role in model.kernels if role.endswith(MATRIX_SUFFIX)} == set(
        matrix_roles(llama_kernels(config, "float32"), config.arch))
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, config.vocab_size, 40)]
    token = loop.run_until_complete(model.forward(prompt))
    assert model.stats[-1].kernel == "prefill · subgroup-matrix matmuls, 32-token tiles"
    got, want = logits_of(loop, model), reference.forward(prompt, 0)[-1]
    assert rel_l2(got, want) < LOGIT_TOLERANCE["float16"], f"{rel_l2(got, want):.2e}"
    assert token == int(np.argmax(got))


def test_a_request_for_matrix_builds_the_model_did_not_load_is_refused(loop, gpu, test_library, tiny_dir):
    model = load(loop, gpu, test_library, tiny_dir, "float32")
    assert not model.has_prefill_matrix and model.options.prefill_matrix is False
    with pytest.raises(ModelError, match="prefill_matrix was asked for, but this adapter has no subgroup matrices"):
        loop.run_until_complete(model.use(dataclasses.replace(model.options, prefill_matrix=True)))
    with pytest.raises(ModelError, match="prefill_attention_matrix was asked for, but the prefill matmuls'"):
        loop.run_until_complete(model.use(dataclasses.replace(model.options, prefill_attention_matrix=True)))


def test_the_pages_check_passes_the_emulated_builds_and_catches_a_wrong_one(loop, gpu, test_library,
                                                                           test_artifact_dir, tiny_dir):
    """app.page_bench.prefill_check (what `bench page --prefill` runs on a GPU with subgroup matrices) checks every
    prefill build of the tiny f16 model against float64: all pass here, emulated; with the matrix
    attention's softmax scale broken (the f64 reference must see it), its rows fail and only its."""
    model = tiny_on_emulated_matrices(loop, gpu, test_library, test_artifact_dir, tiny_dir, warm_up=False)
    library = model.library
    rows = loop.run_until_complete(check_prefill_kernels(model))
    attention = [r for r in rows if r["role"] == "attention"]
    assert {r["matrix"] for r in attention} == {False, True} and {r["start"] for r in attention} == {0, 300}
    assert {(r["role"], r["matrix"]) for r in rows if r["role"] != "attention"} == {
        (m, matrix) for m in ("norm_qkv", "o_residual", "norm_gate_up_swiglu", "down_residual") for matrix in (False, True)}
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    broken = library.specs[model.attention.prefill_matrix]
    wgsl = emulated((test_artifact_dir / broken.wgsl).read_text()).replace("podArgs.sm_scale *", "0.9f * podArgs.sm_scale *")
    good = library._emulated[broken.name]
    library._emulated[broken.name] = loop.run_until_complete(Kernel.compile(gpu, broken, wgsl))
    try:
        rows = loop.run_until_complete(check_prefill_kernels(model))
    finally:
        library._emulated[broken.name] = good
    assert {(r["role"], r["matrix"]) for r in rows if not r["ok"]} == {("attention", True)}


def test_the_pages_check_covers_a_familys_matmuls_and_q8a(loop, gpu, test_library, tmp_path):
    """The same check on tiny Gemma 3 opened from a Q8_0 GGUF (its matrices Q8A, as the real file's
    wider ones are), f32, scalar builds: its own matmuls (o and down without the residual, GELU's gate)
    and attention, each within the f32 bound of float64, which a wrong Q8A reference would miss by far."""
    from app.bench.gguf_files import write_llama_gguf
    from model_glue.formats.gguf_file import file_reader
    from model_glue.sources import GGUFFile, open_model

    path = tmp_path / "tiny_gemma3.gguf"
    write_llama_gguf(path, TEST_MODEL_CONFIGS["tiny_gemma3"], types={"matrix": "Q8_0", "embed": "Q8_0"}, seed=5,
                     dense=False)
    opened = loop.run_until_complete(open_model(gpu, test_library, GGUFFile(*file_reader(path)), dtype="float32",
                                                options=RunOptions(fold_norms=True, warm_up=False)))
    rows = loop.run_until_complete(check_prefill_kernels(opened.model))
    assert {(r["role"], r["matrix"]) for r in rows if r["role"] != "attention"} == {
        (m, False) for m in ("norm_qkv", "o", "norm_gate_up_swiglu", "down")}  # the role names the gated matmul
    assert {r["kernel"].split("_k")[0] for r in rows if r["role"] != "attention"} == {"matmul_prefill_q8a"}
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]

