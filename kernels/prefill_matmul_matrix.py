"""The prefill pass's matmul on subgroup matrices (the tensor cores), written as WGSL.

y[n, out] = x[n, in] @ W^T (+ resid), W q4 or q8a (contract.model, kernels.llama_common), with the folds
of the scalar tiled kernel (kernels.prefill_matmul): the RMSNorm before it (`norm_eps`), the gated FFN's
activation after it (`glu`), the residual. x, y and resid in the model's dtype (f16, or f32 for a family
whose activations overflow f16); f16 products, f32 accumulation.

Written as WGSL (kernels.wgsl says why), under the same contract as the TVM-built kernels:
`matrix_matmul(spec)` returns the WGSL and its ABI, checked by the build before it enters the manifest.

    grid (column tiles, ceil(n / TOKENS)); 128 invocations = 4 subgroups of 32
    a tile: TOKENS tokens x 128 weight rows (with glu: 64 gate rows, then the up rows of the same
    64 columns); subgroup s computes tokens sm * TOKENS / SUBGROUPS_M .. and rows sn * 128 / SUBGROUPS_N ..
    as FRAGS_M x FRAGS_N 16 x 16 fragments (sm, sn = s % SUBGROUPS_M, s / SUBGROUPS_M)

Per K_STEP = 32 columns of `in` (one q4 block, two q8a blocks of every row), the workgroup stages x's tile (times the norm's
weight) and W's dequantized tile in workgroup memory as f16, rows padded by 8 halves (a
probe measured unpadded tiles 2.5x slower), with the next step's raw words and x already loaded into
registers while the fragments multiply. Each thread stages the same 4 tokens' quarter of x at every
step and keeps their sums of x^2, so the norm's 1 / rms needs no second read of x. The epilogue
passes through workgroup memory 16 token rows at a time (the whole tile's f32 results would not fit):
the kernel needs less than 32 KiB of workgroup storage.
"""

from __future__ import annotations

from contract.kernels import MatmulSpec
from kernels.llama_common import gated_wgsl
from kernels.wgsl import FRAG, SUBGROUP, WgslKernel, left, matrix_header, result_store, result_zero, right

THREADS = 128  # 4 subgroups
ROWS = 128  # weight rows of a tile
K_STEP = 32  # columns of `in` staged per step: one q4 block (4 words) or two q8a blocks (8 words) of each row
PAD = 8  # halves of padding after each staged row
A_STRIDE = K_STEP + PAD  # x tile [token][k]
B_STRIDE = ROWS + PAD  # W tile [k][row]
EPILOGUE_TOKENS = 16  # token rows of the f32 results staged at once for the epilogue (within 32 KiB in all)
C_STRIDE = ROWS + 4
X_WORDS = K_STEP // 8  # a token's x per step in quarters of 8 values: one vec4<u32> of f16, two vec4<f32>
# Token tiles: (subgroups along tokens, subgroups along rows, fragments a subgroup along each).
TILE_LAYOUTS = {128: (2, 2, 4, 4), 32: (1, 4, 2, 2)}


def column_tile(spec: MatmulSpec) -> int:
    """Columns of y a workgroup writes."""
    return ROWS if spec.glu is None else ROWS // 2


def dequantize_w(q8a: bool) -> list[str]:
    """WGSL that writes this thread's row of the step's W tile (its K_STEP weights, as f16) from the
    loaded words: a q4 block's 8 nibbles a word, or two q8a blocks' 4 signed bytes a word (byte b of
    word u is weight 8 (u / 2) + u % 2 + 2 b of its block: contract.model.q8a_weight_at)."""
    if not q8a:
        return ["    for (var word = 0u; word < 4u; word = word + 1u) {",
                "      for (var e = 0u; e < 8u; e = e + 1u) {",
                "        let k = word * 8u + e;",
                "        let value = f32((w_raw[word] >> (4u * e)) & 15u) * w_scale + w_min;",
                f"        w_tile[k * {B_STRIDE}u + tid] = f16(value);",
                "      }", "    }"]
    lines = []
    for h in range(2):
        lines += ["    for (var word = 0u; word < 4u; word = word + 1u) {",
                  "      for (var b = 0u; b < 4u; b = b + 1u) {",
                  f"        let k = {16 * h}u + (word / 2u) * 8u + word % 2u + 2u * b;",
                  f"        let code = extractBits(bitcast<i32>(w_raw{h}[word]), 8u * b, 8u);",
                  f"        w_tile[k * {B_STRIDE}u + tid] = f16(f32(code) * w_scale{h} + w_min{h});",
                  "      }", "    }"]
    return lines


