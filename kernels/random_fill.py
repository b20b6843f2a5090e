"""TIR kernels that fill a buffer with pseudo-random values on the GPU: a synthetic model's weights
(model_glue.synthetic) are made where they are used, so a shape with gigabytes of weights runs with
nothing to download or upload.

Element i of a fill with seed s is a function of (i, s) alone (PCG's output hash of a PCG step), so
a fill gives the same values on every adapter and for any workgroup count. The grid is fixed
(WORKGROUPS x THREADS invocations); each invocation strides over the buffer, so a buffer of any
length `n` (a PODArg) fits one dispatch without running into the 65,535 workgroups of a grid axis.
A dispatch may fill a slice of a tensor (one past the adapter's binding limit is filled a binding at
a time): its element i is the tensor's element `element_base + i`, so the values do not depend on
how the tensor is sliced.
"""

from __future__ import annotations

from tvm.script import tirx as T

THREADS = 256
WORKGROUPS = 1024
STRIDE = THREADS * WORKGROUPS  # elements one trip of the whole grid covers
INV_2_24 = 1.0 / (1 << 24)  # 24 random bits -> [0, 1), exact in f32
# A Q4 block's min is -scale x a factor in [MIN_CODE_LO, MIN_CODE_LO + MIN_CODE_SPAN): centred on the
# codes' mean 7.5, so blocks have no common bias. (A factor near 8, as real files' blocks often have,
# gives every row the same negative bias: over 32 layers of the 8B shape the residual then overflowed
# f16 and every logit was NaN.)
MIN_CODE_LO, MIN_CODE_SPAN = 7.3, 0.4

# PCG-RXS-M-XS 32-bit (O'Neill 2014): one LCG step, then the output permutation.
PCG_MULTIPLIER, PCG_INCREMENT, PCG_OUTPUT_MULTIPLIER = 747796405, 2891336453, 277803737


def _random_macro():
    """A TVMScript macro: h[0] = random word `stream` of element i, hash(hash(2i + stream) + seed).
    Each step goes through the local array h, so TVM never inlines one step's expression into the
    next (inlined, the hash's text would grow threefold per step)."""

    @T.macro
    def random_word(h, i, seed, stream):
        h[0] = T.Cast("uint32", i) * T.uint32(2) + T.uint32(stream)
        for _round in T.unroll(2):
            h[1] = h[0] * T.uint32(PCG_MULTIPLIER) + T.uint32(PCG_INCREMENT)
            h[1] = T.bitwise_xor(T.shift_right(h[1], T.shift_right(h[1], T.uint32(28)) + T.uint32(4)), h[1]) \
                * T.uint32(PCG_OUTPUT_MULTIPLIER)
            h[0] = T.bitwise_xor(T.shift_right(h[1], T.uint32(22)), h[1]) + T.Cast("uint32", seed) * T.Cast("uint32", _round == 0)

    return random_word


def _unit(word):
    """The top 24 bits of a random word as a float32 in [0, 1)."""
    return T.Cast("float32", T.shift_right(word, T.uint32(8))) * T.float32(INV_2_24)


def random_words():
    """out[i] = 32 random bits: packed 4-bit or 8-bit weight codes (every bit pattern is a valid code)."""
    random_word = _random_macro()

    @T.prim_func(s_tir=True)
    def random_words_kernel(out_h: T.handle, seed: T.int32, element_base: T.int32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        out = T.match_buffer(out_h, (n,), "uint32")
        for g in T.thread_binding(WORKGROUPS, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("random_words"):
                    T.reads()
                    T.writes()
                    h = T.sblock_alloc_buffer((2,), "uint32", scope="local")
                    for trip in T.serial(T.ceildiv(n, STRIDE)):
                        i: T.let[T.int32] = trip * STRIDE + g * THREADS + t
                        if i < n:
                            random_word(h, element_base + i, seed, 0)
                            out[i] = h[0]

    return random_words_kernel


def random_uniform():
    """out[i] uniform in [lo, hi): norm weights and Q8 block scales."""
    random_word = _random_macro()

    @T.prim_func(s_tir=True)
    def random_uniform_kernel(out_h: T.handle, seed: T.int32, lo: T.float32, hi: T.float32, element_base: T.int32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        out = T.match_buffer(out_h, (n,), "float32")
        for g in T.thread_binding(WORKGROUPS, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("random_uniform"):
                    T.reads()
                    T.writes()
                    h = T.sblock_alloc_buffer((2,), "uint32", scope="local")
                    for trip in T.serial(T.ceildiv(n, STRIDE)):
                        i: T.let[T.int32] = trip * STRIDE + g * THREADS + t
                        if i < n:
                            random_word(h, element_base + i, seed, 0)
                            out[i] = lo + (hi - lo) * _unit(h[0])

    return random_uniform_kernel


def random_q4_blocks():
    """Q4_1 block constants: scale[i] uniform in [lo, hi), min[i] = -scale[i] times a factor in
    [7.3, 7.7), so a block's mean weight (scale * (7.5 - factor)) is small and of either sign."""
    random_word = _random_macro()

    @T.prim_func(s_tir=True)
    def random_q4_blocks_kernel(scale_h: T.handle, min_h: T.handle, seed: T.int32, lo: T.float32, hi: T.float32,
                                element_base: T.int32):
        T.func_attr({"tirx.is_scheduled": True})
        n = T.int32()
        scale = T.match_buffer(scale_h, (n,), "float32")
        wmin = T.match_buffer(min_h, (n,), "float32")
        for g in T.thread_binding(WORKGROUPS, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("random_q4_blocks"):
                    T.reads()
                    T.writes()
                    h = T.sblock_alloc_buffer((2,), "uint32", scope="local")
                    s = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    for trip in T.serial(T.ceildiv(n, STRIDE)):
                        i: T.let[T.int32] = trip * STRIDE + g * THREADS + t
                        if i < n:
                            random_word(h, element_base + i, seed, 0)
                            s[0] = lo + (hi - lo) * _unit(h[0])
                            scale[i] = s[0]
                            random_word(h, element_base + i, seed, 1)
                            wmin[i] = -s[0] * (T.float32(MIN_CODE_LO) + T.float32(MIN_CODE_SPAN) * _unit(h[0]))

    return random_q4_blocks_kernel
