"""What a kernel is, as both sides see it: the paged KV layout, the decode nests, the WebGPU limits
the kernels are built within, and typed kernel specs.

A spec (`MatmulSpec`, `AttentionSpec`, `KernelRole`) is the one place a kernel's compile-time
choices live: its artifact name and the exact buffers the runtime binds (the kernel's TVMScript
parameter names; TVM drops a handle the kernel never reads) are derived from it. The build makes
each kernel from its spec and fails unless the kernel declares exactly `spec.buffers`, so a flag is
a one-place change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import lru_cache

from contract.family import ACTIVATIONS, Family
from contract.model import (DTYPE_TAGS, WEIGHT_FORMATS, AttentionShape, LlamaConfig, embed_scale, layer_matrices,
                            matrix_format)

# -- paged KV cache and decode attention -------------------------------------------------------------
PAGE_SIZE = 16  # tokens per KV page: pages[num_pages, 2 (K, V), H_kv, PAGE_SIZE, head_dim]
# The nests, the sharded family's layouts and the step's choices between them: contract.attention.
MAX_TOP_K = 64  # the sampler's candidate limit (its rounds each scan the whole vocabulary)

# -- WebGPU limits the kernels are built within ----------------------------------------------------
MAX_INVOCATIONS = 256  # WebGPU's default maxComputeInvocationsPerWorkgroup
WORKGROUP_STORAGE_BYTES = 16384  # WebGPU's default maxComputeWorkgroupStorageSize: our kernels' bound
# TVM's tiled decode kernel in f32 with GQA group 1 needs ~17.5 KiB; every adapter we target offers
# 32 KiB, and the runtime checks each kernel's actual need against the adapter at load.
TILED_WORKGROUP_STORAGE_BYTES = 32768

# -- attention kernels ----------------------------------------------------------------------------------
# The buffers of TVM's batch_decode_paged_kv signature, which both decode nests share.
ATTENTION_INPUTS = ("Q", "pages", "page_table_indptr", "page_table_values", "length_info",
                    "k_rope_pos_offset", "q_rope_position")
ATTENTION_OUTPUTS = ("output", "lse")
ATTENTION_BUFFERS = ATTENTION_INPUTS + ATTENTION_OUTPUTS
# A split kernel's outputs (instead of output and lse): per (sequence, query head, split) the split's
# O (not yet divided) and (max, denominator) in the log2 domain, dense for the call's S:
# [B, H_qo, S, D] and [B, H_qo, S, 2], f32. The merge kernel reads them.
SPLIT_WORKSPACE = ("partial_o", "partial_stats")
MERGE_BUFFERS = SPLIT_WORKSPACE + ATTENTION_OUTPUTS
# A decode matmul's x as int8 codes and per-chunk stats (kernels.quantize_x; MatmulSpec.int8_x).
QUANTIZED_X = ("xq", "xstats")
QUANTIZED_Y = ("yq", "ystats")  # ... and a matmul's y as them, for the next matmul (MatmulSpec.quantizes_y)
# The prefill attention kernel's buffers: one sequence's new queries, the layer's pages, the
# sequence's page ids in order, and the output; scalars `start` (tokens cached before the chunk), sm_scale.
PREFILL_ATTENTION_BUFFERS = ("q", "pages", "page_ids", "output")


@dataclass(frozen=True)
class AttentionSpec:
    """One attention kernel of a shape: decode attention (`kernel` "tiled", or a layout of the
    sharded family, contract.attention.LAYOUTS, over the whole context or, `split`, one split of
    it), the "merge" of a split call's partial states, or causal "prefill" attention. `tag` names
    the layout's build (e.g. contract.attention.subgroup_tag)."""

    kernel: str
    shape: AttentionShape
    dtype: str
    sliding_window: bool = False
    split: bool = False
    tag: str | None = None

    @property
    def name(self) -> str:
        """The name encodes every compile-time parameter."""
        s, dtype = self.shape, DTYPE_TAGS[self.dtype]
        if self.kernel == "merge":  # merges the S partial states of any layout's split kernel
            return f"decode_merge_d{s.head_dim}_qo{s.num_qo_heads}_{dtype}"
        if self.kernel == "prefill":  # tag: MATRIX_PREFILL for the build on subgroup matrices
            build = MATRIX_SUFFIX if self.tag else ""
            return f"prefill_attention{build}_d{s.head_dim}_kv{s.num_kv_heads}_qo{s.num_qo_heads}_{dtype}"
        return (f"decode_{self.kernel}{'_' + self.tag if self.tag else ''}{'_split' if self.split else ''}"
                f"_d{s.head_dim}_kv{s.num_kv_heads}_qo{s.num_qo_heads}_{dtype}{'_sw' if self.sliding_window else ''}")

    @property
    def buffers(self) -> tuple[str, ...]:
        if self.kernel == "merge":
            return MERGE_BUFFERS
        if self.kernel == "prefill":
            return PREFILL_ATTENTION_BUFFERS
        return ATTENTION_INPUTS + SPLIT_WORKSPACE if self.split else ATTENTION_BUFFERS


def attention_kernel_name(kernel: str, shape: AttentionShape, dtype: str, sliding_window: bool = False,
                          split: bool = False, tag: str | None = None) -> str:
    """AttentionSpec(...).name, for a decode attention kernel."""
    return AttentionSpec(kernel, shape, dtype, sliding_window, split, tag).name


