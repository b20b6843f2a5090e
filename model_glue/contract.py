"""The build/run contract: every fact the build (kernels/, convert/) and the runtime must agree on.

Standard library only: the page (Pyodide) and a GPU machine without TVM import it. The build
imports it to make the artifact; the runtime imports it to read the artifact. Nothing here is
computed from TVM: change a fact here, rebuild (`make`), and both sides follow.

What lives here:
- the paged KV layout (PAGE_SIZE) and the decode nests' names;
- the artifacts' format versions and kinds;
- the Llama-shaped model configs the artifact has kernels for, and the attention shapes derived
  from them (plus the ones tests and benchmarks use);
- kernel roles: which builder makes a model's kernel and the buffer names the runtime binds (they
  are the TVMScript parameter names; the build checks that each kernel declares exactly these);
- the WebGPU limits the artifact's kernels are built within;
- the manifest entry of one kernel (`KernelSpec`), the schema both sides read and write.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# -- paged KV cache and decode attention -------------------------------------------------------------
PAGE_SIZE = 16  # tokens per KV page: pages[num_pages, 2 (K, V), H_kv, PAGE_SIZE, head_dim]
NESTS = ("tiled", "sharded")
NEST_CHOICES = ("auto",) + NESTS  # 'auto' lets pick_decode_nest choose
# The sharded family's variants (model_glue.attention picks one per step):
#   "shards"        the seed's layout (shards own whole K/V rows), one query head per workgroup
#   "shards_group"  the same with a whole GQA group per workgroup (where the group fits)
#   "subgroup"      K/V rows across subgroups, head dims across a subgroup's lanes, a GQA group per
#                   workgroup (adapters with the `subgroups` feature)
# Each runs over the whole context in one dispatch (S = 1: it writes output and lse itself), or cut
# into S splits (its `split` kernel writes SPLIT_WORKSPACE) followed by the merge kernel.
SHARDED_VARIANTS = ("shards", "shards_group", "subgroup")
MAX_SPLITS = 128  # the most splits the host picks (the workspace is sized for it)

# -- artifacts -------------------------------------------------------------------------------------
MANIFEST = "manifest.json"
KERNEL_ARTIFACT_FORMAT = 3  # 2: typed KernelSpec entries, roles checked at build; 3: `features`
MODEL_ARTIFACT_FORMAT = 3  # 2: the manifest names its config; 3: and the weights file's sha256 (the page's cache key)
MODEL_ARTIFACT_KIND = "llama-q4"  # Q4_1 matrices, Q8_0 tied embedding (convert/gguf.py documents the packing)
WEIGHTS_FILE = "weights.bin"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

DTYPES = ("float16", "float32")
DTYPE_TAGS = {"float16": "f16", "float32": "f32"}
DTYPE_BYTES = {"float16": 2, "float32": 4}

# -- WebGPU limits the kernels are built within ----------------------------------------------------
MAX_INVOCATIONS = 256  # WebGPU's default maxComputeInvocationsPerWorkgroup
WORKGROUP_STORAGE_BYTES = 16384  # WebGPU's default maxComputeWorkgroupStorageSize: our kernels' bound
# TVM's tiled decode kernel in f32 with GQA group 1 needs ~17.5 KiB; every adapter we target offers
# 32 KiB, and the runtime checks each kernel's actual need against the adapter at load.
TILED_WORKGROUP_STORAGE_BYTES = 32768


# -- model configs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionShape:
    num_kv_heads: int
    num_qo_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    max_context: int = 8192
    bos_id: int = 1
    eos_id: int = 2

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.n_kv_heads, self.n_heads, self.head_dim)

    def kernel_shape(self) -> tuple:
        """What the kernels are compiled for (max_context and token ids are not)."""
        return (self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_dim,
                self.vocab_size, self.rope_theta, self.rms_eps)


MODEL_CONFIGS = {
    # SmolLM2-135M-Instruct, the model the page serves (converted from its GGUF).
    "smollm2_135m": LlamaConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
                                vocab_size=49152, rope_theta=100000.0, rms_eps=1e-5),
    # A tiny random-weight model for fast native tests, built by the same code paths.
    "tiny_llama": LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                              vocab_size=512, rope_theta=10000.0, rms_eps=1e-5),
    # Random weights behind SmolLM2's tokenizer (its vocab): lets the browser tests drive the whole
    # chat page on SwiftShader, where SmolLM2 itself takes minutes per reply.
    "tiny_chat": LlamaConfig(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=64, ffn_dim=256,
                             vocab_size=49152, rope_theta=100000.0, rms_eps=1e-5),
}

# Decode attention shapes the artifact holds kernels for, besides the models' own.
# Benchmarks: D=64 8/32, D=128 8/32 (Llama-3.1-8B), D=256 4/8.
BENCH_SHAPES = [AttentionShape(8, 32, 64), AttentionShape(8, 32, 128), AttentionShape(4, 8, 256)]
# Tests: every head_dim with every GQA group 1-8 (one KV head keeps lavapipe fast; group 1 with two).
# TVM's tiled kernel is wrong at head_dim 256 with groups 5 and 7; the build marks it (see
# kernels.decode_attention.tiled_query_heads_computed) and the host never runs it.
TEST_SHAPES = [AttentionShape(2 if group == 1 else 1, (2 if group == 1 else 1) * group, d)
               for d in (64, 128, 256) for group in range(1, 9)]
WINDOW_SHAPES = [AttentionShape(1, 4, d) for d in (64, 128, 256)]  # sliding-window tests, group 4
MODEL_SHAPES = [config.attention_shape for config in MODEL_CONFIGS.values()]


# -- kernel names and roles ------------------------------------------------------------------------------
def subgroup_tag(row_lanes: int, subgroup_size: int | None = None) -> str:
    """A subgroup-layout build's name tag: its lanes per K/V row, and the exact subgroup size it
    is built for, if any (kernels.decode_attention_subgroup)."""
    return f"l{row_lanes}" + (f"s{subgroup_size}" if subgroup_size else "")


def attention_kernel_name(variant: str, shape: AttentionShape, dtype: str, sliding_window: bool = False,
                          split: bool = False, tag: str | None = None) -> str:
    """The name encodes every compile-time parameter of a decode attention kernel: "tiled" or a
    sharded-family variant (with its build's `tag`, e.g. the subgroup layout's `subgroup_tag`), over
    the whole context or (`split`) one split of it."""
    return (f"decode_{variant}{'_' + tag if tag else ''}{'_split' if split else ''}_d{shape.head_dim}"
            f"_kv{shape.num_kv_heads}_qo{shape.num_qo_heads}_{DTYPE_TAGS[dtype]}{'_sw' if sliding_window else ''}")


def merge_kernel_name(shape: AttentionShape, dtype: str) -> str:
    """The kernel that merges the S partial states of any split variant of a shape."""
    return f"decode_merge_d{shape.head_dim}_qo{shape.num_qo_heads}_{DTYPE_TAGS[dtype]}"


def prefill_attention_kernel_name(shape: AttentionShape, dtype: str) -> str:
    """The causal paged prefill attention kernel of a shape (kernels.prefill_attention)."""
    return f"prefill_attention_d{shape.head_dim}_kv{shape.num_kv_heads}_qo{shape.num_qo_heads}_{DTYPE_TAGS[dtype]}"


def model_kernel_name(config_name: str, role: str, dtype: str) -> str:
    return f"{config_name}_{role}_{DTYPE_TAGS[dtype]}"


# The buffers of TVM's batch_decode_paged_kv signature, which both decode nests share.
ATTENTION_INPUTS = ("Q", "pages", "page_table_indptr", "page_table_values", "length_info",
                    "k_rope_pos_offset", "q_rope_position")
ATTENTION_OUTPUTS = ("output", "lse")
ATTENTION_BUFFERS = ATTENTION_INPUTS + ATTENTION_OUTPUTS
# A split kernel's outputs (instead of output and lse): per (sequence, query head, split) the split's
# O (not yet divided) and (max, denominator) in the log2 domain, dense for the call's S:
# [B, H_qo, S, D] and [B, H_qo, S, 2], f32. The merge kernel reads them.
SPLIT_WORKSPACE = ("partial_o", "partial_stats")

# The prefill attention kernel's buffers: one sequence's new queries, the layer's pages, the
# sequence's page ids in order, and the output; scalars `start` (tokens cached before the chunk), sm_scale.
PREFILL_ATTENTION_BUFFERS = ("q", "pages", "page_ids", "output")

_MATMUL = ("x", "w", "scale", "wmin", "y")
_NORM_MATMUL = ("x", "norm", "w", "scale", "wmin", "y")  # RMSNorm folded in (`norm`: its weight)
_MATMUL_RESIDUAL = ("x", "w", "scale", "wmin", "resid", "y")


@dataclass(frozen=True)
class KernelRole:
    """One kernel of the forward pass: the builder in kernels/ that makes it and the buffer names
    the runtime binds, which are the kernel's TVMScript parameter names."""

    builder: str
    buffers: tuple[str, ...]


