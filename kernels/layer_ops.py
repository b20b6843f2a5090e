"""The layer's small kernels: the Q8 embedding, RMSNorm (CPU rasterizers: GPUs fold it into the next
matmul), RoPE with the K/V append, SwiGLU (CPU rasterizers: GPUs fold it into gate/up's epilogue).
The packing and conventions: kernels.llama_common."""

from __future__ import annotations

from tvm.script import tirx as T

from contract.kernels import PAGE_SIZE
from contract.model import Q8A_BLOCK, q8a_weight_at
from kernels.llama_common import BLOCK, THREADS, gated, sign_extend_byte, workgroup_sum


def embedding_q8(dim: int, dtype: str, weights: str = "q8"):
    """out[i, :] = dequantized row ids[i] of the embedding, Q8 (code * scale) or Q8A (code * scale + min,
    a block's bytes in contract.model.q8a_code_position's order), times `embed_scale` (Gemma's
    sqrt(dim), else 1: contract.model.embed_scale). One workgroup per token; the vocabulary is a runtime size.
    The tensors are bound from row `row_base` on, `vocab` rows of them (one slice of the vocabulary,
    contract.slices; the whole of it, row_base 0, where it fits one binding): only the tokens whose
    ids fall in the slice are written."""
    WORDS = dim // 4
    WORD_TRIPS = (WORDS + THREADS - 1) // THREADS
    q8a = weights == "q8a"
    W_BLOCK = Q8A_BLOCK if q8a else BLOCK

    def position(w, k):
        """The row's weight at byte k of word w: in order (Q8), or by the Q8A block order."""
        if not q8a:
            return w * 4 + k
        return (w // 4) * Q8A_BLOCK + q8a_weight_at(w % 4, k)

    def value(word, k, s, wmin, row, w):
        """The weight at byte k of word w of the row: code * scale (+ its block's min, Q8A)."""
        scaled = T.Cast("float32", sign_extend_byte(word, k)) * s
        return scaled + wmin[row, w * 4 // W_BLOCK] if q8a else scaled

    @T.prim_func(s_tir=True)
    def embedding(ids_h: T.handle, w_h: T.handle, scale_h: T.handle, min_h: T.handle, out_h: T.handle,
                  embed_scale: T.float32, row_base: T.int32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        vocab = T.int32()  # the slice's rows
        ids = T.match_buffer(ids_h, (n,), "int32")
        w = T.match_buffer(w_h, (vocab, WORDS), "uint32")  # the codes
        scale = T.match_buffer(scale_h, (vocab, dim // W_BLOCK), "float32")
        wmin = T.match_buffer(min_h, (vocab, dim // W_BLOCK), "float32")  # Q8A only
        out = T.match_buffer(out_h, (n, dim), dtype)
        for i in T.thread_binding(n, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("embedding"):
                    T.reads()
                    T.writes()
                    row: T.let[T.int32] = ids[i] - row_base  # the id's row in the slice
                    for trip in T.serial(WORD_TRIPS):
                        wi: T.let[T.int32] = trip * THREADS + t
                        if wi < WORDS and row >= 0 and row < vocab:
                            word: T.let[T.uint32] = w[row, wi]
                            s: T.let[T.float32] = scale[row, wi * 4 // W_BLOCK]
                            for k in T.unroll(4):
                                out[i, position(wi, k)] = T.Cast(dtype, value(word, k, s, wmin, row, wi) * embed_scale)

    return embedding


def rms_norm(dim: int, dtype: str, residual: bool = False):
    """out = x / sqrt(mean(x^2) + eps) * weight, one workgroup per row (CPU rasterizers: GPUs fold the
    norm into the matmul that consumes it); with `residual`, out = resid + that: the post-norm of an
    attention or FFN output before its residual add (contract.family.Family.post_norms), on every adapter."""
    TRIPS = (dim + THREADS - 1) // THREADS

    def added(resid, i, j, value):
        return T.Cast("float32", resid[i, j]) + value if residual else value

    @T.prim_func(s_tir=True)
    def rms_norm_kernel(x_h: T.handle, weight_h: T.handle, resid_h: T.handle, out_h: T.handle, eps: T.float32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        x = T.match_buffer(x_h, (n, dim), dtype)
        weight = T.match_buffer(weight_h, (dim,), "float32")
        resid = T.match_buffer(resid_h, (n, dim), dtype)  # read only with `residual`: TVM drops it otherwise
        out = T.match_buffer(out_h, (n, dim), dtype)
        for i in T.thread_binding(n, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("rms_norm"):
                    T.reads()
                    T.writes()
                    partial = T.sblock_alloc_buffer((THREADS,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    acc[0] = T.float32(0)
                    for trip in T.unroll(TRIPS):
                        if trip * THREADS + t < dim:
                            v: T.let[T.float32] = T.Cast("float32", x[i, trip * THREADS + t])
                            acc[0] = acc[0] + v * v
                    partial[t] = acc[0]
                    workgroup_sum(partial, 0, t)
                    inv_rms: T.let[T.float32] = T.rsqrt(partial[0] / T.float32(dim) + eps)
                    for trip in T.unroll(TRIPS):
                        if trip * THREADS + t < dim:
                            out[i, trip * THREADS + t] = T.Cast(dtype, added(
                                resid, i, trip * THREADS + t,
                                T.Cast("float32", x[i, trip * THREADS + t]) * inv_rms * weight[trip * THREADS + t]))

    return rms_norm_kernel



def rope_inv_freq(pair, exponent, scaling=None):
    """The rotation frequency of adjacent pair `pair` of a head, f32, from the runtime values of
    contract.kernels.rope_values: theta^(-2 pair / D) = exp2(2 pair * exponent), then (`scaling`: the
    values inv_factor, ratio, low, span) Llama 3's scaling, (1 - s) * inv_factor + s times it,
    s = clamp((ratio * inv_freq - low) / span, 0, 1) with ratio = original context / (2 pi) and
    span = high - low (contract.model.rope_frequency_divisors)."""
    inv_freq = T.exp2(T.Cast("float32", 2 * pair) * exponent)
    if scaling is None:
        return inv_freq
    inv_factor, ratio, low, span = scaling
    smooth = T.min(T.max((inv_freq * ratio - low) / span, T.float32(0)), T.float32(1))
    return inv_freq * ((T.float32(1) - smooth) * inv_factor + smooth)


def rope_and_append(head_dim: int, dtype: str, scaled: bool, page_size: int = PAGE_SIZE):
    """Adjacent-pair RoPE on q and k of a fused qkv row, then K and V written into their page slot.
    The head counts and RoPE's base and scaling are runtime values (contract.kernels.rope_values);
    whether there is a scaling is compiled in (`scaled`).

    qkv[n, (H + 2 H_kv) * D] -> q[n, H, D] (rotated), pages[slot // 16, 0|1, kv_head, slot % 16, :].
    GGUFs permute their Q/K weights for adjacent pairs (x[2i], x[2i+1]). With Llama 3's
    `rope_scaling` (factor, low, high, original context) a pair's frequency is scaled by
    (1 - s) / factor + s, s = clamp((original / wavelength - low) / (high - low), 0, 1)
    (contract.model.rope_frequency_divisors).
    """
    D = head_dim

    @T.prim_func(s_tir=True)
    def rope_append(qkv_h: T.handle, positions_h: T.handle, slots_h: T.handle, pages_h: T.handle, q_h: T.handle,
                    rope_exponent: T.float32, rope_inv_factor: T.float32, rope_ratio: T.float32,
                    rope_low: T.float32, rope_span: T.float32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        num_pages = T.int32()
        q_heads = T.int32()
        kv_heads = T.int32()
        pages = T.match_buffer(pages_h, (num_pages, 2, kv_heads, page_size, D), dtype)
        q = T.match_buffer(q_h, (n, q_heads, D), dtype)
        qkv = T.match_buffer(qkv_h, (n, (q_heads + 2 * kv_heads) * D), dtype)
        positions = T.match_buffer(positions_h, (n,), "int32")
        slots = T.match_buffer(slots_h, (n,), "int32")
        for i in T.thread_binding(n, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("rope_append"):
                    T.reads()
                    T.writes()
                    page: T.let[T.int32] = slots[i] // page_size
                    slot: T.let[T.int32] = slots[i] % page_size
                    for trip in T.serial(T.ceildiv((q_heads + kv_heads) * (D // 2), THREADS)):
                        p: T.let[T.int32] = trip * THREADS + t
                        if p < (q_heads + kv_heads) * (D // 2):  # rotated pairs: q heads, then k heads
                            head: T.let[T.int32] = p // (D // 2)
                            pair: T.let[T.int32] = p % (D // 2)
                            x0: T.let[T.float32] = T.Cast("float32", qkv[i, head * D + 2 * pair])
                            x1: T.let[T.float32] = T.Cast("float32", qkv[i, head * D + 2 * pair + 1])
                            inv_freq: T.let[T.float32] = rope_inv_freq(
                                pair, rope_exponent, (rope_inv_factor, rope_ratio, rope_low, rope_span) if scaled else None)
                            angle: T.let[T.float32] = T.Cast("float32", positions[i]) * inv_freq
                            c: T.let[T.float32] = T.cos(angle)
                            sn: T.let[T.float32] = T.sin(angle)
                            if head < q_heads:
                                q[i, head, 2 * pair] = T.Cast(dtype, x0 * c - x1 * sn)
                                q[i, head, 2 * pair + 1] = T.Cast(dtype, x0 * sn + x1 * c)
                            else:
                                pages[page, 0, head - q_heads, slot, 2 * pair] = T.Cast(dtype, x0 * c - x1 * sn)
                                pages[page, 0, head - q_heads, slot, 2 * pair + 1] = T.Cast(dtype, x0 * sn + x1 * c)
                    for trip in T.serial(T.ceildiv(kv_heads * D, THREADS)):
                        e: T.let[T.int32] = trip * THREADS + t
                        if e < kv_heads * D:
                            pages[page, 1, e // D, slot, e % D] = qkv[i, (q_heads + kv_heads) * D + e]

    return rope_append


def rope_heads_and_append(head_dim: int, dtype: str, scaled: bool, pairs: str, qk_norm: bool, bias: bool,
                          page_size: int = PAGE_SIZE):
    """RoPE on q and k of a fused qkv row a head at a time, then K and V into their page slot, for the
    families whose rotation is not llama's adjacent pairs alone (contract.family): the q|k|v `bias`
    added first (qkv_bias); each q and k head RMS-normed with the q_norm / k_norm weights (`qk_norm`,
    value eps); pairs (x[2i], x[2i+1]) ("adjacent") or (x[i], x[i + D/2]) ("halves"), both rotated by
    theta^(-2i/D) (rope_inv_freq; theta is the layer's: its `rope_exponent`).

    One workgroup per token and head of q or k (a k head's also appends its V head), its threads over
    the head's dims (head_dim <= THREADS).
    """
    D = head_dim
    assert D <= THREADS and D % 2 == 0
    HALF = D // 2

    def dim_of(p, second: int):
        """Dim `second` (0 or 1) of the two rotated together as pair p."""
        return 2 * p + second if pairs == "adjacent" else p + HALF * second

    def loaded(qkv, qkv_bias, i, column):
        """Column `column` of token i's qkv row in f32, its bias added."""
        value = T.Cast("float32", qkv[i, column])
        return value + qkv_bias[column] if bias else value

    def norm_weight(q_norm, k_norm, head, q_heads, d):
        return T.if_then_else(head < q_heads, q_norm[d], k_norm[d]) if qk_norm else T.float32(1)

    @T.prim_func(s_tir=True)
    def rope_heads(qkv_h: T.handle, bias_h: T.handle, q_norm_h: T.handle, k_norm_h: T.handle, positions_h: T.handle,
                   slots_h: T.handle, pages_h: T.handle, q_h: T.handle, rope_exponent: T.float32,
                   rope_inv_factor: T.float32, rope_ratio: T.float32, rope_low: T.float32, rope_span: T.float32,
                   eps: T.float32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        num_pages = T.int32()
        q_heads = T.int32()
        kv_heads = T.int32()
        pages = T.match_buffer(pages_h, (num_pages, 2, kv_heads, page_size, D), dtype)
        q = T.match_buffer(q_h, (n, q_heads, D), dtype)
        qkv = T.match_buffer(qkv_h, (n, (q_heads + 2 * kv_heads) * D), dtype)
        qkv_bias = T.match_buffer(bias_h, ((q_heads + 2 * kv_heads) * D,), "float32")  # with `bias` only
        q_norm = T.match_buffer(q_norm_h, (D,), "float32")  # with `qk_norm` only
        k_norm = T.match_buffer(k_norm_h, (D,), "float32")
        positions = T.match_buffer(positions_h, (n,), "int32")
        slots = T.match_buffer(slots_h, (n,), "int32")
        for i in T.thread_binding(n, thread="blockIdx.x"):
            for head in T.thread_binding(q_heads + kv_heads, thread="blockIdx.y"):  # q heads, then k heads
                for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("rope_heads"):
                        T.reads()
                        T.writes()
                        partial = T.sblock_alloc_buffer((THREADS,), "float32", scope="shared")
                        inv_rms = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        page: T.let[T.int32] = slots[i] // page_size
                        slot: T.let[T.int32] = slots[i] % page_size
                        inv_rms[0] = T.float32(1)
                        if qk_norm:
                            partial[t] = T.float32(0)
                            if t < D:
                                v: T.let[T.float32] = loaded(qkv, qkv_bias, i, head * D + t)
                                partial[t] = v * v
                            workgroup_sum(partial, 0, t)
                            inv_rms[0] = T.rsqrt(partial[0] / T.float32(D) + eps)
                        if t < HALF:
                            lo: T.let[T.int32] = dim_of(t, 0)
                            hi: T.let[T.int32] = dim_of(t, 1)
                            x0: T.let[T.float32] = (loaded(qkv, qkv_bias, i, head * D + lo) * inv_rms[0]
                                                    * norm_weight(q_norm, k_norm, head, q_heads, lo))
                            x1: T.let[T.float32] = (loaded(qkv, qkv_bias, i, head * D + hi) * inv_rms[0]
                                                    * norm_weight(q_norm, k_norm, head, q_heads, hi))
                            inv_freq: T.let[T.float32] = rope_inv_freq(
                                t, rope_exponent, (rope_inv_factor, rope_ratio, rope_low, rope_span) if scaled else None)
                            angle: T.let[T.float32] = T.Cast("float32", positions[i]) * inv_freq
                            c: T.let[T.float32] = T.cos(angle)
                            sn: T.let[T.float32] = T.sin(angle)
                            if head < q_heads:
                                q[i, head, lo] = T.Cast(dtype, x0 * c - x1 * sn)
                                q[i, head, hi] = T.Cast(dtype, x0 * sn + x1 * c)
                            else:
                                pages[page, 0, head - q_heads, slot, lo] = T.Cast(dtype, x0 * c - x1 * sn)
                                pages[page, 0, head - q_heads, slot, hi] = T.Cast(dtype, x0 * sn + x1 * c)
                        if head >= q_heads and t < D:  # a k head's workgroup also appends its V head
                            pages[page, 1, head - q_heads, slot, t] = T.Cast(
                                dtype, loaded(qkv, qkv_bias, i, (head + kv_heads) * D + t))

    return rope_heads


def swiglu(dtype: str, activation: str = "silu"):
    """h[n, j] = act(gate_up[n, j]) * gate_up[n, ffn + j], act SiLU or GELU-tanh (kernels.llama_common.gated;
    CPU rasterizers only: GPUs fold it into the gate/up matmul's epilogue); the FFN width is a runtime size."""

    @T.prim_func(s_tir=True)
    def swiglu_kernel(gate_up_h: T.handle, h_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        ffn_dim = T.int32()
        h = T.match_buffer(h_h, (n, ffn_dim), dtype)
        gate_up = T.match_buffer(gate_up_h, (n, 2 * ffn_dim), dtype)
        for jb in T.thread_binding(T.ceildiv(ffn_dim, THREADS), thread="blockIdx.x"):
            for i in T.thread_binding(n, thread="blockIdx.y"):
                for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("swiglu"):
                        T.reads()
                        T.writes()
                        j: T.let[T.int32] = jb * THREADS + t
                        if j < ffn_dim:
                            g: T.let[T.float32] = T.Cast("float32", gate_up[i, j])
                            h[i, j] = T.Cast(dtype, gated(g, T.Cast("float32", gate_up[i, ffn_dim + j]), activation))

    return swiglu_kernel