# -- the model's kernels --------------------------------------------------------------------------------
# The decode matmul gives each thread 4 weight rows where that still leaves QUAD_MIN_WORKGROUPS
# workgroups, 2 where PAIRED_MIN_WORKGROUPS remain, else 1 (MatmulSpec.rows_per_thread). Fitted to
# the H200 (docs/benchmarks.md): more rows a thread share each load of x; fewer leave more
# workgroups to fill its 132 SMs.
QUAD_MIN_WORKGROUPS = 512
PAIRED_MIN_WORKGROUPS = 384
MATMUL_ROWS = 8  # weight rows (threadIdx.y) of a decode matmul's workgroup: 8 x 32 lanes
# A decode matmul's subgroup builds (MatmulSpec.subgroup_lanes): lanes of a row reduced by shuffles.
MATMUL_SUBGROUP_LANES = (32, 16, 8, 4)
# The served artifact's: a row's 32 lanes, for adapters whose subgroups hold 32 or more (NVIDIA,
# Apple, AMD); an adapter with smaller ones runs the builds without subgroups.
SERVED_MATMUL_SUBGROUP_LANES = 32
PREFILL_TILE_ROWS = 64  # weight rows of a prefill matmul's tile (kernels.prefill_matmul.ROWS)
# Tokens of a prefill matmul's tile (MatmulSpec.token_tile): a pass of at most SHORT_PREFILL_TOKENS
# tokens (a chat turn's few new ones) runs the short tile, so it does not compute 128 token rows.
PREFILL_TOKEN_TILE = 128
SHORT_PREFILL_TOKENS = 32
# The prefill matmuls' subgroup-matrix builds (MatmulSpec.matrix; kernels.prefill_matmul_matrix): f16
# fragments of M = N = K = MATRIX_FRAGMENT with f32 results, in subgroups of exactly MATRIX_SUBGROUP.
MATRIX_FRAGMENT = 16
MATRIX_SUBGROUP = 32
# The adapter's subgroupMatrixConfigs entry those builds need: (operand, result, M, N, K)
MATRIX_CONFIG = ("f16", "f32", MATRIX_FRAGMENT, MATRIX_FRAGMENT, MATRIX_FRAGMENT)
MATRIX_SUFFIX = "_matrix"  # a prefill role's subgroup-matrix build (llama_kernels' prefill_matrix)
SHORT_SUFFIX = "_short"  # a prefill role's short token tile
# A split decode step merges its partial states inside the o-projection (o_merges_splits) while all
# o workgroups together read at most this many bytes of them (from L2): beyond it the merge dispatch
# is cheaper (fitted on the H200: "merged in o vs apart" in docs/benchmarks.md).
O_MERGE_MAX_READ = 16 << 20
# ... and while x is at most this wide: one 4-wide chunk of x a thread, merged before its weight loads
# start (two chunks a thread made the merge's prologue cost more than the dispatch it saves); the
# merged x (f32) then fits workgroup memory too.
O_MERGE_MAX_X = 4 * MATMUL_ROWS * 32  # a 4-wide chunk for each of the workgroup's 8 x 32 threads


# What a model kernel is compiled for, and what it reads as runtime values (its PODArgs), so that
# shapes share kernels: a matmul is compiled for its row width (in_features), its folds and its rows
# a thread, never for its row count (`out_features`: qkv width, FFN width, vocabulary), the norm's
# epsilon, the head counts or the RoPE base and scaling. A model whose every kernel name
# (`llama_kernels(c, dtype)[role].name`) is in the artifact runs, whatever config it comes from.
def rope_values(n_heads: int, n_kv_heads: int, head_dim: int, theta: float, scaling: tuple | None) -> dict:
    """The runtime values of the kernels that apply RoPE (kernels.layer_ops.rope_inv_freq): the head
    counts, theta's exponent per pair, and Llama 3's scaling (factor, low, high, original context)
    as the kernel uses it. Whether there is a scaling at all is compiled in (`rope_tag`)."""
    values = {"q_heads": n_heads, "kv_heads": n_kv_heads, "rope_exponent": -math.log2(theta) / head_dim}
    if scaling is None:
        return values
    factor, low, high, original = scaling
    return {**values, "rope_inv_factor": 1 / factor, "rope_ratio": original / (2 * math.pi), "rope_low": low,
            "rope_span": high - low}


def rope_tag(head_dim: int, scaling: tuple | None) -> str:
    """What a RoPE kernel is compiled for: head_dim, and whether Llama 3's scaling applies (so an
    unscaled model's kernels carry no scaling arithmetic and no neutral values for it)."""
    return f"d{head_dim}{'_scaled' if scaling is not None else ''}"


