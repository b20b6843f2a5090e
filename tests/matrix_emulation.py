"""The subgroup-matrix kernels' WGSL with their subgroup-matrix builtins emulated, for adapters
without them (lavapipe: the tests' adapter).

The kernels (kernels.prefill_matmul_matrix, kernels.prefill_attention_matrix) use the builtins in
a few forms only (kernels.wgsl): f16 left and right fragments loaded from workgroup tiles, f32
results stored to and loaded from workgroup arrays, multiply-accumulate. Each lane of a subgroup of
32 stands for the 8 of a 16 x 16 result's entries it holds (entry 8 lane + e, row major: one row,
half its columns), so:
- a left fragment is loaded as the lane's row (16 values, in registers, as the hardware's: the tile
  may be overwritten before it is used);
- a right fragment stands for its (offset, stride) in the kernel's one right-operand tile, read when
  it multiplies (the kernels multiply a right fragment before the next barrier);
- multiply-accumulate is 16 scalar FMAs a result entry: f16 products in f32, as the hardware's.
Everything else (staging, dequantization, softmax, the epilogues, the edges of the grid) is the
kernels' own code, so the emulated kernels check all of it against f64; the builtins' own semantics
are checked on a GPU that has them (`python -m app bench page --prefill`: app.page_bench.prefill_check).
"""

from __future__ import annotations

import re

from contract.kernels import MATRIX_FRAGMENT as FRAG, MATRIX_SUBGROUP as LANES

ENTRIES = FRAG * FRAG // LANES  # result entries a lane holds
LANE = f"tid % {LANES}u"

_LEFT = re.compile(rf"subgroupMatrixLoad<subgroup_matrix_left<f16, {FRAG}, {FRAG}>, row_major>\(&(\w+), ")
_RIGHT = re.compile(rf"subgroupMatrixLoad<subgroup_matrix_right<f16, {FRAG}, {FRAG}>, row_major>\(&(\w+), ")
_RESULT_LOAD = re.compile(rf"subgroupMatrixLoad<subgroup_matrix_result<f32, {FRAG}, {FRAG}>, row_major>\(&(\w+), ")
_STORE = re.compile(r"subgroupMatrixStore<row_major>\(&(\w+), ")
_HEADER = re.compile(r"^diagnostic\(off, chromium\.subgroup_matrix_uniformity\);\n", re.M)
_ENABLE = re.compile(r"^enable chromium_experimental_subgroup_matrix;\n", re.M)


def _functions(left_arrays, right_arrays, result_arrays) -> str:
    rows = f"(lane * {ENTRIES}u + e) / {FRAG}u"
    columns = f"(lane * {ENTRIES}u + e) % {FRAG}u"
    out = [f"struct Left {{ v: array<f16, {FRAG}> }}",  # the lane's row
           "struct Right { offset: u32, stride: u32 }",
           f"struct Accumulator {{ v: array<f32, {ENTRIES}> }}"]
    for array in left_arrays:
        out.append(f"""fn load_left_{array}(lane: u32, offset: u32, stride: u32) -> Left {{
  var out : Left;
  for (var k = 0u; k < {FRAG}u; k = k + 1u) {{ out.v[k] = {array}[offset + (lane * {ENTRIES}u / {FRAG}u) * stride + k]; }}
  return out;
}}""")
    right_array, = right_arrays  # each kernel reads its right operands from one tile
    out.append(f"""fn multiply_accumulate(lane: u32, left: Left, right: Right, acc: Accumulator) -> Accumulator {{
  var out = acc;
  for (var e = 0u; e < {ENTRIES}u; e = e + 1u) {{
    let at = right.offset + {columns};
    for (var k = 0u; k < {FRAG}u; k = k + 1u) {{
      out.v[e] = out.v[e] + f32(left.v[k]) * f32({right_array}[at + k * right.stride]);
    }}
  }}
  return out;
}}""")
    for array in result_arrays:
        out.append(f"""fn store_{array}(lane: u32, offset: u32, acc: Accumulator, stride: u32) {{
  for (var e = 0u; e < {ENTRIES}u; e = e + 1u) {{ {array}[offset + {rows} * stride + {columns}] = acc.v[e]; }}
}}
fn load_result_{array}(lane: u32, offset: u32, stride: u32) -> Accumulator {{
  var out : Accumulator;
  for (var e = 0u; e < {ENTRIES}u; e = e + 1u) {{ out.v[e] = {array}[offset + {rows} * stride + {columns}]; }}
  return out;
}}""")
    return "\n".join(out) + "\n"


def emulated(wgsl: str) -> str:
    """`wgsl` with the subgroup-matrix builtins replaced by the emulation; fails if any is left."""
    left_arrays = sorted(set(_LEFT.findall(wgsl)))
    right_arrays = sorted(set(_RIGHT.findall(wgsl)))
    result_arrays = sorted(set(_STORE.findall(wgsl)) | set(_RESULT_LOAD.findall(wgsl)))
    assert left_arrays and right_arrays and result_arrays, "no subgroup-matrix builtins the emulation knows"
    wgsl, count = _HEADER.subn("", wgsl)
    assert count == 1, "the kernel no longer turns off chromium.subgroup_matrix_uniformity: update the emulation"
    wgsl, count = _ENABLE.subn(lambda _: _functions(left_arrays, right_arrays, result_arrays), wgsl)
    assert count == 1
    wgsl = _LEFT.sub(lambda m: f"load_left_{m[1]}({LANE}, ", wgsl)
    wgsl = _RIGHT.sub("Right(", wgsl)
    wgsl = _RESULT_LOAD.sub(lambda m: f"load_result_{m[1]}({LANE}, ", wgsl)
    wgsl = _STORE.sub(lambda m: f"store_{m[1]}({LANE}, ", wgsl)
    wgsl = re.sub(rf"subgroup_matrix_result<f32, {FRAG}, {FRAG}>\(\)", "Accumulator()", wgsl)
    wgsl = wgsl.replace("subgroupMatrixMultiplyAccumulate(", f"multiply_accumulate({LANE}, ")
    assert "subgroupMatrix" not in wgsl and "subgroup_matrix" not in wgsl, "a builtin the emulation does not know"
    return wgsl
