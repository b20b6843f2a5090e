"""The artifacts' formats and files, and the manifest entry of one kernel (`KernelSpec`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

MANIFEST = "manifest.json"
KERNEL_ARTIFACT_FORMAT = 3  # 2: typed KernelSpec entries, roles checked at build; 3: `features`
# 2: the manifest names its config; 3: and the weights file's sha256 (the page's cache key);
# 4: the config holds only the compiled shape, the model's context length is `context_length`
MODEL_ARTIFACT_FORMAT = 4
MODEL_ARTIFACT_KIND = "llama-q4"  # Q4_1 matrices, Q8_0 tied embedding (convert/weights.py documents the packing)
WEIGHTS_FILE = "weights.bin"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# A GGUF converted through the runtime (`python -m app convert --gguf FILE`): its tokenizer.* metadata as
# JSON, which model_glue.formats.gguf_tokenizer reads as it reads the file's; the manifest's "tokenizer" names
# it. Without that field an artifact has HF's tokenizer.json (the served SmolLM2).
GGUF_TOKENIZER_FILE = "gguf_tokenizer.json"


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
      + - * // % >> << min max (model_glue.gpu.kernel.evaluate).
    - `workgroup_storage_bytes` and `barriers`: counted in the WGSL; the runtime checks limits.
    - `features`: the WebGPU features its WGSL enables (`shader-f16`, `subgroups`).
    - `meta`: what the kernel is for (kind, role, shape, dtype...); `defect`, when present, says
      why the host must not run it (see model_glue.model.attention.tiled_defect).
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