def matrix_matmul(spec: MatmulSpec) -> WgslKernel:
    """The subgroup-matrix prefill matmul of `spec` (tiled, matrix, q4 or q8a, f16 or f32 x and y), its
    name the entry point. `n`, `out_features` (W's rows) and `eps` are runtime values, as in the scalar
    tiled kernel."""
    assert spec.tiled and spec.matrix and spec.weights in ("q4", "q8a") and spec.dtype in ("float16", "float32")
    assert spec.in_features % K_STEP == 0 and spec.token_tile in TILE_LAYOUTS
    tokens, (sub_m, sub_n, frags_m, frags_n) = spec.token_tile, TILE_LAYOUTS[spec.token_tile]
    assert sub_m * sub_n * SUBGROUP == THREADS and sub_n * frags_n * FRAG == ROWS
    assert sub_m * frags_m * FRAG == tokens and tokens % EPILOGUE_TOKENS == 0
    name = spec.name
    normed, has_gate, residual = spec.norm_eps is not None, spec.glu is not None, spec.residual
    f32_io = spec.dtype == "float32"
    # An f32 residual stream may exceed f16 (Gemma 3's does): such x is scaled by its 1 / rms before it is
    # staged as f16, after a first pass over the row for the sums of squares; f16 x is staged as it is and
    # 1 / rms scales the results.
    prescaled = normed and f32_io
    scalar = "f32" if f32_io else "f16"  # of x, resid and y
    x_vecs = 2 if f32_io else 1  # loads of a quarter: two vec4<f32>, or one vec4<u32> of 8 halves
    steps, x_row_vecs = spec.in_features // K_STEP, spec.in_features // 8 * x_vecs  # x rows in loads
    x_loads = tokens * X_WORDS // THREADS  # quarters of x a thread stages per step
    sub_tokens = frags_m * FRAG  # a subgroup's tokens
    columns = column_tile(spec)
    q8a = spec.weights == "q8a"
    blocks = 2 if q8a else 1  # a row's blocks a step (a vec4<u32> of codes each)
    suffixes = ("0", "1") if q8a else ("",)  # of each block's registers

    buffers = [("x", "read", "float32", "vec4<f32>") if f32_io else ("x", "read", "float16", "vec4<u32>")]
    buffers += [("norm", "read", "float32", "vec4<f32>")] if normed else []
    buffers += [("w", "read", "uint32", "vec4<u32>"), ("scale", "read", "float32", "f32"),
                ("wmin", "read", "float32", "f32")]
    buffers += [("resid", "read", spec.dtype, scalar)] if residual else []
    buffers += [("y", "read_write", spec.dtype, scalar)]
    assert tuple(b[0] for b in buffers) == spec.buffers, (buffers, spec.buffers)
    pod = (("n", "i32"), ("out_features", "i32")) + ((("eps", "f32"),) if normed else ())
    width = ["//", "out_features", 2] if has_gate else "out_features"
    grid = (["//", ["+", width, columns - 1], columns], ["//", ["+", "n", tokens - 1], tokens])

    lines = matrix_header(buffers, pod)
    lines += [
        f"var<workgroup> x_tile : array<f16, {tokens * A_STRIDE}>;  // [token][k], f16",
        f"var<workgroup> w_tile : array<f16, {K_STEP * B_STRIDE}>;  // [k][row], dequantized",
        f"var<workgroup> results : array<f32, {EPILOGUE_TOKENS * C_STRIDE}>;  // [token][row] of 16 tokens",
        f"var<workgroup> row_scale : array<f32, {tokens}>;  // each token's 1 / rms (1 without the norm)",
    ] + [f"var<workgroup> squares : array<f32, {tokens * X_WORDS}>;  // each token's quarters' sums of x^2"] * normed + [
        "",
        f"@compute @workgroup_size({THREADS}, 1, 1)",
        f"fn {name}(@builtin(workgroup_id) wid : vec3<u32>, @builtin(local_invocation_index) tid : u32) {{",
        "  let n = podArgs.n;",
        "  let out_features = podArgs.out_features;",
        f"  let subgroup = tid / {SUBGROUP}u;",
        f"  let sm = subgroup % {sub_m}u;",
        f"  let sn = subgroup / {sub_m}u;",
        f"  let tok0 = i32(wid.y) * {tokens};",
        "",
        "  // x: each thread stages quarter tid % 4 (8 halves) of tokens tid / 4 + 32 i",
        f"  let quarter = tid % {X_WORDS}u;",
    ]
    for i in range(x_loads):
        token = f"tid / {X_WORDS}u + {i * THREADS // X_WORDS}u"
        lines += [f"  let x_token{i} = {token};",
                  f"  let x_at{i} = u32(min(tok0 + i32(x_token{i}), n - 1)) * {x_row_vecs}u + quarter"
                  + (f" * {x_vecs}u;" if x_vecs > 1 else ";")]
        lines += [f"  var x_raw{i}_{v} : vec4<f32>;" for v in range(x_vecs)] if f32_io else [f"  var x_raw{i} : vec4<u32>;"]
        lines += [f"  var x_sq{i} = 0.0f;"] * normed
    lines += ["", "  // W: each thread dequantizes one row's block"]
    if has_gate:  # tile rows 0-63 are gate rows, 64-127 the up rows of the same columns
        lines += ["  let half_rows = out_features / 2;",
                  f"  let column = i32(wid.x) * {columns} + i32(tid % {columns}u);",
                  f"  let w_row = u32(min(column, half_rows - 1) + select(0, half_rows, tid >= {columns}u));"]
    else:
        lines += [f"  let w_row = u32(min(i32(wid.x) * {ROWS} + i32(tid), out_features - 1));"]
    lines += [f"  let w_block0 = w_row * {steps * blocks}u;"]
    for h in suffixes:
        lines += [f"  var w_raw{h} : vec4<u32>;", f"  var w_scale{h} : f32;", f"  var w_min{h} : f32;"]
    lines += ["  var norm_lo : vec4<f32>;  // the norm's weight of this thread's quarter of x",
              "  var norm_hi : vec4<f32>;"] * normed + [""]
    lines += [f"  var acc{i}_{j} = {result_zero()};"
              for i in range(frags_m) for j in range(frags_n)]

    def load(step: str) -> list[str]:
        if f32_io:
            out = [f"    x_raw{i}_{v} = x[x_at{i} + {step} * {X_WORDS * x_vecs}u + {v}u];"
                   for i in range(x_loads) for v in range(x_vecs)]
        else:
            out = [f"    x_raw{i} = x[x_at{i} + {step} * {X_WORDS}u];" for i in range(x_loads)]
        out += [f"    norm_lo = norm[{step} * {K_STEP // 4}u + quarter * 2u];",
                f"    norm_hi = norm[{step} * {K_STEP // 4}u + quarter * 2u + 1u];"] * normed
        for h, suffix in enumerate(suffixes):
            at = f"w_block0 + {step} * 2u + {h}u" if q8a else f"w_block0 + {step}"
            out += [f"    w_raw{suffix} = w[{at}];", f"    w_scale{suffix} = scale[{at}];",
                    f"    w_min{suffix} = wmin[{at}];"]
        return out

    def row_scales(inverse_rms: bool) -> list[str]:
        """Each token's row_scale: its 1 / rms from its quarters' sums of x^2, or 1."""
        out = [f"  squares[x_token{i} * {X_WORDS}u + quarter] = x_sq{i};" for i in range(x_loads) if inverse_rms]
        out += ["  workgroupBarrier();", f"  for (var t = tid; t < {tokens}u; t = t + {THREADS}u) {{"]
        if inverse_rms:
            out += ["    var sum = 0.0f;",
                    f"    for (var q = 0u; q < {X_WORDS}u; q = q + 1u) {{ sum = sum + squares[t * {X_WORDS}u + q]; }}",
                    f"    row_scale[t] = inverseSqrt(sum / {float(spec.in_features)}f + podArgs.eps);"]
        else:
            out += ["    row_scale[t] = 1.0f;"]
        return out + ["  }"]

    if prescaled:  # the first pass: 1 / rms of each token before any x is staged
        for i in range(x_loads):
            lines += [f"  for (var step = 0u; step < {steps}u; step = step + 1u) {{",
                      f"    let lo = x[x_at{i} + step * {X_WORDS * x_vecs}u];",
                      f"    let hi = x[x_at{i} + step * {X_WORDS * x_vecs}u + 1u];",
                      f"    x_sq{i} = x_sq{i} + dot(lo, lo) + dot(hi, hi);", "  }"]
        lines += row_scales(True) + ["  workgroupBarrier();"]
        lines += [f"  let x_scale{i} = row_scale[x_token{i}];" for i in range(x_loads)]
    lines += ["  {"] + load("0u") + ["  }"]
    lines += [f"  for (var step = 0u; step < {steps}u; step = step + 1u) {{", "    workgroupBarrier();"]
    for i in range(x_loads):
        for h in range(4):  # the pairs of halves in each u32 of the load
            pair = (f"x_raw{i}_{h // 2}.{'xy' if h % 2 == 0 else 'zw'};  // two values of x"
                    if f32_io else f"unpack2x16float(x_raw{i}[{h}]);  // two halves of x, exactly")
            lines += [f"    {{ let pair = {pair}",
                      f"      let at = x_token{i} * {A_STRIDE}u + quarter * 8u + {2 * h}u;"]
            if prescaled:  # x times the norm's weight and its 1 / rms
                g = f"norm_{'lo' if h < 2 else 'hi'}"
                lines += [f"      x_tile[at] = f16(pair.x * {g}[{2 * h % 4}] * x_scale{i});",
                          f"      x_tile[at + 1u] = f16(pair.y * {g}[{2 * h % 4 + 1}] * x_scale{i}); }}"]
            elif normed:  # x times the norm's weight (1 / rms scales the results): a multiply per value of x
                g = f"norm_{'lo' if h < 2 else 'hi'}"
                lines += [f"      x_tile[at] = f16(pair.x * {g}[{2 * h % 4}]);",
                          f"      x_tile[at + 1u] = f16(pair.y * {g}[{2 * h % 4 + 1}]);",
                          f"      x_sq{i} = x_sq{i} + dot(pair, pair); }}"]
            else:
                lines += ["      x_tile[at] = f16(pair.x);", "      x_tile[at + 1u] = f16(pair.y); }"]
    lines += dequantize_w(q8a) + ["    workgroupBarrier();",
              f"    if (step + 1u < {steps}u) {{"] + load("(step + 1u)") + ["    }"]
    for kk in range(0, K_STEP, FRAG):
        for i in range(frags_m):
            lines.append(f"    let left{kk}_{i} = "
                         + left("x_tile", f"(sm * {sub_tokens}u + {i * FRAG}u) * {A_STRIDE}u + {kk}u", f"{A_STRIDE}u") + ";")
        for j in range(frags_n):
            lines.append("    { let right = "
                         + right("w_tile", f"{kk * B_STRIDE}u + sn * {frags_n * FRAG}u + {j * FRAG}u", f"{B_STRIDE}u") + ";")
            lines += [f"      acc{i}_{j} = subgroupMatrixMultiplyAccumulate(left{kk}_{i}, right, acc{i}_{j});"
                      for i in range(frags_m)]
            lines.append("    }")
    lines.append("  }")

    # each token's 1 / rms, which scales its results (1 where x was scaled before it was staged)
    lines += [""] + row_scales(normed and not prescaled)

    # the epilogue, EPILOGUE_TOKENS token rows at a time: the subgroup that holds them stores its
    # fragments, then every thread reads its column(s) back
    frags_per_pass = EPILOGUE_TOKENS // FRAG
    for part in range(tokens // EPILOGUE_TOKENS):
        first = part * EPILOGUE_TOKENS
        owner, i0 = first // sub_tokens, (first % sub_tokens) // FRAG
        lines += ["  workgroupBarrier();", f"  if (sm == {owner}u) {{"]
        lines += ["    " + result_store("results", f"{di * FRAG * C_STRIDE}u + sn * {frags_n * FRAG}u + {j * FRAG}u",
                                      f"acc{i0 + di}_{j}", f"{C_STRIDE}u")
                  for di in range(frags_per_pass) for j in range(frags_n)]
        lines += ["  }", "  workgroupBarrier();"]
        if has_gate:  # thread: column tid % 64 of the part's tokens (tid / 64) * 8 .. + 7
            rows_each = EPILOGUE_TOKENS * columns // THREADS
            lines += [f"  for (var r = 0u; r < {rows_each}u; r = r + 1u) {{",
                      f"    let local = (tid / {columns}u) * {rows_each}u + r;",
                      f"    let token = tok0 + {first} + i32(local);",
                      f"    let column = i32(wid.x) * {columns} + i32(tid % {columns}u);",
                      "    if (token < n && column < half_rows) {",
                      f"      let s = row_scale[{first}u + local];",
                      f"      let gate = results[local * {C_STRIDE}u + tid % {columns}u] * s;",
                      f"      let up = results[local * {C_STRIDE}u + {columns}u + tid % {columns}u] * s;",
                      f"      y[u32(token * half_rows + column)] = {scalar}({gated_wgsl('gate', 'up', spec.glu)});",
                      "    }", "  }"]
        else:  # thread: column tid of every token
            lines += [f"  for (var r = 0u; r < {EPILOGUE_TOKENS}u; r = r + 1u) {{",
                      f"    let token = tok0 + {first} + i32(r);",
                      f"    let column = i32(wid.x) * {ROWS} + i32(tid);",
                      "    if (token < n && column < out_features) {",
                      f"      let at = u32(token * out_features + column);",
                      f"      let value = results[r * {C_STRIDE}u + tid] * row_scale[{first}u + r];",
                      f"      y[at] = {scalar}(value + f32(resid[at]));" if residual else f"      y[at] = {scalar}(value);",
                      "    }", "  }"]
    lines.append("}")
    wgsl = "\n".join(lines) + "\n"
    return WgslKernel(wgsl, name, tuple(buffers), pod, (THREADS, 1, 1), grid)