@dataclass(frozen=True)
class RopeAppend:
    """The decode qkv matmul's epilogue: adjacent-pair RoPE on the q and k columns (Llama 3's
    `scaling` where given, as contract.model.LlamaConfig.rope_scaling), q written to `q`, k and v
    into the token's slot of the layer's pages. It replaces a rope_append dispatch per layer. The
    kernel is compiled for head_dim and whether there is a scaling (`rope_tag`); the rest are
    `rope_values`."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    theta: float
    scaling: tuple | None = None

    @property
    def values(self) -> dict:
        return rope_values(self.n_heads, self.n_kv_heads, self.head_dim, self.theta, self.scaling)


GLU_NAMES = {"silu": "swiglu", "gelu_tanh": "geglu"}  # a gated FFN's fold in a kernel's name, by its activation


@dataclass(frozen=True)
class MatmulSpec:
    """y = x @ W^T with W quantized ("q4": Q4_1, a scale and a min per block of 32; "q8": Q8_0, a
    scale; "q8a": signed bytes, a scale and a min per 16: contract.model), and what is folded into
    it: the RMSNorm before it (`norm_eps`; its weight is `norm`), the gated FFN's activation after it
    (`glu`: W holds the gate rows, then the up rows), a residual add (`resid`).
    Decode passes run kernels.decode_matmul.quantized_matmul (one token); prefill passes (`tiled`) run
    kernels.prefill_matmul (tiles of tokens x weight rows; q4 or q8a).

    The kernel (`name`) is compiled for in_features, the folds, the dtypes and rows_per_thread (and the
    decode gated matmul's rows, `compiled_rows`); out_features, norm_eps and the RoPE epilogue's heads, base
    and scaling are runtime values (`values`), so the builders read them from the kernel's PODArgs,
    never from the spec."""

    out_features: int
    in_features: int
    dtype: str
    weights: str = "q4"
    residual: bool = False
    norm_eps: float | None = None
    # The gated FFN folded in, by the gate's activation (contract.family.ACTIVATIONS): "silu" (SwiGLU),
    # "gelu_tanh" (GeGLU), or None: no gate. One key, so no spec has an activation without the gate.
    glu: str | None = None
    out_dtype: str | None = None  # y's dtype (default: dtype); the head writes f32 logits
    tiled: bool = False
    rope_append: RopeAppend | None = None  # instead of y: q, and K/V into the pages (decode only)
    # The head: each workgroup also writes its columns' largest (value, index) to `best`, so the
    # argmax reads out_features / columns_per_group pairs rather than every logit.
    argmax_partials: bool = False
    # The decode o-projection after a split attention call: x is not read but merged, element by
    # element, from the call's partial states (SPLIT_WORKSPACE, heads of this size; value num_splits),
    # with the merge kernel's arithmetic and its rounding to dtype. It replaces the merge dispatch.
    split_head_dim: int | None = None
    # The decode matmul's lanes whose partial dots meet by subgroup shuffles before workgroup memory
    # (a power of two up to 32, or None: none; kernels.decode_matmul.quantized_matmul). It runs where the
    # adapter's subgroups hold at least this many invocations (model_glue.loading.pick_matmul_subgroup_lanes).
    subgroup_lanes: int | None = None
    # A decode q4 or q8a matmul whose x comes as int8 codes with per-chunk stats (xq, xstats: made by a
    # quantize_x dispatch, which also applies the norm's weight or merges a split call) and whose
    # dots are integer dot products (kernels.decode_matmul.quantized_matmul).
    int8_x: bool = False
    # The epilogue also writes y's int8 codes and stats (yq, ystats) for the next int8_x matmul, as
    # its quantize dispatch would (but sum x^2, 0: the next matmul, down, has no norm): where a
    # workgroup's columns are one 16-value chunk.
    quantizes_y: bool = False
    # An int8_x matmul with the RMSNorm folded in that reads x and the norm's weight and makes x's codes
    # and stats itself, every workgroup all of them into workgroup memory (its prologue), rather than
    # reading a quantize dispatch's: where they fit there beside the lanes' partials (`prologue_fits`).
    quantizes_x: bool = False
    # A decode matmul (norm folded) of a post-norm family whose x is made in its prologue: the residual
    # stream (`stream`) plus `x` (the last matmul's output) normalized with the weight `post_norm`, as an
    # rms_norm_resid dispatch would write it; workgroup 0 also writes it to `stream_out`.
    adds_post_norm: bool = False
    # A prefill matmul's tokens a tile (PREFILL_TOKEN_TILE, or SHORT_PREFILL_TOKENS for short passes).
    token_tile: int = PREFILL_TOKEN_TILE
    # A prefill matmul on subgroup matrices (kernels.prefill_matmul_matrix: the tensor cores), f16 products
    # whatever dtype, for adapters with chromium-experimental-subgroup-matrix (model_glue.policy.pick_prefill_matrix).
    matrix: bool = False

    def __post_init__(self):
        if self.glu is not None and self.glu not in ACTIVATIONS:  # each is a branch of kernels.llama_common.gated
            raise ValueError(f"glu is one of {ACTIVATIONS} or None, not {self.glu!r}")
        if self.subgroup_lanes is not None and (self.tiled or self.subgroup_lanes not in MATMUL_SUBGROUP_LANES):
            raise ValueError(f"subgroup_lanes is one of {MATMUL_SUBGROUP_LANES} for a decode matmul, "
                             f"not {self.subgroup_lanes}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights is one of {WEIGHT_FORMATS}, not {self.weights}")
        if self.int8_x and (self.tiled or self.weights == "q8" or self.split_head_dim is not None):
            raise ValueError("int8_x is for a decode q4 or q8a matmul that reads x (the quantizer merges a split call)")
        if self.token_tile not in (PREFILL_TOKEN_TILE, SHORT_PREFILL_TOKENS) or (
                self.token_tile != PREFILL_TOKEN_TILE and not self.tiled):
            raise ValueError(f"token_tile is {PREFILL_TOKEN_TILE} or {SHORT_PREFILL_TOKENS} (a prefill matmul's), "
                             f"not {self.token_tile}")
        if self.matrix and (not self.tiled or self.weights == "q8" or self.out_dtype not in (None, self.dtype)):
            raise ValueError("matrix is for a q4 or q8a prefill matmul whose y is in its dtype")
        if self.quantizes_x and not (self.int8_x and self.norm_eps is not None and self.prologue_fits):
            raise ValueError("quantizes_x is for an int8_x matmul with the norm folded in whose x's codes fit "
                             f"{WORKGROUP_STORAGE_BYTES} bytes of workgroup memory beside its partials")
        if self.adds_post_norm and (self.tiled or self.norm_eps is None or self.int8_x or self.split_head_dim
                                    or self.rope_append or self.argmax_partials):
            raise ValueError("adds_post_norm is for a decode matmul on x in dtype with the norm folded in")
        if self.quantizes_y and (self.tiled or self.columns_per_group != 16 or self.rope_append or self.argmax_partials):
            raise ValueError("quantizes_y is for a decode matmul whose workgroup writes one chunk of 16 columns of y")

    @property
    def builder(self) -> str:
        if self.matrix:
            return "prefill_matmul_matrix"
        return "quantized_matmul_tiled" if self.tiled else "quantized_matmul"

    @property
    def buffers(self) -> tuple[str, ...]:
        outputs = ("positions", "slots", "pages", "q") if self.rope_append else ("y",)
        inputs = ("x",) if self.quantizes_x or not self.int8_x and not self.split_head_dim else \
            QUANTIZED_X if self.int8_x else SPLIT_WORKSPACE
        inputs += ("stream", "post_norm") * self.adds_post_norm
        outputs += ("stream_out",) * self.adds_post_norm
        # the quantizer applies the norm's weight, unless the matmul quantizes x itself
        norm = self.norm_eps is not None and (self.quantizes_x or not self.int8_x)
        return inputs + ("norm",) * norm + ("w", "scale") + ("wmin",) * (self.weights != "q8") \
            + ("resid",) * self.residual + outputs + ("best",) * self.argmax_partials + QUANTIZED_Y * self.quantizes_y

    @property
    def name(self) -> str:
        """The artifact name: every compile-time choice, nothing that is a runtime value."""
        folds = "".join(f"_{fold}" for fold, on in (
            ("norm", self.norm_eps is not None), (GLU_NAMES.get(self.glu), self.glu is not None), ("resid", self.residual),
            (f"rope_{rope_tag(self.rope_append.head_dim, self.rope_append.scaling)}" if self.rope_append else "",
             self.rope_append is not None),
            (f"merge_d{self.split_head_dim}", self.split_head_dim is not None), ("argmax", self.argmax_partials),
            ("postnorm", self.adds_post_norm)) if on)
        rows = "" if self.tiled else f"_r{self.rows_per_thread}"
        if self.tiled:
            rows = ("_smx" if self.matrix else "") + (f"_t{self.token_tile}" if self.token_tile != PREFILL_TOKEN_TILE else "")
        if self.compiled_rows is not None:
            rows = f"_n{self.compiled_rows}{rows}"
        out = f"_out{DTYPE_TAGS[self.out_dtype]}" if self.out_dtype not in (None, self.dtype) else ""
        subgroups = f"_sg{self.subgroup_lanes}" if self.subgroup_lanes else ""
        subgroups += ("_xi8" if self.int8_x else "") + ("_xq" if self.quantizes_x else "") + \
            ("_yi8" if self.quantizes_y else "")
        return (f"matmul_{'prefill' if self.tiled else 'decode'}_{self.weights}_k{self.in_features}{folds}{rows}"
                f"{subgroups}{out}_{DTYPE_TAGS[self.dtype]}")

    @property
    def compiled_rows(self) -> int | None:
        """W's rows where the kernel is compiled for them: the decode gated (`glu`) matmul, whose up rows
        start out_features / 2 rows on (a runtime offset there cost the 8B shape's decode step 1% on
        the H200: docs/benchmarks.md); None where out_features is a runtime value."""
        return self.out_features if self.glu is not None and not self.tiled else None

    @property
    def prologue_fits(self) -> bool:
        """Whether a quantizes_x prologue's codes and stats of x (a u32x4 and an f32x4 a chunk of 16) fit
        workgroup memory beside the lanes' partials (and their x^2 sums) and y's chunk (quantizes_y)."""
        codes = 32 * (self.in_features // 16)
        partials = 4 * (self.rows_per_thread * MATMUL_ROWS * 32 + 32)
        return codes + partials + 4 * self.columns_per_group <= WORKGROUP_STORAGE_BYTES

    @property
    def values(self) -> dict:
        """The kernel's runtime values for this matmul."""
        values = {} if self.compiled_rows is not None else {"out_features": self.out_features}
        if self.argmax_partials:  # the head: the whole vocabulary as one slice (contract.slices)
            values.update(vocab=self.out_features, row_base=0)
        if self.norm_eps is not None:
            values["eps"] = self.norm_eps
        return {**values, **(self.rope_append.values if self.rope_append else {})}

    def unsupported(self) -> str | None:
        """Why this matmul's sizes cannot run on its kernel, or None (the kernel's grid covers whole
        workgroups of columns, and the rows are whole quantization blocks)."""
        if self.matrix:  # its tiles guard their last columns
            columns = 1
        elif self.tiled:
            columns = PREFILL_TILE_ROWS // (1 if self.glu is None else 2)
        else:
            columns = self.columns_per_group
        width = self.out_features if self.glu is None else self.out_features // 2
        if width % columns or self.in_features % 32:
            return (f"a {self.out_features} x {self.in_features} matmul needs rows in multiples of {columns} "
                    "and columns in multiples of 32")
        return None

    @property
    def rows_per_thread(self) -> int:
        """Weight rows per thread of the decode matmul: each loaded x (and norm weight) serves this
        many, but more rows a thread leave fewer workgroups to fill the GPU. With `glu` a thread
        takes the gate and the up row of each of its columns, so at least two. The thresholds below
        were measured on the H200 (docs/benchmarks.md, "rows a thread")."""
        def leaves(rows: int, minimum: int) -> bool:  # rows a thread leave at least `minimum` workgroups
            columns = MATMUL_ROWS * rows // (1 if self.glu is None else 2)
            width = self.out_features if self.glu is None else self.out_features // 2
            return width % columns == 0 and width // columns >= minimum

        if leaves(4, QUAD_MIN_WORKGROUPS):
            return 4
        return 2 if self.glu is not None or leaves(2, PAIRED_MIN_WORKGROUPS) else 1

    @property
    def columns_per_group(self) -> int:
        """Output columns (of y) one decode workgroup computes."""
        return MATMUL_ROWS * self.rows_per_thread // (1 if self.glu is None else 2)

    @property
    def workgroups(self) -> int:
        """Decode workgroups: one per columns_per_group columns of y."""
        return (self.out_features if self.glu is None else self.out_features // 2) // self.columns_per_group

    @property
    def args(self) -> tuple:
        return (self,)


@dataclass(frozen=True)
class KernelRole:
    """A model kernel other than a matmul: its builder in kernels/, the builder's (compile-time)
    arguments, the buffer names the runtime binds, its artifact name and its runtime values."""

    builder: str
    args: tuple
    buffers: tuple[str, ...]
    name: str
    values: dict = field(default_factory=dict, hash=False, compare=False)

    def unsupported(self) -> str | None:
        return None


# The layer's matmuls, each with what is folded into it (LAYER_MATMULS[m] gives the weight matrix it
# reads). On GPUs a decode step's layer is norm_qkv_rope_append, attention, o_residual,
# norm_gate_up_swiglu and down_residual (a prefill pass: norm_qkv, then rope_append); CPU rasterizers
# run rms_norm, qkv, rope_append, ..., rms_norm, gate_up, swiglu, down_residual.
class Matmul(StrEnum):
    """A layer's matmul, named by what is folded into it; its kernels' roles are `matmul_role`'s."""

    NORM_QKV = "norm_qkv"  # qkv = norm(x) @ Wqkv^T
    QKV = "qkv"
    O_RESIDUAL = "o_residual"  # x_mid = x + attn @ Wo^T
    O = "o"  # attn @ Wo^T, for a post-norm before the residual add (contract.family.Family.post_norms)
    NORM_GATE_UP_SWIGLU = "norm_gate_up_swiglu"  # h = silu(norm(x_mid) @ Wg^T) * (norm(x_mid) @ Wu^T)
    GATE_UP = "gate_up"
    DOWN_RESIDUAL = "down_residual"  # x = x_mid + h @ Wdown^T
    DOWN = "down"  # h @ Wdown^T, likewise
    # decode builds only: GPUs' qkv with RoPE and the K/V append as its epilogue; the o-projection that
    # merges a split attention call's partial states
    NORM_QKV_ROPE_APPEND = "norm_qkv_rope_append"
    O_RESIDUAL_MERGE = "o_residual_merge"
    O_MERGE = "o_merge"  # ... without the residual, for a post-norm family (Family.post_norms)
    # a post-norm family's decode step: x = stream + post_norm(last output), then the normed matmul
    # (MatmulSpec.adds_post_norm: the rms_norm_resid dispatch before it folded in)
    POST_NORM_QKV = "post_norm_qkv"
    POST_NORM_GATE_UP_SWIGLU = "post_norm_gate_up_swiglu"


class Role(StrEnum):
    """A forward-pass kernel other than a layer's matmul, as `llama_kernels` and LlamaModel.kernels key it."""

    EMBED = "embed"
    RMS_NORM = "rms_norm"
    NORM_RESIDUAL = "norm_residual"  # x + norm(y): a post-norm and its residual add (Family.post_norms)
    ROPE_APPEND = "rope_append"
    SWIGLU = "swiglu"
    NORM_LM_HEAD = "norm_lm_head"  # the head with the final norm folded in
    LM_HEAD = "lm_head"
    ARGMAX = "argmax"
    SAMPLE = "sample"
    # the int8_x decode step's quantizers (kernels.quantize_x): x times a norm's weight, attention's
    # output, the split call's partial states merged, the SwiGLU output
    QUANTIZE_NORM = "quantize_norm_decode"
    QUANTIZE_ATTN = "quantize_attn_decode"
    QUANTIZE_MERGE = "quantize_merge_decode"
    QUANTIZE_FFN = "quantize_ffn_decode"


@dataclass(frozen=True)
class MatmulFolds:
    """What a layer matmul's build folds in, as data (the spec is made from it, never from the name)."""

    norm: bool = False  # the RMSNorm before it (MatmulSpec.norm_eps)
    residual: bool = False  # the residual add after it (MatmulSpec.residual)
    gated: bool = False  # the gated FFN's activation after it (MatmulSpec.glu, the family's activation)


MATMUL_FOLDS = {Matmul.NORM_QKV: MatmulFolds(norm=True), Matmul.QKV: MatmulFolds(),
                Matmul.O_RESIDUAL: MatmulFolds(residual=True), Matmul.O: MatmulFolds(),
                Matmul.NORM_GATE_UP_SWIGLU: MatmulFolds(norm=True, gated=True), Matmul.GATE_UP: MatmulFolds(),
                Matmul.DOWN_RESIDUAL: MatmulFolds(residual=True), Matmul.DOWN: MatmulFolds()}

# The weight matrix each layer matmul reads (its .q4, .scale and .min tensors)
LAYER_MATMULS = {Matmul.NORM_QKV: "qkv", Matmul.QKV: "qkv", Matmul.O_RESIDUAL: "o", Matmul.NORM_GATE_UP_SWIGLU: "gate_up",
                 Matmul.GATE_UP: "gate_up", Matmul.DOWN_RESIDUAL: "down"}


def layer_matmuls(arch: Family) -> dict[Matmul, str]:
    """A family's layer matmuls (each -> the weight matrix it reads): LAYER_MATMULS, with o and down
    without the residual where a post-norm sits between them and the add."""
    if arch.residual_in_matmul:
        return LAYER_MATMULS
    plain = {Matmul.O_RESIDUAL: Matmul.O, Matmul.DOWN_RESIDUAL: Matmul.DOWN}
    return {plain.get(m, m): weight for m, weight in LAYER_MATMULS.items()}


def folded_matmuls(arch: Family, fold_norms: bool) -> list[Matmul]:
    """The four matmuls of a layer's pass: with the norms and the gate's activation folded in (GPUs) or apart."""
    o, down = (Matmul.O_RESIDUAL, Matmul.DOWN_RESIDUAL) if arch.residual_in_matmul else (Matmul.O, Matmul.DOWN)
    if fold_norms:
        return [Matmul.NORM_QKV, o, Matmul.NORM_GATE_UP_SWIGLU, down]
    return [Matmul.QKV, o, Matmul.GATE_UP, down]


# A post-norm family's normed decode matmuls -> their builds that also make x from the residual
# stream and the last matmul's output (MatmulSpec.adds_post_norm)
POST_NORM_MATMULS = {Matmul.NORM_QKV: Matmul.POST_NORM_QKV, Matmul.NORM_GATE_UP_SWIGLU: Matmul.POST_NORM_GATE_UP_SWIGLU}

# The decode step's q4 matmuls that have an int8_x form (MatmulSpec.int8_x: x read as int8 codes), and
# the quantizer dispatch before each (kernels.quantize_x).
INT8_X_SUFFIX = "_xi8"
INT8_X_MATMULS = {Matmul.NORM_QKV_ROPE_APPEND: Role.QUANTIZE_NORM, Matmul.O_RESIDUAL: Role.QUANTIZE_ATTN,
                  Matmul.NORM_GATE_UP_SWIGLU: Role.QUANTIZE_NORM, Matmul.DOWN_RESIDUAL: Role.QUANTIZE_FFN}
# ... those whose x is normed, which may quantize it in their prologue instead (MatmulSpec.quantizes_x)
NORMED_INT8_X_MATMULS = (Matmul.NORM_QKV_ROPE_APPEND, Matmul.NORM_GATE_UP_SWIGLU)


def matmul_role(matmul: Matmul, *, prefill: bool = False, short: bool = False, matrix: bool = False,
                int8_x: bool = False) -> str:
    """The role of one build of a layer matmul: the decode or the prefill pass's, its short token tile
    (`short`), its subgroup-matrix build (`matrix`), its int8_x form: the one place such a name is made."""
    return (f"{matmul}_{'prefill' if prefill else 'decode'}{SHORT_SUFFIX * short}{MATRIX_SUFFIX * matrix}"
            f"{INT8_X_SUFFIX * int8_x}")


def llama_kernels(c: LlamaConfig, dtype: str, subgroup_lanes: int | None = None,
                  int8_x: bool = False, prefill_matrix: bool = False) -> dict[str, MatmulSpec | KernelRole]:
    """role -> spec of every kernel of a model's forward pass, decode attention apart: the runtime
    finds each as `spec.name` in the artifact and dispatches it with `spec.values`. The decode
    matmuls (the head's included) are the builds for `subgroup_lanes` (MatmulSpec.subgroup_lanes);
    with `int8_x` each of INT8_X_MATMULS also has its int8_x form (role + INT8_X_SUFFIX) and the
    quantizers are roles too (a split call's merge then runs in `Role.QUANTIZE_MERGE`); where the
    gate/up matmul's workgroups write one 16-value chunk of y each, its epilogue quantizes y for down
    (MatmulSpec.quantizes_y: no quantizer before down); where x's codes fit workgroup memory, the
    normed ones (qkv, gate/up) quantize their x in their prologues (MatmulSpec.quantizes_x). With
    `prefill_matrix` (`has_matrix_builds`) the folded prefill matmuls also have their subgroup-matrix builds (role +
    MATRIX_SUFFIX, `matrix_roles`)."""
    roles = _llama_kernels(c, dtype)
    if prefill_matrix:
        roles.update(matrix_roles(roles, c.arch))
    if subgroup_lanes is not None:
        roles = {role: replace(spec, subgroup_lanes=subgroup_lanes) if isinstance(spec, MatmulSpec) and not spec.tiled
                 else spec for role, spec in roles.items()}
    if not int8_x:
        return roles
    if not has_int8_x_form(c.arch):
        raise ValueError(f"the {c.family} family's decode matmuls have no int8_x form")
    int8_roles = {matmul_role(m, int8_x=True): replace(roles[matmul_role(m)], int8_x=True) for m in INT8_X_MATMULS}
    gate_up = matmul_role(Matmul.NORM_GATE_UP_SWIGLU, int8_x=True)
    if int8_roles[gate_up].columns_per_group == 16:  # a workgroup's columns are one chunk: it quantizes y for down
        int8_roles[gate_up] = replace(int8_roles[gate_up], quantizes_y=True)
    normed = [matmul_role(m, int8_x=True) for m in NORMED_INT8_X_MATMULS]
    if all(int8_roles[role].prologue_fits for role in normed):  # x's codes made in their prologues: no quantizer
        int8_roles.update({role: replace(int8_roles[role], quantizes_x=True) for role in normed})
    return {**roles, **int8_roles, **quantizer_roles(c, dtype)}


def has_int8_x_form(arch: Family) -> bool:
    """Whether a family's decode step has the int8_x matmuls: they are llama's layer (the fused
    RoPE epilogue, the residual in o and down)."""
    return arch.fused_rope_append and arch.residual_in_matmul


def quantizer_roles(c: LlamaConfig, dtype: str) -> dict[str, KernelRole]:
    """The quantize_x dispatches of an int8_x decode step: x times a norm's weight (qkv, gate/up),
    attention's output or the merge of its split call (o), the SwiGLU output (down). Compiled for
    the dtype (and a merge's head_dim); the width is a runtime value."""
    tag, width = DTYPE_TAGS[dtype], c.n_heads * c.head_dim
    plain = ("quantize_x", (dtype, False), ("x",) + QUANTIZED_X, f"quantize_x_{tag}")
    return {
        Role.QUANTIZE_NORM: KernelRole("quantize_x", (dtype, True), ("x", "norm") + QUANTIZED_X,
                                           f"quantize_x_norm_{tag}", {"n": 1, "vecs": c.dim // 4}),
        Role.QUANTIZE_ATTN: KernelRole(*plain, {"n": 1, "vecs": width // 4}),
        Role.QUANTIZE_FFN: KernelRole(*plain, {"n": 1, "vecs": c.ffn_dim // 4}),
        Role.QUANTIZE_MERGE: KernelRole("quantize_x", (dtype, False, c.head_dim), SPLIT_WORKSPACE + QUANTIZED_X,
                                            f"quantize_x_merge_d{c.head_dim}_{tag}",
                                            {"n": 1, "vecs": width // 4, "heads": c.n_heads}),
    }


def matmul_subgroup_lanes(specs: dict) -> int | None:
    """The subgroup build (MatmulSpec.subgroup_lanes) of a llama_kernels dict's decode matmuls."""
    return specs[matmul_role(Matmul.NORM_GATE_UP_SWIGLU)].subgroup_lanes


@dataclass(frozen=True)
class Int8XForm:
    """Where an int8_x decode step (MatmulSpec.int8_x) gets each matmul's codes of x, as its loaded
    builds say: a quantizer dispatch before the matmul (INT8_X_MATMULS), unless a build makes them."""

    normed_x_in_prologue: bool  # qkv's and gate/up's prologues quantize their normed x (MatmulSpec.quantizes_x)
    down_codes_from_gate_up: bool  # gate/up's epilogue writes down's codes (MatmulSpec.quantizes_y)

    def quantizes_own_x(self, matmul: Matmul) -> bool:
        """Whether the matmul's build makes its own codes of x (no quantizer before it)."""
        return self.normed_x_in_prologue and matmul in NORMED_INT8_X_MATMULS

    def quantizers(self) -> list[str]:
        """The quantizer roles the step dispatches (a split call's merge one included)."""
        return sorted({INT8_X_MATMULS[m] for m in INT8_X_MATMULS if not self.quantizes_own_x(m)}) + [Role.QUANTIZE_MERGE]


def int8_x_form(specs: dict) -> Int8XForm | None:
    """The int8_x form of a llama_kernels dict's decode matmuls, or None where they read x as floats."""
    gate_up = specs.get(matmul_role(Matmul.NORM_GATE_UP_SWIGLU, int8_x=True))
    return None if gate_up is None else Int8XForm(gate_up.quantizes_x, gate_up.quantizes_y)


def prefill_matrix(specs: dict) -> bool:
    """Whether a llama_kernels dict has the prefill matmuls' subgroup-matrix builds (MatmulSpec.matrix)."""
    return matmul_role(Matmul.NORM_GATE_UP_SWIGLU, prefill=True, matrix=True) in specs


def _llama_kernels(c: LlamaConfig, dtype: str) -> dict[str, MatmulSpec | KernelRole]:
    weights = layer_matrices(c)
    tag = DTYPE_TAGS[dtype]
    head = head_spec(c, dtype)
    embed = matrix_format(c, "embed")
    arch = c.arch
    glu_name = GLU_NAMES[arch.ffn_activation]
    roles = {
        Role.EMBED: KernelRole("embedding_q8", (c.dim, dtype, embed), ("ids", "w", "scale") + ("wmin",) * (embed == "q8a")
                               + ("out",), f"embed_{embed}_d{c.dim}_{tag}", {"vocab": c.vocab_size,
                                                                             "embed_scale": embed_scale(c),
                                                                             "row_base": 0}),
        Role.RMS_NORM: KernelRole("rms_norm", (c.dim, dtype), ("x", "weight", "out"), f"rms_norm_d{c.dim}_{tag}",
                               {"eps": c.rms_eps}),
        Role.ROPE_APPEND: rope_append_role(c, dtype),
        Role.SWIGLU: KernelRole("swiglu", (dtype, arch.ffn_activation), ("gate_up", "h"), f"{glu_name}_{tag}",
                                {"ffn_dim": c.ffn_dim}),
        # the head: the tied embedding (q8), f32 logits for the sampler and each workgroup's best
        # (value, index) for the argmax
        Role.NORM_LM_HEAD: head,
        Role.LM_HEAD: head_spec(c, dtype, folded=False),
        Role.ARGMAX: KernelRole("argmax_partials", (), ("best", "out"), "argmax_partials",
                             {"groups": head.workgroups, "vocab": c.vocab_size}),
        Role.SAMPLE: KernelRole("sample_top_k_top_p", (MAX_TOP_K,), ("logits", "out"), f"sample_top_k{MAX_TOP_K}",
                             {"vocab": c.vocab_size}),
    }
    if arch.post_norms:
        roles[Role.NORM_RESIDUAL] = KernelRole("rms_norm", (c.dim, dtype, True), ("x", "weight", "resid", "out"),
                                               f"rms_norm_resid_d{c.dim}_{tag}", {"eps": c.rms_eps})
    # GPUs' decode step: the qkv matmul with the norm folded in and RoPE + the K/V append as its epilogue
    if arch.fused_rope_append:
        roles[matmul_role(Matmul.NORM_QKV_ROPE_APPEND)] = MatmulSpec(
            *weights["qkv"], dtype, matrix_format(c, "qkv"), norm_eps=c.rms_eps,
            rope_append=RopeAppend(c.n_heads, c.n_kv_heads, c.head_dim, c.rope_theta, c.rope_scaling))
    # after a split attention call (where `o_merges_splits`): the o-projection merges the partial states
    if o_merges_splits(c, dtype, 2):  # S = 2 reads least: a shape that does not merge then never does
        roles[matmul_role(o_merge_matmul(arch))] = o_merge_spec(c, dtype)
    matmuls = layer_matmuls(arch)
    for prefill in (False, True):
        for matmul, weight in matmuls.items():
            folds = MATMUL_FOLDS[matmul]
            roles[matmul_role(matmul, prefill=prefill)] = MatmulSpec(
                *weights[weight], dtype, matrix_format(c, weight), residual=folds.residual,
                norm_eps=c.rms_eps if folds.norm else None, glu=arch.ffn_activation if folds.gated else None,
                tiled=prefill)
        if prefill:
            for matmul in matmuls:
                roles[matmul_role(matmul, prefill=True, short=True)] = replace(
                    roles[matmul_role(matmul, prefill=True)], token_tile=SHORT_PREFILL_TOKENS)
    if arch.post_norms:  # GPUs' decode step: the post-norm and residual add before qkv and gate/up folded in
        for matmul, folded in POST_NORM_MATMULS.items():
            roles[matmul_role(folded)] = replace(roles[matmul_role(matmul)], adds_post_norm=True)
    return roles


def has_matrix_builds(c: LlamaConfig, dtype: str) -> bool:
    """Whether a model's prefill has subgroup-matrix builds in `dtype`: in f16, and in f32 for a family that
    runs only in f32 (f16 products all the same); an f16-capable family runs f32 only without shader-f16."""
    return dtype == "float16" or not c.arch.f16_activations


def matrix_roles(roles: dict, arch: Family) -> dict[str, MatmulSpec]:
    """The subgroup-matrix builds of a llama_kernels dict's prefill matmuls, long and short tiles."""
    return {matmul_role(matmul, prefill=True, short=short, matrix=True):
            replace(roles[matmul_role(matmul, prefill=True, short=short)], matrix=True)
            for matmul in folded_matmuls(arch, True) for short in (False, True)}


def rope_append_role(c: LlamaConfig, dtype: str) -> KernelRole:
    """RoPE and the K/V append of a qkv row: llama's adjacent pairs (kernels.layer_ops.rope_and_append),
    or a head at a time with the family's bias, QK-norm and pairing (rope_heads_and_append). The RoPE
    base in the values is the global layers'; a sliding-window layer's comes with its dispatch."""
    arch, tag, scaled = c.arch, DTYPE_TAGS[dtype], c.rope_scaling is not None
    rope = rope_values(c.n_heads, c.n_kv_heads, c.head_dim, c.rope_theta, c.rope_scaling)
    io = ("positions", "slots", "pages", "q")
    if arch.fused_rope_append:
        return KernelRole("rope_and_append", (c.head_dim, dtype, scaled), ("qkv",) + io,
                          f"rope_append_{rope_tag(c.head_dim, c.rope_scaling)}_{tag}", rope)
    variant = f"{'_halves' * (arch.rope_pairs == 'halves')}{'_qknorm' * arch.qk_norm}{'_bias' * arch.qkv_bias}"
    return KernelRole("rope_heads_and_append", (c.head_dim, dtype, scaled, arch.rope_pairs, arch.qk_norm, arch.qkv_bias),
                      ("qkv",) + ("qkv_bias",) * arch.qkv_bias + ("q_norm", "k_norm") * arch.qk_norm + io,
                      f"rope_append_{rope_tag(c.head_dim, c.rope_scaling)}{variant}_{tag}",
                      {**rope, **({"eps": c.rms_eps} if arch.qk_norm else {})})


@lru_cache(maxsize=64)  # asked a few times every decode step (LlamaModel.o_merges): the answer never changes
def o_merges_splits(c: LlamaConfig, dtype: str, num_splits: int) -> bool:
    """Whether a decode step whose attention is split `num_splits` ways merges the partial states in
    the o-projection (o_residual_merge_decode) rather than in a merge dispatch: every o workgroup
    reads all of them (heads x S x head_dim f32), so only while that stays small beside a dispatch,
    and each of its threads merges at most one chunk of x (O_MERGE_MAX_X)."""
    spec = o_merge_spec(c, dtype)
    read = spec.workgroups * c.n_heads * num_splits * c.head_dim * 4
    return num_splits > 1 and spec.in_features <= O_MERGE_MAX_X and read <= O_MERGE_MAX_READ


def o_merge_matmul(arch: Family) -> Matmul:
    """The family's decode o-projection that merges a split call: with the residual, or before a post-norm."""
    return Matmul.O_RESIDUAL_MERGE if arch.residual_in_matmul else Matmul.O_MERGE


def o_merge_spec(c: LlamaConfig, dtype: str) -> MatmulSpec:
    """The decode o-projection (+ residual, where the family adds it there) that merges a split
    attention call's partial states."""
    return MatmulSpec(c.dim, c.n_heads * c.head_dim, dtype, matrix_format(c, "o"), residual=c.arch.residual_in_matmul,
                      split_head_dim=c.head_dim)


def head_spec(c: LlamaConfig, dtype: str, folded: bool = True) -> MatmulSpec:
    """The head (the final RMSNorm folded in on GPUs): q8 (q8a for a wide embedding), f32 logits and
    the argmax's partials."""
    return MatmulSpec(c.vocab_size, c.dim, dtype, matrix_format(c, "head"), norm_eps=c.rms_eps if folded else None, out_dtype="float32",
                      argmax_partials=True)
