"""The kernel lab's Python (chat/lab.py) natively on wgpu/lavapipe: its inputs, its f64 reference
(against numpy's), and its rows: checked, then timed, and a wrong row not timed."""

import copy
from dataclasses import replace

import numpy as np
import pytest

from attention_reference import decode_attention_reference
from chat.lab import NESTS, TOLERANCE, LabInputs, lab_rows, random_values
from chat.page import Session
from contract.kernels import PAGE_SIZE, AttentionSpec
from contract.model import AttentionShape, BENCH_SHAPES


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_random_values_are_finite_and_moderate(dtype):
    import random

    values = np.frombuffer(random_values(20_000, dtype, random.Random(1)), np.float16 if dtype == "float16" else np.float32)
    magnitudes = np.abs(values.astype(np.float64))
    assert np.all((magnitudes >= 0.5) & (magnitudes < 2)) and 0.4 < np.mean(values > 0) < 0.6


def test_the_lab_reference_equals_numpys():
    shape = AttentionShape(2, 6, 64)
    inputs = LabInputs(shape, 77, "float32", seed=3)
    q = np.frombuffer(inputs.q, np.float32).reshape(1, shape.num_qo_heads, shape.head_dim)
    pages = np.frombuffer(inputs.pages, np.float32).reshape(inputs.num_pages, 2, shape.num_kv_heads, PAGE_SIZE,
                                                            shape.head_dim)
    want, _ = decode_attention_reference(q, pages, np.array([0, inputs.num_pages]), np.array(inputs.page_ids),
                                         np.array([77 - (inputs.num_pages - 1) * PAGE_SIZE]), inputs.sm_scale)
    for head, got in inputs.reference.items():
        np.testing.assert_allclose(got, want[0, head], rtol=1e-12, atol=1e-12)
    assert inputs.heads == [0, shape.num_qo_heads - 1]


def test_rows_are_checked_then_timed_and_a_wrong_one_is_not_timed(loop, gpu, library):
    session = Session(gpu, library)
    shape = BENCH_SHAPES[0]  # D=64 8/32
    rows = loop.run_until_complete(lab_rows(session, shape, 32, 300, "float32", iters=2, rounds=1))
    assert [r["nest"] for r in rows] == list(NESTS)
    for r in rows:
        assert r["ok"] and r["rel_l2"] <= TOLERANCE["float32"], r
        if gpu.has_timestamps:
            assert r["us"] > 0 and r["step_ms"] == pytest.approx(r["us"] * 32 / 1000) and r["kv_gb_s"] > 0
    assert rows[0]["ran"] == "tiled" and rows[1]["ran"] != "tiled" and rows[2]["ran"] == rows[1]["ran"]  # 300 > 256
    wrong = loop.run_until_complete(lab_rows(session, shape, 32, 64, "float32", iters=2, rounds=1,
                                             check=lambda inputs, output: 0.5))
    assert all(not r["ok"] and "us" not in r and "not timed" in r["error"] for r in wrong)


def test_auto_runs_the_family_where_the_tiled_kernel_is_defective(loop, gpu, library):
    """Below the switch, `auto` picks tiled; where the build marked TVM's tiled kernel wrong for the
    shape, the lab's auto (as the host's) must run the sharded family instead, and tiled not at all."""
    shape = BENCH_SHAPES[0]
    tiled = AttentionSpec("tiled", shape, "float32").name
    marked = copy.copy(library)
    marked.specs = {**library.specs, tiled: replace(library.specs[tiled], meta={
        **library.specs[tiled].meta, "defect": "computes 3 of 4 query heads per KV head (marked by this test)"})}
    rows = loop.run_until_complete(lab_rows(Session(gpu, marked), shape, 32, 64, "float32", iters=2, rounds=1))
    by_nest = {r["nest"]: r for r in rows}
    assert by_nest["tiled"]["ran"] is None and "marked by this test" in by_nest["tiled"]["error"]
    assert by_nest["auto"]["ok"] and by_nest["auto"]["ran"] == by_nest["sharded"]["ran"] != "tiled", by_nest["auto"]