# The layer's matmuls, each with what is folded into it (LAYER_MATMULS[m] gives the weight matrix it
# reads). On GPUs a layer is norm_qkv, RoPE/append, attention, o_residual, norm_gate_up_swiglu and
# down_residual; CPU rasterizers run rms_norm, qkv, ..., rms_norm, gate_up, swiglu, down_residual.
LAYER_MATMULS = {
    "norm_qkv": "qkv",  # qkv = norm(x) @ Wqkv^T
    "qkv": "qkv",
    "o_residual": "o",  # x_mid = x + attn @ Wo^T
    "norm_gate_up_swiglu": "gate_up",  # h = silu(norm(x_mid) @ Wg^T) * (norm(x_mid) @ Wu^T)
    "gate_up": "gate_up",
    "down_residual": "down",  # x = x_mid + h @ Wdown^T
}
LLAMA_ROLES = {
    "embed": KernelRole("embedding_q8", ("ids", "q8", "scale", "out")),
    "rms_norm": KernelRole("rms_norm", ("x", "weight", "out")),
    "rope_append": KernelRole("rope_and_append", ("qkv", "positions", "slots", "pages", "q")),
    "swiglu": KernelRole("swiglu", ("gate_up", "h")),
    "norm_lm_head": KernelRole("quantized_matmul", ("x", "norm", "w", "scale", "y")),  # q8, tied embedding
    "lm_head": KernelRole("quantized_matmul", ("x", "w", "scale", "y")),
    "argmax": KernelRole("argmax", ("logits", "out")),
    "sample": KernelRole("sample_top_k_top_p", ("logits", "out")),  # top-k, top-p, temperature
    # decode: one token per pass (kernels.llama.quantized_matmul); prefill: tiles of tokens x weight
    # rows (kernels.prefill_matmul), the same buffers
    **{f"{matmul}_{phase}": KernelRole(builder, _MATMUL_RESIDUAL if matmul.endswith("_residual") else
                                       _NORM_MATMUL if matmul.startswith("norm_") else _MATMUL)
       for phase, builder in (("decode", "quantized_matmul"), ("prefill", "quantized_matmul_tiled"))
       for matmul in LAYER_MATMULS},
}
MAX_TOP_K = 64  # the sampler's candidate limit (its rounds each scan the whole vocabulary)


