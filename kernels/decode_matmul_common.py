"""What the decode matmul's variants share: the geometry, the weight loads and their dequantization,
the lanes' dot over one chunk of x (in `dtype`, or as int8 codes), the lanes' reduction and a column's
total. kernels.decode_matmul picks the variant; each is one TVMScript kernel built from these parts.

Every variant runs one nest: a workgroup of ROWS (8) x LANES (32) invocations computes
MatmulSpec.columns_per_group columns of y for one token. Thread (r, lane) owns rows_per_thread weight
rows (one load of x serves them all) and walks them a chunk (words_per_load packed words) at a time,
lane-strided so that neighbouring lanes read neighbouring chunks, TRIP_UNROLL chunks in flight. Each
word is dequantized once and multiplied into the rows' partial dots; the LANES partials of a row meet
in workgroup memory behind one barrier (a barrier-free one-row-per-invocation nest was no faster on
lavapipe). The packing and conventions: kernels.llama_common.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from contract.kernels import MATMUL_ROWS, MatmulSpec
from contract.model import Q8A_BLOCK, q8a_code_position
from kernels.llama_common import BLOCK, gated, sign_extend_byte
from kernels.quantize_x import BYTE, CODE_MAX, VEC, WORDS_PER_CHUNK as XQ_WORDS, code_position

ROWS, LANES = MATMUL_ROWS, 32  # a workgroup: ROWS threads (threadIdx.y) of LANES lanes (threadIdx.x)
TOKENS = 1  # tokens a workgroup: the decode step and the head run one (prefill: kernels.prefill_matmul)
# The loads (fitted on the H200, docs/benchmarks.md): a lane reads two neighbouring packed words of a
# row at once (a warp's load then spans 256 contiguous bytes) and has four such loads in flight. A q8a
# lane reads four, so that a chunk is 16 weights in every format that meets x's int8 codes.
WORDS_PER_LOAD = 2
Q8A_WORDS_PER_LOAD = 4
TRIP_UNROLL = 4
LOW_NIBBLES = 0x0F0F0F0F  # int8_x: a q4 word's even elements, one a byte (the odd ones after a shift by 4)


@dataclass(frozen=True)
class Geometry:
    """A decode matmul's compile-time sizes (from its MatmulSpec; out_features stays a runtime value)."""

    in_features: int
    dtype: str
    out_dtype: str  # y's (the head writes f32 logits)
    weights: str  # "q4", "q8" or "q8a" (contract.model)
    rows_per_thread: int
    columns_per_group: int  # y's columns a workgroup
    compiled_rows: int | None  # W's rows where compiled in (the gated FFN's up rows' offset), else None
    glu: str | None  # the gate's activation (kernels.llama_common.gated): W holds the gate rows, then the up rows
    normed: bool  # the RMSNorm before the matmul is folded in
    subgroup_lanes: int  # the lanes whose partials meet by subgroup shuffles (1: none)

    @classmethod
    def of(cls, spec: MatmulSpec) -> Geometry:
        assert not spec.tiled and spec.in_features % BLOCK == 0
        g = cls(spec.in_features, spec.dtype, spec.out_dtype or spec.dtype, spec.weights, spec.rows_per_thread,
                spec.columns_per_group, spec.compiled_rows, spec.glu, spec.norm_eps is not None,
                spec.subgroup_lanes or 1)
        assert g.words % g.words_per_load == 0 and g.block % g.chunk_values == 0  # a chunk within one block
        assert g.subgroup_lanes == 1 << g.shuffle_steps and LANES % g.subgroup_lanes == 0
        return g

    @property
    def per_word(self) -> int:  # weights a packed u32
        return 8 if self.weights == "q4" else 4

    @property
    def words_per_load(self) -> int:
        return Q8A_WORDS_PER_LOAD if self.weights == "q8a" else WORDS_PER_LOAD

    @property
    def word_vector(self) -> str:  # the dtype of a lane's load of a row
        return f"uint32x{self.words_per_load}"

    @property
    def block(self) -> int:  # weights a scale (and min)
        return Q8A_BLOCK if self.weights == "q8a" else BLOCK

    @property
    def blocks(self) -> int:  # a row's scales
        return self.in_features // self.block

    @property
    def has_min(self) -> bool:
        return self.weights != "q8"

    @property
    def words(self) -> int:  # a row's packed words
        return self.in_features // self.per_word

    @property
    def chunks(self) -> int:  # a row's loads of words_per_load neighbouring words
        return self.words // self.words_per_load

    @property
    def chunk_values(self) -> int:  # weights a chunk
        return self.words_per_load * self.per_word

    @property
    def x_vecs(self) -> int:  # x's (and the norm's) 4-wide vectors a chunk
        return self.chunk_values // 4

    @property
    def trip_groups(self) -> int:  # a lane's chunks along a row, TRIP_UNROLL at a time
        trips = (self.chunks + LANES - 1) // LANES
        return (trips + TRIP_UNROLL - 1) // TRIP_UNROLL

    @property
    def columns_per_thread(self) -> int:  # with a gate (glu) a column takes two rows (gate, up)
        return self.rows_per_thread if self.glu is None else self.rows_per_thread // 2

    @property
    def dots(self) -> int:  # the lanes' partial dots in workgroup memory (row 0's x^2 sums follow)
        return self.rows_per_thread * ROWS * TOKENS * LANES

    @property
    def partial_words(self) -> int:  # f32 words of workgroup memory for the dots and (normed) the x^2 sums
        return self.dots + TOKENS * LANES if self.normed else self.dots

    @property
    def shuffle_steps(self) -> int:
        return self.subgroup_lanes.bit_length() - 1

    @property
    def lane_sums(self) -> int:  # the partials of a (row, token) that meet in workgroup memory
        return LANES // self.subgroup_lanes

    def w_rows(self, out_features):
        """W's rows: the runtime value, or the compiled one."""
        return self.compiled_rows if self.compiled_rows is not None else out_features

    def out_columns(self, out_features):
        """y's width."""
        return out_features if self.glu is None else self.w_rows(out_features) // 2

    def weight_row(self, rb, r, q, width):
        """W's row of thread r's q-th row in workgroup rb. Its columns (of y, `width` wide) are
        rb * columns_per_group + c * ROWS + r; with a gate (glu) q = 2c is column c's gate row and
        q = 2c + 1 its up row, `width` rows further on."""
        if self.glu is not None:
            return (q % 2) * width + rb * self.columns_per_group + (q // 2) * ROWS + r
        return rb * self.columns_per_group + q * ROWS + r

    def dot_row(self, c):
        """The row (q) whose dot makes column c of a thread."""
        return c if self.glu is None else 2 * c


def lane_partial(q, row, j, lane):
    """Where in workgroup memory lane `lane` leaves its partial dot of thread `row`'s q-th row for token j."""
    return ((q * ROWS + row) * TOKENS + j) * LANES + lane


def word_of(word, p, u):
    """Word u of row p's loaded chunk."""
    return T.Shuffle([word[p]], [u])


def weight_value(g: Geometry, word, p, e, s, m):
    """Weight e of row p's loaded chunk, dequantized: q4 (q * s + m), q8 (signed byte * s) or q8a
    (signed byte * s + m, its bytes in x's code order: contract.model.q8a_code_position)."""
    if g.weights == "q4":
        nibbles = T.shift_right(word_of(word, p, e // 8), T.uint32(4 * (e % 8)))
        return T.Cast("float32", T.bitwise_and(nibbles, T.uint32(15))) * s + m
    if g.weights == "q8":
        return T.Cast("float32", sign_extend_byte(word_of(word, p, e // 4), e % 4)) * s
    u, b = q8a_code_position(e)
    return T.Cast("float32", sign_extend_byte(word_of(word, p, u), b)) * s + m


def x_value(g: Geometry, merged: bool, xv4, partial, wi, k):
    """Element k of chunk wi's x: loaded 4-wide, or merged into workgroup memory after the partials."""
    if merged:
        return partial[g.partial_words + wi * g.chunk_values + k]
    return T.Shuffle([xv4[k // 4]], [k % 4])


def int8_dot(g: Geometry, word, p, xw):
    """The chunk's dot of row p's codes with x's int8 codes: four dot4I8Packed, each on a q4 word's
    even or odd nibbles (one mask, one shift), or on a q8a word as it is, against the matching word of
    x's codes (a q8a block's bytes are in their order)."""
    if g.weights == "q8a":
        terms = [T.call_pure_extern("int32", "dot4I8Packed", word_of(word, p, u), T.Shuffle([xw[0]], [u]))
                 for u in range(Q8A_WORDS_PER_LOAD)]
        return (terms[0] + terms[1]) + (terms[2] + terms[3])
    terms = []
    for u in range(WORDS_PER_LOAD):
        w_u = word_of(word, p, u)
        for half, nibbles in enumerate((w_u, T.shift_right(w_u, T.uint32(4)))):
            terms.append(T.call_pure_extern("int32", "dot4I8Packed", T.bitwise_and(nibbles, T.uint32(LOW_NIBBLES)),
                                            T.Shuffle([xw[0]], [2 * u + half])))
    return (terms[0] + terms[1]) + (terms[2] + terms[3])


def check_folds(spec: MatmulSpec, variant: str, **folds: bool) -> None:
    """Fail where `spec` asks for one of `folds`, which the `variant` kernel does not compile."""
    asked = [fold for fold, on in folds.items() if on]
    if asked:
        raise ValueError(f"{spec.name}: the decode matmul's {variant} variant does not fold {', '.join(asked)}")


@T.macro
def load_weight_chunk(g, w, scale, wmin, word, ws, wm, rb, r, wi, width):
    """word[p], ws[p], wm[p] = chunk wi of this thread's row p, and its block's scale and min."""
    blk: T.let[T.int32] = wi * g.chunk_values // g.block
    for p in T.unroll(g.rows_per_thread):
        word[p] = w[g.weight_row(rb, r, p, width), wi]
        ws[p] = scale[g.weight_row(rb, r, p, width), blk]
        wm[p] = T.if_then_else(g.has_min, wmin[g.weight_row(rb, r, p, width), blk], T.float32(0))


@T.macro
def dot_float_chunk(g, x, norm, merged, xv4, nq, partial, word, ws, wm, acc, squares, r, tok0, n, wi):
    """acc[p] += this thread's row p's chunk wi . x's (x in `dtype`, or `merged` into workgroup
    memory at g.partial_words). With the RMSNorm folded in, since norm(x) @ W^T = inv_rms(x) *
    (x @ (W * norm)^T), the norm's weight scales x here and row 0 also sums x^2 for inv_rms: the
    normalized x never goes to memory, nor is it rounded to `dtype`."""
    for j in T.unroll(TOKENS):
        if tok0 + j < n:
            for v in T.unroll(g.x_vecs):  # the chunk's x (and norm weights) as 4-wide loads
                if not merged:
                    xv4[v] = T.Cast("float32x4", x[tok0 + j, wi * g.x_vecs + v])
                nq[v] = norm[wi * g.x_vecs + v] if g.normed else T.Broadcast(T.float32(1), 4)
            for e in T.unroll(g.chunk_values):
                xv: T.let[T.float32] = x_value(g, merged, xv4, partial, wi, e)
                nk: T.let[T.float32] = T.Shuffle([nq[e // 4]], [e % 4])
                for p in T.unroll(g.rows_per_thread):
                    acc[p * TOKENS + j] = acc[p * TOKENS + j] + \
                        weight_value(g, word, p, e, ws[p], wm[p]) \
                        * (xv * nk)
                if g.normed:
                    if r == 0:  # every row reads the same x: one row sums it
                        squares[j] = squares[j] + xv * xv


@T.macro
def dot_int8_chunk(g, xq, xstats, xrow, xw, xst, word, ws, wm, acc, squares, r, tok0, n, wi):
    """acc[p] += this thread's row p's chunk wi . x's, x as kernels.quantize_x's codes c and stats
    (d, d * sum c, sum x^2) in row `xrow` of xq, xstats (tok0 in the quantizer's buffers, 0 in the
    prologue's workgroup copy): s * d * (q . c) + m * d * sum c, the dot with the dequantized codes,
    with no float work a weight. The quantizer applied the norm's weight; row 0 sums the chunks' x^2."""
    if tok0 < n:  # one token (TOKENS == 1)
        xw[0] = xq[xrow, wi]
        xst[0] = xstats[xrow, wi]
        for p in T.unroll(g.rows_per_thread):
            acc[p] = acc[p] + ws[p] * (T.Shuffle([xst[0]], [0]) * T.Cast("float32", int8_dot(g, word, p, xw))) \
                + wm[p] * T.Shuffle([xst[0]], [1])
        if g.normed:
            if r == 0:
                squares[0] = squares[0] + T.Shuffle([xst[0]], [2])


def chunk_codes(code):
    """A chunk's four words of codes as one vector."""
    return T.Shuffle([T.reinterpret("uint32", code[u]) for u in range(XQ_WORDS)], list(range(XQ_WORDS)))


def chunk_stats(d, code_sum, squares):
    """A chunk's stats as kernels.quantize_x writes them: d, d * sum c, sum x^2, 0."""
    return T.Shuffle([d, d * T.Cast("float32", code_sum), squares, T.float32(0)], [0, 1, 2, 3])


def prologue_trips(g: Geometry) -> int:
    """The workgroup's turns over x's chunks in quantize_x_prologue: one chunk a thread a turn."""
    return (g.chunks + ROWS * LANES - 1) // (ROWS * LANES)


@T.macro
def quantize_x_prologue(g, x, norm, xq, xstats, xv4, qs, code, r, lane, tok0, n):
    """xq[0, c], xstats[0, c] (workgroup memory) = what kernels.quantize_x writes for chunk c of token
    tok0's x times the norm's weight, in the same arithmetic and order, a whole chunk a thread (no
    meeting in workgroup memory); then the barrier before the dots read them. Every workgroup makes
    the whole of x's codes: a quantize dispatch and its round trip through memory fewer. qs: 0 the
    chunk's max |v|, 1 its sum x^2, 2 a vector's; code: the chunk's four words, then their codes' sum."""
    for k in T.serial(prologue_trips(g)):
        c: T.let[T.int32] = k * ROWS * LANES + r * LANES + lane
        if c < g.chunks:
            if tok0 < n:
                qs[0] = T.float32(0)
                qs[1] = T.float32(0)
                for v in T.unroll(g.x_vecs):
                    xv4[v] = T.Cast("float32x4", x[tok0, c * g.x_vecs + v])
                    qs[2] = T.float32(0)
                    for e in T.unroll(VEC):  # sum x^2 of the unnormed x, a vector at a time as the quantizer adds
                        qs[2] = qs[2] + T.Shuffle([xv4[v]], [e]) * T.Shuffle([xv4[v]], [e])
                    qs[1] = qs[1] + qs[2]
                    xv4[v] = xv4[v] * norm[c * g.x_vecs + v]
                    for e in T.unroll(VEC):
                        qs[0] = T.max(qs[0], T.abs(T.Shuffle([xv4[v]], [e])))
                inv: T.let[T.float32] = T.if_then_else(qs[0] > T.float32(0), T.float32(CODE_MAX) / qs[0],
                                                       T.float32(0))
                for u in T.unroll(XQ_WORDS + 1):
                    code[u] = T.int32(0)
                for v in T.unroll(g.x_vecs):
                    for e in T.unroll(VEC):
                        value_code: T.let[T.int32] = T.Cast("int32", T.floor(
                            T.float32(0.5) + T.Shuffle([xv4[v]], [e]) * inv))
                        code[XQ_WORDS] = code[XQ_WORDS] + value_code
                        code[code_position(v * VEC + e)[0]] = T.bitwise_or(
                            code[code_position(v * VEC + e)[0]],
                            T.shift_left(T.bitwise_and(value_code, BYTE), 8 * code_position(v * VEC + e)[1]))
                xq[0, c] = chunk_codes(code)
                xstats[0, c] = chunk_stats(qs[0] / T.float32(CODE_MAX), code[XQ_WORDS], qs[1])
    T.tvm_storage_sync("shared")


@T.macro
def reduce_lanes(g, acc, squares, partial, r, lane):
    """Leave this thread's partial dots (and row 0's x^2 sums) in workgroup memory. With subgroups
    each g.subgroup_lanes neighbouring lanes first add theirs up by subgroupShuffleDown, so lane 0 of
    each run holds the sum and only LANES / subgroup_lanes partials a row are stored: right wherever
    subgroups hold whole, aligned runs of that many invocations, as the host checks."""
    for k in T.unroll(g.shuffle_steps):  # uniform control flow: every row shuffles its squares
        for a in T.unroll(g.rows_per_thread * TOKENS):
            acc[a] = acc[a] + T.webgpu.subgroup_shuffle_down(acc[a], T.uint32(g.subgroup_lanes // 2) >> T.uint32(k))
        if g.normed:
            for j in T.unroll(TOKENS):
                squares[j] = squares[j] + T.webgpu.subgroup_shuffle_down(
                    squares[j], T.uint32(g.subgroup_lanes // 2) >> T.uint32(k))
    if lane % g.subgroup_lanes == 0:
        for p in T.unroll(g.rows_per_thread):
            for j in T.unroll(TOKENS):
                partial[lane_partial(p, r, j, lane)] = acc[p * TOKENS + j]
        for j in T.unroll(TOKENS):
            if g.normed:
                if r == 0:
                    partial[g.dots + j * LANES + lane] = squares[j]


@T.macro
def column_value(g, total, partial, p, r, lane, eps, rope_pair):
    """total[0] = the value of this thread's column p for token `lane` (the epilogue's thread of token
    j is lane j): its row's dot, times inv_rms (normed), gated by the up row's (glu: act(gate) * up).
    total[2] holds the up row's dot, or with `rope_pair` the dot of the pair's other column (thread
    r ^ 1's: a RoPE pair never crosses a workgroup's 8-column groups), normed alike."""
    total[0] = T.float32(0)
    total[1] = T.float32(0)
    total[2] = T.float32(0)
    for ls in T.serial(g.lane_sums):
        l: T.let[T.int32] = ls * g.subgroup_lanes  # a lane that holds a sum
        total[0] = total[0] + partial[lane_partial(g.dot_row(p), r, lane, l)]
        if g.normed:
            total[1] = total[1] + partial[g.dots + lane * LANES + l]
        if g.glu is not None:
            total[2] = total[2] + partial[lane_partial(g.dot_row(p) + 1, r, lane, l)]
        if rope_pair:
            total[2] = total[2] + partial[lane_partial(p, T.bitwise_xor(r, 1), lane, l)]
    if g.normed:
        inv_rms: T.let[T.float32] = T.rsqrt(total[1] / T.float32(g.in_features) + eps)
        total[0] = total[0] * inv_rms
        total[2] = total[2] * inv_rms
    if g.glu is not None:
        total[0] = gated(total[0], total[2], g.glu)
