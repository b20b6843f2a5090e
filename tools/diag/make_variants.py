"""Variants of the matrix prefill attention's WGSL, for tools/gpu_prefill.py's diagnosis on a GPU
with subgroup matrices (each replaces the artifact's build of the same ABI in the page's check).

  .venv/bin/python tools/diag/make_variants.py     writes tools/diag/<variant>__<kernel>.wgsl

- pad64: every row stride a multiple of 64 bytes (the builder with PAD=32, S_STRIDE=48, 64-half rows)
- q_stage: Q staged in an array of its own and its fragments loaded in each tile, not held from before the loop
- end_all: at the end every subgroup stores its O at once into an array of its own (no store under
  `if (subgroup == owner)`)
- split_left: left operands (Q's stage, then P) in an array of their own, right operands (K^T, V) in
  another (the matmul, which passes on the H200, never loads both kinds from one array)
- scalar_flags: the kernel as it was before its two flags became 16-byte arrays (`grown` and
  `rescale` 4-byte scalars beside the tiles): the control for that change
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

import kernels.prefill_attention_matrix as pam  # noqa: E402
from kernels.wgsl import left, result_store  # noqa: E402

SHAPES = ((8, 32, 64), (8, 32, 128))  # (H_kv, H_qo, D): the 1B and 8B shapes


def build(h_kv, h_qo, d, **constants) -> str:
    saved = {k: getattr(pam, k) for k in constants}
    try:
        for k, v in constants.items():
            setattr(pam, k, v)
        return pam.matrix_prefill_attention(h_kv, h_qo, d, "float16").wgsl
    finally:
        for k, v in saved.items():
            setattr(pam, k, v)


def q_stage(wgsl: str, d: int) -> str:
    kv_stride = d + pam.PAD
    rows = pam.ROWS
    wgsl = wgsl.replace("var<workgroup> scores", f"var<workgroup> q_stage : array<f16, {rows * kv_stride}>;\nvar<workgroup> scores", 1)
    wgsl = wgsl.replace("    kv_tile[at] = v.x; kv_tile[at + 1u] = v.y; kv_tile[at + 2u] = v.z; kv_tile[at + 3u] = v.w;",
                        "    q_stage[at] = v.x; q_stage[at + 1u] = v.y; q_stage[at + 2u] = v.z; q_stage[at + 3u] = v.w;")
    lines = wgsl.split("\n")
    loads = [line for line in lines if line.startswith("  var q") and "subgroupMatrixLoad" in line]
    assert len(loads) == d // 16
    lines = [line for line in lines if line not in loads]
    at = lines.index("    // S = Q K^T, this subgroup's 16 rows x the tile's keys, into workgroup memory")
    per_tile = [f"    let q{kk} = " + left("q_stage", f"subgroup * {16 * kv_stride}u + {kk * 16}u", f"{kv_stride}u") + ";"
                for kk in range(d // 16)]
    return "\n".join(lines[:at] + per_tile + lines[at:])


def end_all(wgsl: str, d: int) -> str:
    o_stride = d + 4
    head, end = wgsl.split("  if (half == 0u) { row_factor[my_row] = 1.0f / l; }\n", 1)
    cols = d // 4
    out = [f"  if (half == 0u) {{ row_factor[my_row] = 1.0f / l; }}",
           "  workgroupBarrier();"]
    out += ["  " + result_store("o_all", f"subgroup * {16 * o_stride}u + {j * 16}u", f"o{j}", f"{o_stride}u")
            for j in range(d // 16)]
    out += ["  workgroupBarrier();",
            f"  for (var e = tid; e < {pam.ROWS * cols}u; e = e + {pam.THREADS}u) {{",
            f"    let r = e / {cols}u;",
            "    let row = row0 + i32(r);",
            f"    if (row < n * {G}) {{",
            f"      let at = r * {o_stride}u + (e % {cols}u) * 4u;",
            "      let o = vec4<f32>(o_all[at], o_all[at + 1u], o_all[at + 2u], o_all[at + 3u]);",
            f"      output[u32((row / {G}) * {H_QO} + kv_head * {G} + row % {G}) * {cols}u + e % {cols}u] = vec4<f16>(o * row_factor[r]);",
            "    }", "  }", "}", ""]
    head = head.replace("var<workgroup> scores", f"var<workgroup> o_all : array<f32, {pam.ROWS * o_stride}>;\nvar<workgroup> scores", 1)
    return head + "\n".join(out)


def scalar_flags(wgsl: str) -> str:
    """The flags back as 4-byte workgroup scalars."""
    swaps = ((f"var<workgroup> grown : array<atomic<u32>, {pam.FLAG_WORDS}>;", "var<workgroup> grown : atomic<u32>;"),
             (f"var<workgroup> rescale : array<u32, {pam.FLAG_WORDS}>;", "var<workgroup> rescale : u32;"),
             ("&grown[0]", "&grown"), ("rescale[0] = ", "rescale = "), ("&rescale[0]", "&rescale"))
    for old, new in swaps:
        assert old in wgsl, old
        wgsl = wgsl.replace(old, new)
    return wgsl


def split_left(wgsl: str, d: int) -> str:
    """Left operands (Q's stage, then P) in an array of their own, right operands (K^T, V) in kv_tile."""
    kv_stride = d + pam.PAD
    size = max(pam.ROWS * kv_stride, pam.ROWS * pam.P_STRIDE)
    wgsl = wgsl.replace("var<workgroup> scores", f"var<workgroup> left_tile : array<f16, {size}>;\nvar<workgroup> scores", 1)
    wgsl = wgsl.replace("    kv_tile[at] = v.x; kv_tile[at + 1u] = v.y; kv_tile[at + 2u] = v.z; kv_tile[at + 3u] = v.w;",
                        "    left_tile[at] = v.x; left_tile[at + 1u] = v.y; left_tile[at + 2u] = v.z; left_tile[at + 3u] = v.w;")
    wgsl = wgsl.replace("subgroup_matrix_left<f16, 16, 16>, row_major>(&kv_tile,", "subgroup_matrix_left<f16, 16, 16>, row_major>(&left_tile,")
    return wgsl.replace("kv_tile[p_at + ", "left_tile[p_at + ")


if __name__ == "__main__":
    for h_kv, h_qo, d in SHAPES:
        G, H_QO = h_qo // h_kv, h_qo
        name = f"prefill_attention_matrix_d{d}_kv{h_kv}_qo{h_qo}_f16"
        base = build(h_kv, h_qo, d).replace(f"fn prefill_attention_matrix_d{d}_kv{h_kv}_qo{h_qo}(", f"fn {name}(")
        variants = {"q_stage": q_stage(base, d), "end_all": end_all(base, d),
                    "q_stage_end_all": end_all(q_stage(base, d), d), "split_left": split_left(base, d),
                    "scalar_flags": scalar_flags(base)}
        if d == 64:  # the padded build fits 32 KiB at head_dim 64 only
            variants["pad64"] = build(h_kv, h_qo, d, PAD=32, S_STRIDE=48, P_STRIDE=64, KT_STRIDE=64).replace(
                f"fn prefill_attention_matrix_d{d}_kv{h_kv}_qo{h_qo}(", f"fn {name}(")
        for label, text in variants.items():
            assert f"fn {name}(" in text
            (HERE / f"{label}__{name}.wgsl").write_text(text)
            print(label, name, len(text))