# -- the kernel manifest -------------------------------------------------------------------------------------
@dataclass
class BufferSpec:
    """One storage binding, in binding order."""

    binding: int
    name: str  # the TVMScript buffer name: what the runtime binds by
    access: str  # "read" or "read_write"
    dtype: str  # element dtype in TIR
    wgsl_type: str  # element type as the WGSL declares it (e.g. "vec4<f16>")
    shape: list  # expression trees (see `grid`)


@dataclass
class KernelSpec:
    """The manifest entry of one kernel (`manifest.json` -> kernels -> name).

    - `entry`: the WGSL entry point; `wgsl`: its file, relative to the manifest.
    - `buffers`: storage bindings 0..n-1; then one uniform struct at binding n: the `pod` fields
      (4 bytes each, types i32/u32/f32, in order) followed by `packGridDimX: u32`.
    - `workgroup_size`: [x, y, z]; `grid`: [x, y] workgroups (z = 1), each an expression tree
      over the kernel's scalars and shape variables: an int, a name, or [op, lhs, rhs] with op in
      + - * // % >> << min max (model_glue.kernel.evaluate).
    - `workgroup_storage_bytes` and `barriers`: counted in the WGSL; the runtime checks limits.
    - `features`: the WebGPU features its WGSL enables (`shader-f16`, `subgroups`).
    - `meta`: what the kernel is for (kind, role, shape, dtype...); `defect`, when present, says
      why the host must not run it (see model_glue.attention.tiled_defect).
    """

    name: str
    entry: str
    wgsl: str
    buffers: list[BufferSpec]
    pod: list[dict]  # [{"name": ..., "type": "i32" | "u32" | "f32"}]
    workgroup_size: list[int]
    grid: list
    workgroup_storage_bytes: int
    barriers: int
    meta: dict = field(default_factory=dict)
    compile_seconds: float = 0.0
    features: list[str] = field(default_factory=list)

    @property
    def buffer_names(self) -> list[str]:
        return [b.name for b in self.buffers]

    @property
    def invocations(self) -> int:
        x, y, z = self.workgroup_size
        return x * y * z

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "KernelSpec":
        return cls(**{**d, "buffers": [BufferSpec(**b) for b in d["buffers"]]})
