"""The subgroup-matrix prefill matmul's WGSL with its four subgroup-matrix builtins emulated, for
adapters without them (lavapipe: the tests' adapter).

kernels.prefill_matmul_matrix uses the builtins in one pattern only: fragments are loaded from the
x tile (left) and the W tile (right) and multiplied before the next barrier, and results are stored
into `results`. So a loaded fragment can stand for its (offset, stride) in the tile, and each lane
of a subgroup of 32 computes the 8 of the 16 x 16 result entries it holds (entry 8 lane + e, row
major) by 16 scalar FMAs: f16 products in f32, as the hardware's. Everything else (staging, the
dequantization, the norm, the epilogue, the edges of the grid) is the kernel's own code, so the
emulated kernel checks all of it against f64; the builtins' own semantics are checked on a GPU that
has them (chat.lab's prefill matmul check).
"""

from __future__ import annotations

import re

from contract.kernels import MATRIX_FRAGMENT as FRAG, MATRIX_SUBGROUP as LANES

ENTRIES = FRAG * FRAG // LANES  # result entries a lane holds

EMULATION = f"""
struct Fragment {{ offset: u32, stride: u32 }}
struct Accumulator {{ v: array<f32, {ENTRIES}> }}

fn multiply_accumulate(lane: u32, left: Fragment, right: Fragment, acc: Accumulator) -> Accumulator {{
  var out = acc;
  for (var e = 0u; e < {ENTRIES}u; e = e + 1u) {{
    let row = (lane * {ENTRIES}u + e) / {FRAG}u;
    let column = (lane * {ENTRIES}u + e) % {FRAG}u;
    for (var k = 0u; k < {FRAG}u; k = k + 1u) {{
      out.v[e] = out.v[e] + f32(x_tile[left.offset + row * left.stride + k])
                          * f32(w_tile[right.offset + k * right.stride + column]);
    }}
  }}
  return out;
}}

fn store_results(lane: u32, offset: u32, acc: Accumulator, stride: u32) {{
  for (var e = 0u; e < {ENTRIES}u; e = e + 1u) {{
    let row = (lane * {ENTRIES}u + e) / {FRAG}u;
    let column = (lane * {ENTRIES}u + e) % {FRAG}u;
    results[offset + row * stride + column] = acc.v[e];
  }}
}}
"""

_REPLACEMENTS = [
    (re.compile(r"^diagnostic\(off, chromium\.subgroup_matrix_uniformity\);\n", re.M), ""),
    (re.compile(r"^enable chromium_experimental_subgroup_matrix;\n", re.M), EMULATION),
    (re.compile(rf"subgroup_matrix_result<f32, {FRAG}, {FRAG}>\(\)"), "Accumulator()"),
    (re.compile(rf"subgroupMatrixLoad<subgroup_matrix_left<f16, {FRAG}, {FRAG}>, row_major>\(&x_tile, "), "Fragment("),
    (re.compile(rf"subgroupMatrixLoad<subgroup_matrix_right<f16, {FRAG}, {FRAG}>, row_major>\(&w_tile, "), "Fragment("),
    (re.compile(r"subgroupMatrixMultiplyAccumulate\("), f"multiply_accumulate(tid % {LANES}u, "),
    (re.compile(r"subgroupMatrixStore<row_major>\(&results, "), f"store_results(tid % {LANES}u, "),
]


def emulated(wgsl: str) -> str:
    """`wgsl` with the subgroup-matrix builtins replaced by the emulation; fails if any is left."""
    for pattern, replacement in _REPLACEMENTS:
        wgsl, count = pattern.subn(replacement.replace("\\", "\\\\"), wgsl)
        assert count, f"the kernel no longer has {pattern.pattern!r}: update the emulation"
    assert "subgroupMatrix" not in wgsl and "subgroup_matrix" not in wgsl, "a builtin the emulation does not know"
    return wgsl
