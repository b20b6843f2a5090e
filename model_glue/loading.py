"""A model's weights onto the GPU, for each source (model_glue.sources.open_model calls them).

`load_model` (a converted artifact: the manifest and its checks, each tensor's sha256),
`load_gguf_model` (a user's GGUF, repacked on the GPU) and `load_synthetic_model` (a shape with
random weights) each refuse what the adapter cannot run before they read the weights, then hand a
ready `LlamaModel` back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json

from contract.artifacts import MANIFEST, MODEL_ARTIFACT_FORMAT, MODEL_ARTIFACT_KIND
from contract.kernels import (SHORT_PREFILL_TOKENS, Matmul, int8_x_form, llama_kernels, matmul_role,
                              matmul_subgroup_lanes, prefill_matrix)
from contract.model import (ALL_MODEL_CONFIGS, DEFAULT_CONTEXT_LENGTH, DTYPE_BYTES, LlamaConfig, model_tensors,
                            synthetic_config_name)
from contract.slices import VOCAB_SLICE_ROWS, is_vocab_tensor, vocab_slice_bytes
from model_glue.model.attention import AttentionKernels, resolve_attention_kernels
from model_glue.errors import ModelError, NeedsShaderF16
from model_glue.gpu.kernel import unmet_limits
from model_glue.model.kv_cache import PagedKVCache
from model_glue.model.llama import LlamaModel
from model_glue.options import RunOptions
from model_glue.policy import (TILED_MAX_CONTEXT, layout_rank, pick_matmul_int8_x, pick_matmul_subgroup_lanes,
                               pick_prefill_matrix, why_no_prefill_matrix)
from model_glue.model.scratch import scratch_sizes
from model_glue.formats.gguf_file import read_header
from model_glue.formats.gguf_model import (ROPE_FREQS, llama_config, parse_f32, shape_name, tensor_plan,
                                           with_matrix_formats, with_rope_scaling,
                                           context_length as gguf_context_length)
from model_glue.formats.gguf_upload import upload_gguf_tensors
from model_glue.synthetic import fill_synthetic_weights
from model_glue.gpu.webgpu import BUFFER_LIMITS, AdapterLimitError


async def load_model(device, library, read_text, read_bytes, *, manifest: dict | None = None,
                     options: RunOptions = RunOptions(), dtype: str | None = None, progress=lambda message: None,
                     verified_sha256: str | None = None) -> LlamaModel:
    """Load a converted artifact (manifest.json + weights.bin) through async readers; `manifest`:
    the parsed manifest, where the caller has read it already.

    Each tensor's sha256 is checked, unless `verified_sha256` (the whole file's hash, which the
    caller already checked the bytes against) equals the manifest's `weights_sha256`.
    """
    if manifest is None:
        try:
            manifest = json.loads(await read_text(MANIFEST))
        except (OSError, ValueError) as err:
            raise ModelError(f"cannot read the model manifest: {err}") from err
    if manifest.get("format") != MODEL_ARTIFACT_FORMAT or manifest.get("kind") != MODEL_ARTIFACT_KIND:
        raise ModelError(f"unsupported model artifact {manifest.get('kind')!r} v{manifest.get('format')} "
                         f"(this runtime reads {MODEL_ARTIFACT_KIND!r} v{MODEL_ARTIFACT_FORMAT}): re-convert it "
                         "with `make setup`")
    config_name = manifest.get("config_name")
    config = _checked_config(config_name, manifest["config"])
    tensor_bytes = {name: t["nbytes"] for name, t in manifest["tensors"].items()}
    loader = _Loader(device, library, config_name, config, options, dtype, manifest["context_length"], tensor_bytes)
    progress(f"reading weights ({manifest['total_bytes'] / 2**20:.0f} MiB)")
    try:
        blob = await read_bytes(manifest["weights_file"])
    except OSError as err:
        raise ModelError(f"cannot download the weights: {err}") from err
    if len(blob) != manifest["total_bytes"]:
        raise ModelError(f"weights file has {len(blob)} bytes, the manifest says {manifest['total_bytes']}"
                         " (incomplete download or corrupted artifact)")
    check_tensors = verified_sha256 is None or verified_sha256 != manifest.get("weights_sha256")
    progress("checking each tensor's sha256 and uploading it to the GPU" if check_tensors else
             "uploading the weights to the GPU (the whole file's sha256 was checked)")
    view = memoryview(blob)
    weights = {}
    for name, t in manifest["tensors"].items():
        data = view[t["offset"]:t["offset"] + t["nbytes"]]
        if check_tensors and hashlib.sha256(data).hexdigest() != t["sha256"]:
            raise ModelError(f"tensor {name} is corrupted (sha256 mismatch); rebuild the artifact")
        weights[name] = device.storage_buffer(t["nbytes"], data)
    return await loader.finish(weights, progress)


async def load_synthetic_model(device, library, name: str, *, options: RunOptions = RunOptions(),
                               dtype: str | None = None, seed: int = 0, overrides: dict | None = None,
                               progress=lambda message: None) -> LlamaModel:
    """A model of a contract shape (contract.model.SYNTHETIC_CONFIGS, e.g. "llama-3.1-8b", or any other
    config of the contract) whose weights are random values filled on the GPU (model_glue.synthetic):
    the shape's real speed, nothing to download. `overrides` change config fields the kernels do not
    depend on (tests: {"n_layers": 1}, {"tied_embeddings": False})."""
    try:
        config_name = synthetic_config_name(name)
    except KeyError as err:
        raise ModelError(err.args[0]) from err
    config = ALL_MODEL_CONFIGS[config_name]
    if overrides:
        config = dataclasses.replace(config, **overrides)
    loader = _Loader(device, library, config_name, config, options, dtype, DEFAULT_CONTEXT_LENGTH,
                     {t.name: t.nbytes for t in model_tensors(config)})
    weights = await fill_synthetic_weights(device, library, config, seed, progress)
    return await loader.finish(weights, progress)


async def load_gguf_model(device, library, read, file_size: int, *, options: RunOptions = RunOptions(),
                          dtype: str | None = None, progress=lambda message: None, header=None) -> LlamaModel:
    """A llama GGUF straight from the file, through `read(offset, nbytes) -> bytes` (a native file or
    the page's File): the header is parsed (model_glue.formats.gguf_file), the shape matched to kernels and
    every tensor checked (model_glue.formats.gguf_model) before any upload, then each tensor's raw blocks are
    uploaded and repacked to the runtime's Q4/Q8/Q8A on the GPU (kernels.gguf_repack). `header`: the
    file's, where the caller has read it already."""
    header = header or await read_header(read, file_size)
    config_name, config = await gguf_config(header, read)
    plan = tensor_plan(header, config)
    loader = _Loader(device, library, config_name, config, options, dtype, gguf_context_length(header),
                     {t.name: t.nbytes for t in model_tensors(config)})
    weights = await upload_gguf_tensors(device, library, read, plan, progress)
    model = await loader.finish(weights, progress)
    model.requantized = tuple(dict.fromkeys(p.names[0].split(".")[-2] for p in plan if not p.exact))
    return model


async def gguf_config(header, read) -> tuple[str, LlamaConfig]:
    """(shape name, config) of a GGUF, with the RoPE scaling of its rope_freqs tensor where it has
    one (read through `read`). Whether kernels run it is the loader's check (`model_kernel_specs`)."""
    divisors = None
    if ROPE_FREQS in header.tensors:
        freqs = header.tensors[ROPE_FREQS]
        if freqs.type_name != "F32":
            raise ModelError(f"{ROPE_FREQS} is {freqs.type_name}; expected F32")
        divisors = parse_f32(bytes(await read(freqs.offset, freqs.nbytes)))
    config = with_matrix_formats(with_rope_scaling(llama_config(header), divisors), header)
    return shape_name(config), config


def default_dtype(device, config: LlamaConfig) -> str:
    """f16 where the adapter has shader-f16 and the family's activations fit it, else f32."""
    return "float16" if device.has_f16 and config.arch.f16_activations else "float32"


class _Loader:
    """What both ways in share: the checks made before any weight reaches the GPU (kernels present,
    adapter limits), then the model itself, its pipelines and its warm-up."""

    def __init__(self, device, library, config_name: str, config: LlamaConfig, options: RunOptions,
                 dtype: str | None, context_length: int, tensor_bytes: dict[str, int]):
        self.device, self.library, self.config_name, self.config = device, library, config_name, config
        self.options = options.resolved(is_cpu=device.is_cpu, context_length=context_length)
        self.dtype = dtype or default_dtype(device, config)
        if self.dtype == "float16" and not device.has_f16:
            raise NeedsShaderF16(f"{device.adapter_name} has no shader-f16; use float32")
        if self.dtype == "float16" and not config.arch.f16_activations:
            raise ModelError(f"the {config.family} family's activations overflow float16 (contract.family); "
                             "it runs in float32")
        self.specs, self.attention = runnable_kernels(library, config, self.dtype, device,
                                                      self.options.matmul_subgroups, self.options.matmul_int8_x,
                                                      self.options.fold_norms, self.options.prefill_matrix)
        self.options = dataclasses.replace(self.options,
                                           matmul_subgroups=matmul_subgroup_lanes(self.specs) is not None,
                                           matmul_int8_x=int8_x_form(self.specs) is not None,
                                           prefill_matrix=prefill_matrix(self.specs))
        self.names = {role: spec.name for role, spec in self.specs.items()}
        esize = DTYPE_BYTES[self.dtype]
        # The vocabulary's tensors (the embedding, an untied head) are bound a slice of rows at a time
        # where they exceed a binding (contract.slices: LlamaModel.vocab_slices); every other buffer whole.
        layer_bytes = [nbytes for name, nbytes in tensor_bytes.items() if not is_vocab_tensor(name)]
        vocab_bytes = [nbytes for name, nbytes in tensor_bytes.items() if is_vocab_tensor(name)]
        _check_limits(device, library, list(self.names.values()) + [self.attention.tiled] + [self.attention.prefill] * bool(self.attention.prefill), {
            "the largest weight tensor": max(layer_bytes, default=0),
            f"a slice of {VOCAB_SLICE_ROWS} vocabulary rows": vocab_slice_bytes(config),
            "one layer's KV cache": PagedKVCache.layer_bytes(config, esize, self.options.max_context),
            "the largest activation buffer": max(scratch_sizes(config, esize, self.options.prefill_chunk,
                                                               self.options.max_context).values()),
        }, {"the largest vocabulary tensor": max(vocab_bytes, default=0)})

    async def finish(self, weights: dict, progress) -> LlamaModel:
        progress("compiling kernels")
        options = self.options
        model = LlamaModel(self.device, self.library, self.config, self.config_name, self.dtype, weights,
                           self.specs, self.attention, options,
                           prefill_matrix_why_not=why_no_prefill_matrix(self.library, self.config, self.dtype,
                                                                        self.device, options.fold_norms))
        if options.prefill_attention_matrix:
            model.check_prefill_attention_matrix(options)
        await asyncio.gather(model.compile_roles(options.fold_norms), model.compile_attention())  # concurrently
        if options.warm_up:
            progress("binding the passes")
            await warm_up(model)
        return model


async def warm_up(model: LlamaModel) -> None:
    """Run a prompt of dummy ids and a few decode steps, then forget them: the prefill and decode
    passes are bound and the decode passes recorded before the first real prompt (binding a pass
    would otherwise land in the first reply's time to first token). The scratch
    buffers are sized for a whole prefill chunk first, so no later prompt reallocates them (which
    drops every bound pass). The prompt ends 3 tokens short of the switch, and the steps go on to
    the first context past it that times attention (RunOptions.time_attention_every): so both nests
    run as a step that times attention per layer and as a step that is one pass, as replies do. A
    short prompt goes first: passes of up to SHORT_PREFILL_TOKENS run their own matmul builds."""
    from model_glue.model.generate import generate

    every = max(model.run.time_attention_every, 1)
    tokens = min(TILED_MAX_CONTEXT - 3, model.kv.capacity - every - 4)  # leaves room for the decode steps
    if tokens < 1:
        return
    model.ensure_scratch(model.run.prefill_chunk)
    try:
        await generate(model, [1] * min(SHORT_PREFILL_TOKENS, tokens), max_new_tokens=1)
        model.reset()
        # decode contexts tokens + 1 .. TILED_MAX_CONTEXT + every: tiled timed (the first), tiled in one
        # pass, tiled timed (256), sharded in one pass, sharded timed (256 + every)
        await generate(model, [1] * tokens, max_new_tokens=every + 4)
    finally:
        model.reset()


def _checked_config(config_name: str | None, values: dict) -> LlamaConfig:
    """The artifact's config (whether kernels run it is `model_kernel_specs`'s check)."""
    try:
        return LlamaConfig.from_dict(values)
    except TypeError as err:
        raise ModelError(f"the model artifact's config ({config_name!r}) is incomplete ({err}); re-convert it "
                         "with `make setup`") from err


def _compiled_for(role: str, c: LlamaConfig) -> str:
    """What a role's kernel is compiled for, in the config's words (a missing kernel's message);
    contract.kernels.llama_kernels is the authority."""
    if "rope" in role:
        return f"head_dim {c.head_dim}{' with RoPE scaling' if c.rope_scaling else ''}"
    if role.startswith("down"):
        return f"ffn_dim {c.ffn_dim}"
    if role == matmul_role(Matmul.NORM_GATE_UP_SWIGLU):  # compiles its rows in (MatmulSpec.compiled_rows)
        return f"dim {c.dim} with ffn_dim {c.ffn_dim}"
    if role.startswith("o_"):
        return f"attention width {c.n_heads * c.head_dim}"
    return f"dim {c.dim}"


def model_kernel_specs(library, config: LlamaConfig, dtype: str, device=None, matmul_subgroups: bool | None = None,
                       matmul_int8_x: bool | None = None, fold_norms: bool = True,
                       prefill_matrix: bool | None = None) -> dict:
    """role -> spec (contract.kernels.llama_kernels) of every model kernel the forward pass may run,
    each present in the artifact: kernels are compiled for row widths and head_dim, not for a model,
    so any config whose widths have kernels runs. Otherwise a ModelError naming what is missing. The
    decode matmuls are the subgroup build `pick_matmul_subgroup_lanes` picks, if any, reading int8
    codes of x where `pick_matmul_int8_x` says so."""
    lanes = pick_matmul_subgroup_lanes(library, config, dtype, device, matmul_subgroups)
    specs = llama_kernels(config, dtype, lanes,
                          pick_matmul_int8_x(library, config, dtype, lanes, matmul_int8_x, device, fold_norms),
                          pick_prefill_matrix(library, config, dtype, device, prefill_matrix, fold_norms))
    unfit = [f"{role} ({why})" for role, spec in specs.items() if (why := spec.unsupported())]
    if unfit:
        raise ModelError(f"this model's sizes do not fit the kernels' grids: {'; '.join(unfit)}")
    missing = {role: spec.name for role, spec in specs.items() if spec.name not in library.specs}
    if not missing:
        return specs
    other = "float16" if dtype == "float32" else "float32"
    if all(spec.name in library.specs for spec in llama_kernels(config, other).values()):
        if device is not None and not device.has_f16 and other == "float16":
            raise NeedsShaderF16(f"this model's shape has kernels for float16 only, not float32: "
                                 f"{device.adapter_name} has no shader-f16")
        raise ModelError(f"this model's shape has kernels for {other} only, not {dtype}")
    fields = sorted({_compiled_for(role, config) for role in missing})
    served = sorted(name for name, c in ALL_MODEL_CONFIGS.items()
                    if all(spec.name in library.specs for spec in llama_kernels(c, dtype).values()))
    raise ModelError(f"no kernels for this model's shape (dim {config.dim}, ffn_dim {config.ffn_dim}, "
                     f"{config.n_heads} heads of {config.head_dim}, {dtype}): the artifact has none for its "
                     f"{', '.join(fields)} (it lacks {', '.join(sorted(set(missing.values()))[:3])}"
                     f"{', ...' if len(set(missing.values())) > 3 else ''}); shapes with kernels: {', '.join(served)}")


def runnable_kernels(library, config: LlamaConfig, dtype: str, device,
                     matmul_subgroups: bool | None = None, matmul_int8_x: bool | None = None,
                     fold_norms: bool = True, prefill_matrix: bool | None = None) -> tuple[dict, AttentionKernels]:
    """The model kernels' specs and the attention kernels that run `config` on this device, or a
    ModelError naming what the artifact lacks (before any weight is read)."""
    return (model_kernel_specs(library, config, dtype, device, matmul_subgroups, matmul_int8_x, fold_norms,
                               prefill_matrix),
            _attention_kernels(library, config, dtype, device))


def _attention_kernels(library, config: LlamaConfig, dtype: str, device) -> AttentionKernels:
    """The artifact's attention kernels for the model's shape that run on this device
    (model_glue.model.attention.resolve_attention_kernels), with their builds over a window for a model
    with sliding-window layers; at least one layout this device's rule may pick must be among them. A
    shape without a causal prefill kernel (head_dim over 128) runs its prompts through the decode
    kernels (LlamaModel.prefill_attention)."""
    try:
        attention = resolve_attention_kernels(library, config.attention_shape, dtype, device)
        if config.sliding_window is not None:
            window = resolve_attention_kernels(library, config.attention_shape, dtype, device, sliding_window=True)
            attention = dataclasses.replace(attention, window=window)
    except LookupError as err:
        raise ModelError(f"{err}; rebuild the kernel artifact with `python -m app build`") from err
    for kernels in (attention, attention.window):
        if kernels is not None and all(layout_rank(name, device.is_cpu) is None for name in kernels.layouts):
            raise ModelError(f"the kernel artifact lacks a sharded layout this device runs for this model "
                             f"({kernels.unavailable}); rebuild it with `python -m app build`")
    return attention


def _check_limits(device, library, kernel_names, buffer_bytes: dict[str, int],
                  unbound_bytes: dict[str, int] | None = None) -> None:
    """Refuse an adapter below what the model's kernels and buffers need, naming each limit: each of
    `buffer_bytes` is bound whole (BUFFER_LIMITS), each of `unbound_bytes` only a slice at a time
    (maxBufferSize alone)."""
    unmet = []
    for name in kernel_names:
        unmet += unmet_limits(library.specs[name], device.limits)
    for limit in BUFFER_LIMITS:
        have = device.limits.get(limit)
        needs = {**buffer_bytes, **(unbound_bytes or {})} if limit == "maxBufferSize" else buffer_bytes
        unmet += [f"{limit} is {have} on this adapter, but {what} needs {nbytes} bytes"
                  for what, nbytes in needs.items() if have is not None and nbytes > have]
    if unmet:
        raise AdapterLimitError("this GPU adapter's limits are too low for the model: " + "; ".join(unmet))
