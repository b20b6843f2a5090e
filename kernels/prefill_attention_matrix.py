"""Causal paged prefill attention on subgroup matrices (the tensor cores), written as WGSL.

The same call as the scalar kernel (kernels.prefill_attention: its buffers, `start`, sm_scale,
`window`, its rows and grid), with q.K^T and P.V as f16 fragment products accumulated in f32; q, the
pages and the output in the model's dtype (f16, or f32 for a family whose activations overflow f16:
staged as f16, as the f16 builds' are). Written as WGSL (kernels.wgsl says why).

    grid (ceil(n * G / ROWS), H_kv); 128 invocations = 4 subgroups of 32
    row r of a workgroup is (token r // G, head r % G) of its KV head; subgroup s owns rows 16 s .. 16 s + 15

- Q: the workgroup's 64 rows are staged in workgroup memory (in two rounds of 32 at head_dim 256)
  and each subgroup keeps its 16 rows as D / 16 left fragments (variables: the stage is overwritten)
  for the whole kernel; O is D / 16 f32 result fragments a subgroup.
- K/V come in tiles of TILE_KEYS positions (32; 16 at head_dim 256), read into registers one tile
  ahead and staged as f16 in padded rows: K transposed ([d][key]), V as it is ([key][d]), so both
  are row-major right operands (the layout the matmul's fragments are proven on). The tile loop runs
  from the tile of the workgroup's first window start (tile 0 without a window: whole tiles below
  every row's window are never loaded) through its last row's position.
- Softmax: S goes through workgroup memory, where two lanes a row (exchanging their maxima and sums
  through it too) scale it into the log2 domain, mask it above the diagonal and below the row's
  window, and write P = exp2(s - m) as f16 over the K tile (S is done with it; a masked key's P is 0).
- Fragments cannot be scaled row by row, so FlashAttention's rescale of O is lazy: a row's max m
  moves only when a tile's max passes it by more than RESCALE_AFTER (so P <= 2^8 in between), and
  only then does the workgroup pass O through workgroup memory, one subgroup at a time, to scale
  those rows. A row's first tile with a key it sees sets m without one (its O is still 0): without a
  window that is the first tile, which holds position 0.
- The end passes O through workgroup memory the same way, divided by the row's denominator (O goes
  through in column chunks that fit the S array: one at head_dim 128, four at 256).

Workgroup storage: the K and V tiles (the Q stage before them, P over K), each subgroup's S (f32,
also its O when O passes through), one factor and one exchanged value a row, two flags: under 29 KiB
at head_dim 128, 26 KiB at 256. Every variable is a multiple of 16 bytes and every fragment row and
offset 16-byte aligned (kernels.wgsl.MATRIX_ALIGN_BYTES): with two 4-byte flags beside the tiles the
kernel is wrong on the GPU while its emulated builtins are right. (Head_dim 256 holds 16 left and 16
result fragments a subgroup: checked with the builtins emulated only, not yet on a GPU.)
"""

from __future__ import annotations

from contract.kernels import PAGE_SIZE, PREFILL_ATTENTION_BUFFERS
from kernels.paged_kv import LOG2_E
from kernels.wgsl import (FRAG, MATRIX_ALIGN_BYTES, SUBGROUP, WgslKernel, left, matrix_header, result_load,
                          result_store, result_zero, right)

SUBGROUPS = 4
THREADS = SUBGROUPS * SUBGROUP
ROWS = SUBGROUPS * FRAG  # query rows (token, head) a workgroup: one fragment tall a subgroup
TILE_KEYS = 32  # K/V positions a tile: two fragments wide in S (up to head_dim 128)
WIDE_TILE_KEYS = 16  # above head_dim 128: one fragment (the K^T and V tiles fit 32 KiB beside S)
PAD = 8  # halves after each staged K/V row
S_STRIDE = TILE_KEYS + 4  # f32 scores [row][key]
P_STRIDE = TILE_KEYS + PAD  # f16 probabilities [row][key]
KT_STRIDE = TILE_KEYS + PAD  # the K tile transposed [d][key]
LANES_PER_ROW = 2  # softmax lanes a row, each over half the tile's keys
MAX_HEAD_DIM = 256
RESCALE_AFTER = 8.0  # log2 units a row's max may grow by before O is rescaled (P stays <= 256 in f16)
MASKED = -3.0e38  # a masked score (above the diagonal, below the window): exp2 of it less any real max is 0
VEC = 4  # f16 values a q, K/V or output load (vec4<f16>)
FLAG_WORDS = 4  # a flag's u32s: every workgroup variable a multiple of 16 bytes (kernels.wgsl.MATRIX_ALIGN_BYTES)


def tile_layout(head_dim: int) -> tuple[int, int, int, int]:
    """(TILE_KEYS, S_STRIDE, P_STRIDE, KT_STRIDE) of a head_dim: the module's up to 128 (read when a
    kernel is built: tools/diag/make_variants.py builds with other strides), a tile of WIDE_TILE_KEYS above."""
    if head_dim <= 128:
        return TILE_KEYS, S_STRIDE, P_STRIDE, KT_STRIDE
    return WIDE_TILE_KEYS, WIDE_TILE_KEYS + 4, WIDE_TILE_KEYS + PAD, WIDE_TILE_KEYS + PAD


def matrix_prefill_attention(num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str,
                             page_size: int = PAGE_SIZE) -> WgslKernel:
    """The subgroup-matrix causal prefill attention of one shape (see the module docstring)."""
    H_kv, H_qo, D = num_kv_heads, num_qo_heads, head_dim
    assert dtype in ("float16", "float32") and H_qo % H_kv == 0 and D % FRAG == 0 and D <= MAX_HEAD_DIM
    io = "f32" if dtype == "float32" else "f16"  # of q, the pages and the output

    def as_f16(load: str) -> str:  # a vec4 of q or the pages as the tiles stage it
        return f"vec4<f16>({load})" if io == "f32" else load
    G = H_qo // H_kv
    TILE_KEYS, S_STRIDE, P_STRIDE, KT_STRIDE = tile_layout(D)
    KEYS_PER_LANE = TILE_KEYS // LANES_PER_ROW
    cols = D // VEC  # vec4 loads a row
    kv_stride = D + PAD  # V [key][d] and the Q stage [row][d]
    v_at = D * KT_STRIDE  # V after K^T in the tile array
    tile_halves = v_at + TILE_KEYS * kv_stride
    d_frags, key_frags = D // FRAG, TILE_KEYS // FRAG
    # O passes through the scores array one subgroup's rows and o_frags of its fragments (o_cols dims) at a time
    s_floats = SUBGROUPS * FRAG * S_STRIDE
    o_frags = max(f for f in range(1, d_frags + 1) if d_frags % f == 0 and FRAG * (f * FRAG + 4) <= s_floats)
    o_cols, o_stride = o_frags * FRAG, o_frags * FRAG + 4  # f32 O [row][d] of a chunk
    # the Q stage: q_rounds rounds of the rows of SUBGROUPS / q_rounds subgroups
    q_rounds = next(r for r in (1, 2, 4) if ROWS // r * kv_stride <= tile_halves)
    round_subgroups = SUBGROUPS // q_rounds
    round_rows = ROWS // q_rounds
    tile_loads = TILE_KEYS * cols // THREADS  # vec4 loads a thread of a tile's K (and as many of V)
    assert THREADS % cols == 0 and TILE_KEYS * cols % THREADS == 0
    assert SUBGROUPS * FRAG * P_STRIDE <= v_at  # P fits over K^T
    assert TILE_KEYS % page_size == 0 or page_size % TILE_KEYS == 0
    row_bytes = (2 * kv_stride, 2 * KT_STRIDE, 2 * P_STRIDE, 4 * S_STRIDE, 4 * o_stride, 2 * v_at, 4 * o_cols)
    assert all(b % MATRIX_ALIGN_BYTES == 0 for b in row_bytes), "fragment rows and offsets 16-byte aligned"
    name = f"prefill_attention_matrix_d{D}_kv{H_kv}_qo{H_qo}"

    buffers = [(buf, "read_write" if buf == "output" else "read", "int32" if buf == "page_ids" else f"{dtype}x4",
                "i32" if buf == "page_ids" else f"vec4<{io}>") for buf in PREFILL_ATTENTION_BUFFERS]
    pod = (("n", "i32"), ("start", "i32"), ("sm_scale", "f32"), ("window", "i32"))
    grid = (["//", ["+", ["*", "n", G], ROWS - 1], ROWS], H_kv)

    lines = matrix_header(buffers, pod)
    lines += [
        f"var<workgroup> kv_tile : array<f16, {tile_halves}>;  // K^T [d][key] (then P [row][key]), V [key][d]; Q first",
        f"var<workgroup> scores : array<f32, {SUBGROUPS * FRAG * S_STRIDE}>;  // each subgroup's S [row][key], or one's O",
        f"var<workgroup> row_factor : array<f32, {ROWS}>;  // a row's O rescale; at the end 1 / its denominator",
        f"var<workgroup> lane_value : array<f32, {THREADS}>;  // what a row's two lanes exchange",
        f"var<workgroup> grown : array<atomic<u32>, {FLAG_WORDS}>;  // [0]: some row's max moved in this tile",
        f"var<workgroup> rescale : array<u32, {FLAG_WORDS}>;  // [0]: grown, read uniformly",
        "",
        f"@compute @workgroup_size({THREADS}, 1, 1)",
        f"fn {name}(@builtin(workgroup_id) wid : vec3<u32>, @builtin(local_invocation_index) tid : u32) {{",
        "  let n = podArgs.n;",
        "  let start = podArgs.start;",
        "  let window = podArgs.window;  // 0: the whole causal prefix",
        f"  let scale = podArgs.sm_scale * {LOG2_E:.9g}f;  // scores in the log2 domain",
        "  let kv_head = i32(wid.y);",
        f"  let row0 = i32(wid.x) * {ROWS};",
        f"  let subgroup = tid / {SUBGROUP}u;",
        f"  let lane = tid % {SUBGROUP}u;",
        "  let kv_len = start + n;",
        f"  let last_token = min((row0 + {ROWS - 1}) / {G}, n - 1);",
        f"  let tiles = (start + last_token + {TILE_KEYS}) / {TILE_KEYS};  // through the last row's position",
        "  // from the tile of the first row's window start: every tile below it is masked for every row",
        f"  let first_tile = select(0, max(start + row0 / {G} - window + 1, 0), window > 0) / {TILE_KEYS};",
        f"  // softmax: this lane's row and which half of a tile's keys",
        f"  let my_row = subgroup * {FRAG}u + lane / {LANES_PER_ROW}u;",
        f"  let half = lane % {LANES_PER_ROW}u;",
        f"  let my_position = start + min((row0 + i32(my_row)) / {G}, n - 1);",
        "  let my_lowest = select(0, my_position - window + 1, window > 0);  // the row's window start",
    ]

    def stage_q(first_row: int) -> list[str]:
        """The Q rows first_row .. first_row + round_rows - 1 staged (rows past the chunk repeat its last token)."""
        return [f"  for (var e = tid; e < {round_rows * cols}u; e = e + {THREADS}u) {{",
                f"    let row = row0 + {f'{first_row} + ' if first_row else ''}i32(e / {cols}u);",
                f"    let v = {as_f16(f'q[u32(min(row / {G}, n - 1) * {H_qo} + kv_head * {G} + row % {G}) * {cols}u + e % {cols}u]')};",
                f"    let at = (e / {cols}u) * {kv_stride}u + (e % {cols}u) * {VEC}u;",
                "    kv_tile[at] = v.x; kv_tile[at + 1u] = v.y; kv_tile[at + 2u] = v.z; kv_tile[at + 3u] = v.w;",
                "  }",
                "  workgroupBarrier();"]

    def q_fragment(kk: int) -> str:
        return left("kv_tile", f"(subgroup % {round_subgroups}u) * {FRAG * kv_stride}u + {kk * FRAG}u", f"{kv_stride}u")

    lines += ["", f"  // Q: the rows staged ({'in rounds of ' + str(round_rows) if q_rounds > 1 else 'at once'}), "
                  "each subgroup's as left fragments"]
    lines += stage_q(0)
    lines += [f"  var q{kk} = " + q_fragment(kk) + ";" for kk in range(d_frags)]
    for r in range(1, q_rounds):  # the first round's loads gave the later rounds' subgroups stand-ins
        lines += ["  workgroupBarrier();"] + stage_q(r * round_rows)
        lines += [f"  if (subgroup / {round_subgroups}u == {r}u) {{"]
        lines += [f"    q{kk} = " + q_fragment(kk) + ";" for kk in range(d_frags)]
        lines += ["  }"]
    lines += [f"  var o{j} = {result_zero()};" for j in range(d_frags)]
    lines += [f"  var m = {MASKED:.1e}f;  // this row's max, log2 domain ({MASKED:.1e}: no key seen yet)",
              "  var l = 0.0f;  // this lane's part of the row's denominator, relative to m"]
    lines += [f"  var k{i} : vec4<f16>;" for i in range(tile_loads)]
    lines += [f"  var v{i} : vec4<f16>;" for i in range(tile_loads)]

    def fetch(tile: str) -> list[str]:
        """This thread's K and V vectors of a tile, from the pages into registers (positions past the
        context read the last one: finite, and masked)."""
        out = []
        for i in range(tile_loads):
            out += [f"    {{ let key = {i * THREADS // cols}u + tid / {cols}u;",
                    f"      let position = min({tile} * {TILE_KEYS} + i32(key), kv_len - 1);",
                    f"      let row = ((u32(page_ids[position / {page_size}]) * 2u * {H_kv}u + u32(kv_head)) * {page_size}u"
                    f" + u32(position % {page_size})) * {cols}u + tid % {cols}u;",
                    f"      k{i} = {as_f16('pages[row]')};",
                    f"      v{i} = {as_f16(f'pages[row + {H_kv * page_size * cols}u]')}; }}"]
        return out

    lines += ["  {"] + fetch("first_tile") + ["  }"]
    lines += ["  for (var t = first_tile; t < tiles; t = t + 1) {", "    workgroupBarrier();"]
    for i in range(tile_loads):
        key, d = f"({i * THREADS // cols}u + tid / {cols}u)", f"(tid % {cols}u) * {VEC}u"
        lines += [f"    {{ let at = {key} * {kv_stride}u + {d};"]
        lines += [f"      kv_tile[({d} + {c}u) * {KT_STRIDE}u + {key}] = k{i}.{'xyzw'[c]};" for c in range(VEC)]
        lines += [f"      kv_tile[{v_at}u + at + {c}u] = v{i}.{'xyzw'[c]};" for c in range(VEC)]
        lines[-1] += " }"
    lines += ["    workgroupBarrier();", "    if (t + 1 < tiles) {"] + fetch("(t + 1)") + ["    }"]

    lines += ["    // S = Q K^T, this subgroup's 16 rows x the tile's keys, into workgroup memory"]
    for j in range(key_frags):
        lines += [f"    {{ var s = {result_zero()};"]
        lines += [f"      s = subgroupMatrixMultiplyAccumulate(q{kk}, "
                  + right("kv_tile", f"{kk * FRAG * KT_STRIDE + j * FRAG}u", f"{KT_STRIDE}u") + ", s);"
                  for kk in range(d_frags)]
        lines += ["      " + result_store("scores", f"subgroup * {FRAG * S_STRIDE}u + {j * FRAG}u", "s", f"{S_STRIDE}u") + " }"]
    lines += ["    workgroupBarrier();",
              "    // this lane's half of its row: mask (above the diagonal, below the window), the tile's max, P",
              f"    let first_key = t * {TILE_KEYS} + i32(half) * {KEYS_PER_LANE};",
              f"    let s_at = my_row * {S_STRIDE}u + half * {KEYS_PER_LANE}u;"]
    for i in range(KEYS_PER_LANE):
        lines += [f"    let seen{i} = first_key + {i} <= my_position && first_key + {i} >= my_lowest;",
                  f"    let s{i} = select({MASKED:.1e}f, scores[s_at + {i}u] * scale, seen{i});"]
    lines += ["    var tile_max = " + "max(" * (KEYS_PER_LANE - 1) + "s0"
              + "".join(f", s{i})" for i in range(1, KEYS_PER_LANE)) + ";",
              "    lane_value[tid] = tile_max;",
              "    workgroupBarrier();",
              "    tile_max = max(tile_max, lane_value[tid ^ 1u]);  // the row's other half",
              "    // a row's first seen key sets m (alpha 0: its O and l are still 0, no rescale); a masked tile leaves it",
              f"    let moves = tile_max > m + {RESCALE_AFTER}f;",
              "    let m_new = select(m, tile_max, moves);",
              "    let alpha = exp2(m - m_new);",
              "    if (half == 0u) {",
              "      row_factor[my_row] = alpha;",
              f"      if (moves && m > {MASKED:.1e}f) {{ atomicOr(&grown[0], 1u); }}",
              "    }",
              "    m = m_new;",
              "    l = l * alpha;",
              f"    let p_at = my_row * {P_STRIDE}u + half * {KEYS_PER_LANE}u;"]
    for i in range(KEYS_PER_LANE):
        lines += [f"    {{ let p = select(0.0f, exp2(s{i} - m), seen{i}); kv_tile[p_at + {i}u] = f16(p); l = l + p; }}"]
    lines += ["    workgroupBarrier();",
              "    if (tid == 0u) {", "      rescale[0] = atomicLoad(&grown[0]);", "      atomicStore(&grown[0], 0u);", "    }",
              "    if (workgroupUniformLoad(&rescale[0]) != 0u) {  // some row's max moved: scale O's rows"]
    for owner in range(SUBGROUPS):
        for chunk in range(0, d_frags, o_frags):
            frags = range(chunk, chunk + o_frags)
            lines += [f"      if (subgroup == {owner}u) {{"]
            lines += ["        " + result_store("scores", f"{(j - chunk) * FRAG}u", f"o{j}", f"{o_stride}u") for j in frags]
            lines += ["      }", "      workgroupBarrier();",
                      f"      for (var e = tid; e < {FRAG * o_cols}u; e = e + {THREADS}u) {{",
                      f"        let at = (e / {o_cols}u) * {o_stride}u + e % {o_cols}u;",
                      f"        scores[at] = scores[at] * row_factor[{owner * FRAG}u + e / {o_cols}u];",
                      "      }", "      workgroupBarrier();", f"      if (subgroup == {owner}u) {{"]
            lines += [f"        o{j} = " + result_load("scores", f"{(j - chunk) * FRAG}u", f"{o_stride}u") + ";" for j in frags]
            lines += ["      }", "      workgroupBarrier();"]
    lines += ["    }", "    // O += P V"]
    lines += [f"    let p{kk} = " + left("kv_tile", f"subgroup * {FRAG * P_STRIDE}u + {kk * FRAG}u", f"{P_STRIDE}u") + ";"
              for kk in range(key_frags)]
    for j in range(d_frags):
        lines += [f"    o{j} = subgroupMatrixMultiplyAccumulate(p{kk}, "
                  + right("kv_tile", f"{v_at + kk * FRAG * kv_stride + j * FRAG}u", f"{kv_stride}u") + f", o{j});"
                  for kk in range(key_frags)]
    lines += ["  }", "",
              "  // the end: each row's denominator, then O / it written one subgroup's rows at a time",
              "  lane_value[tid] = l;",
              "  workgroupBarrier();",
              "  l = l + lane_value[tid ^ 1u];",
              "  if (half == 0u) { row_factor[my_row] = 1.0f / l; }"]
    chunk_cols = o_cols // VEC  # vec4 stores a row of a chunk
    for owner in range(SUBGROUPS):
        for chunk in range(0, d_frags, o_frags):
            lines += ["  workgroupBarrier();", f"  if (subgroup == {owner}u) {{"]
            lines += ["    " + result_store("scores", f"{(j - chunk) * FRAG}u", f"o{j}", f"{o_stride}u")
                      for j in range(chunk, chunk + o_frags)]
            lines += ["  }", "  workgroupBarrier();",
                      f"  for (var e = tid; e < {FRAG * chunk_cols}u; e = e + {THREADS}u) {{",
                      f"    let row = row0 + {owner * FRAG} + i32(e / {chunk_cols}u);",
                      f"    if (row < n * {G}) {{",
                      f"      let at = (e / {chunk_cols}u) * {o_stride}u + (e % {chunk_cols}u) * {VEC}u;",
                      f"      let o = vec4<f32>(scores[at], scores[at + 1u], scores[at + 2u], scores[at + 3u]);",
                      f"      output[u32((row / {G}) * {H_qo} + kv_head * {G} + row % {G}) * {cols}u"
                      f"{f' + {chunk * FRAG // VEC}u' if chunk else ''} + e % {chunk_cols}u] = "
                      f"vec4<{io}>(o * row_factor[{owner * FRAG}u + e / {chunk_cols}u]);",
                      "    }", "  }"]
    lines.append("}")
    return WgslKernel("\n".join(lines) + "\n", name, tuple(buffers), pod, (THREADS, 1, 1), grid)
