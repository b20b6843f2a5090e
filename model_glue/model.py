"""A Llama-shaped model on WebGPU: weights, a paged KV cache, prefill and greedy decode.

The forward pass is a fixed sequence of TVM-built kernels (see `_encode_forward`), read top to
bottom like llama2.c's run.c. No numpy and no TVM: the same code runs in Pyodide and natively.
Every decode step asks `pick_decode_nest` which attention nest to run (above 256 tokens the sharded
family, whose variant and split count `pick_sharded_variant` picks for this adapter) and records
its timings.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import time
from array import array
from contextlib import nullcontext
from dataclasses import dataclass, field

from model_glue.attention import (AttentionChoice, attention_call, attention_dispatches, parse_sharded_override,
                                  pick_decode_nest, pick_sharded_variant, split_workspace_bytes, tiled_defect,
                                  pick_subgroup_build)
from model_glue.contract import (DTYPE_BYTES, LLAMA_ROLES, MANIFEST, MAX_SPLITS, MAX_TOP_K, MODEL_ARTIFACT_FORMAT,
                                 MODEL_ARTIFACT_KIND, MODEL_CONFIGS, PAGE_SIZE, SHARDED_VARIANTS, SPLIT_WORKSPACE,
                                 LlamaConfig, attention_kernel_name, merge_kernel_name, model_kernel_name,
                                 prefill_attention_kernel_name, subgroup_tag)
from model_glue.kernel import DispatchPlan, unmet_limits
from model_glue.webgpu import BUFFER_LIMITS, AdapterLimitError

# Prompt tokens per prefill pass (longer prompts go in chunks; the stop button acts between them).
# A GPU wants large chunks: the prefill kernels' tiles (128 tokens x 64 weight rows, 64 query rows)
# fill its SMs only from a few thousand tokens on (H200, `python -m app bench prefill`: 3,000 tokens
# at 26k tok/s in chunks of 2,048, 35k in one of 4,096). A CPU rasterizer has no idle cores to fill,
# and smaller chunks keep the stop button responsive there.
GPU_PREFILL_CHUNK = 4096
CPU_PREFILL_CHUNK = 256
# Passes in flight at once: a decode step is submitted before the previous step's id is read back.
PIPELINE_DEPTH = 2
STAMPS_OFFSET = 8  # a pass's readback: the chosen id (4 bytes, padded), then its raw timestamps
STOPPED_BY_USER = "stopped by user"
STOPPED_IN_PREFILL = "stopped during prefill"


class ModelError(RuntimeError):
    """A problem with the model artifact or a request, in words a user can act on."""


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy (temperature 0, the default), or drawn on the GPU from
    the top_k most likely tokens, cut to the smallest set holding top_p of their probability."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh seed, reported in the result so the text can be redrawn

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check(self) -> None:
        if not 0 <= self.temperature <= 100:
            raise ModelError(f"temperature must be between 0 (greedy) and 100, not {self.temperature}")
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise ModelError(f"top-k must be between 1 and {MAX_TOP_K}, not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ModelError(f"top-p must be in (0, 1], not {self.top_p}")


GREEDY = Sampling()


@dataclass
class StepStats:
    """One forward pass: what the overlay shows."""

    kind: str  # "prefill" or "decode"
    tokens: int  # tokens processed in this pass
    context: int  # tokens attended by the last query (the step's longest context)
    nest: str  # decode: "tiled" or "sharded" (the family; the comparison mode's axis); "prefill"
    variant: str  # what ran: "tiled", "subgroup", "subgroup S=8", "shards_group" (model_glue.attention), "prefill"
    attention_ms: float | None  # GPU time of all attention dispatches, summed over layers
    step_ms: float  # wall time of the pass (encoding, GPU work, token id back); pipelined steps overlap,
    #                 so a decode step counts from when the previous id arrived
    timing_note: str = ""
    encode_ms: float = 0.0  # host time to encode and submit the pass
    gpu_ms: float | None = None  # GPU time from the pass's first dispatch to its last (timestamps)
    dispatches: int = 0  # compute dispatches in the pass


@dataclass
class InFlightPass:
    """A submitted pass whose token id is not read back yet (`LlamaModel.finish` reads it)."""

    staging: object  # the readback buffer its id and timestamps are copied to
    kind: str
    tokens: int
    start: int  # cache length before it
    context: int
    nest: str
    variant: str
    started: float  # perf_counter() when its encoding began
    encode_ms: float
    dispatches: int


class PagedKVCache:
    """KV pages for one sequence: per layer one GPU buffer [num_pages, 2, H_kv, 16, D].

    Physical pages are handed out from the top of the pool down, so the page table is not the
    identity (the kernels only ever see page ids through it).
    """

    def __init__(self, device, config: LlamaConfig, dtype_bytes: int):
        self.num_pages = self.pages_for(config)
        self.layers = [device.storage_buffer(self.layer_bytes(config, dtype_bytes)) for _ in range(config.n_layers)]
        self.pages: list[int] = []
        self.length = 0

    @staticmethod
    def pages_for(config: LlamaConfig) -> int:
        return (config.max_context + PAGE_SIZE - 1) // PAGE_SIZE

    @classmethod
    def layer_bytes(cls, config: LlamaConfig, dtype_bytes: int) -> int:
        """One layer's pages: [num_pages, 2 (K, V), H_kv, PAGE_SIZE, D]."""
        return cls.pages_for(config) * 2 * config.n_kv_heads * PAGE_SIZE * config.head_dim * dtype_bytes

    def reset(self) -> None:
        self.pages.clear()
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (their slots are simply written again later)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        del self.pages[(length + PAGE_SIZE - 1) // PAGE_SIZE:]
        self.length = length

    def reserve(self, new_tokens: int) -> list[int]:
        """Physical slots (page * 16 + offset) for the next `new_tokens` positions."""
        slots = []
        for pos in range(self.length, self.length + new_tokens):
            if pos // PAGE_SIZE >= len(self.pages):
                if len(self.pages) >= self.num_pages:
                    raise ModelError(f"the KV cache is full ({self.num_pages * PAGE_SIZE} tokens)")
                self.pages.append(self.num_pages - 1 - len(self.pages))
            slots.append(self.pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
        self.length += new_tokens
        return slots

    def page_table(self, context_lens: list[int]) -> tuple[array, array, array]:
        """indptr, page ids and last-page lengths for queries attending to these prefixes."""
        indptr, values, last = array("i", [0]), array("i"), array("i")
        for n in context_lens:
            num_pages = (n + PAGE_SIZE - 1) // PAGE_SIZE
            values.extend(self.pages[:num_pages])
            indptr.append(len(values))
            last.append(n - (num_pages - 1) * PAGE_SIZE)
        return indptr, values, last


class LlamaModel:
    """Weights on the GPU plus the kernels and scratch buffers of one model."""

    def __init__(self, device, library, config: LlamaConfig, weights: dict, dtype: str, config_name: str):
        self.device = device
        self.library = library
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.config_name = config_name
        self.esize = DTYPE_BYTES[dtype]
        self.kv = PagedKVCache(device, config, self.esize)
        self.cached_ids: list[int] = []  # the token ids whose K/V the cache holds, in order
        self.kernels: dict = {}
        # Decode attention: "tiled", "merge", and (variant, split) for the sharded family's kernels,
        # compiled for what this adapter runs (`prepare_variant` adds others).
        self.attention: dict = {}
        self.attention_names: dict = {}
        self.sharded_variants: frozenset[str] = frozenset()  # the family's variants the artifact holds
        self.runs_subgroups = False  # the device runs the artifact's subgroup kernels
        self._scratch_tokens = 0
        self.buffers: dict = {}
        # Decode passes (n = 1) dispatch the same kernels on the same buffers every step: their
        # bind groups are made once per nest, and only attention's values change per step.
        self._decode_plans: dict[str, DispatchPlan] = {}
        # ... and once a plan has run, its passes are recorded and later steps replay them
        # (in the page, with one call into JS): see `submit`.
        self._recorded: dict[str, object] = {}
        self.replay_recorded = True  # False: encode every pass in Python (the page benchmark's baseline)
        # GPUs fold each RMSNorm into the matmul after it and SwiGLU into the gate/up matmul (6
        # dispatches per layer instead of 9). On a CPU rasterizer the folds cost more than the
        # dispatches they save (kernels.llama.quantized_matmul), so it runs them apart.
        self.fold_norms = not device.is_cpu
        self._stamps = None
        # PIPELINE_DEPTH readback buffers, used in turn; `_in_flight` holds those of unfinished passes.
        self._staging: list = []
        self._in_flight: list = []
        self._passes_submitted = 0
        self._last_finish = 0.0
        self.stats: list[StepStats] = []
        self.tiled_defect: str | None = None  # why TVM's tiled kernel must not run for this shape
        self.sharded_override: str | None = None  # e.g. "shards:8" (set by `force_variant`)
        self.prefill_attention = None  # the causal prefill attention kernel (passes of several tokens)
        self.prefill_chunk = CPU_PREFILL_CHUNK if device.is_cpu else GPU_PREFILL_CHUNK

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    async def load(cls, device, library, read_text, read_bytes, *, max_context: int | None = None,
                   dtype: str | None = None, progress=lambda message: None,
                   verified_sha256: str | None = None) -> "LlamaModel":
        """Load a converted artifact (manifest.json + weights.bin) through async readers.

        Each tensor's sha256 is checked, unless `verified_sha256` (the whole file's hash, which the
        caller already checked the bytes against) equals the manifest's `weights_sha256`.
        """
        try:
            manifest = json.loads(await read_text(MANIFEST))
        except (OSError, ValueError) as err:
            raise ModelError(f"cannot read the model manifest: {err}") from err
        if manifest.get("format") != MODEL_ARTIFACT_FORMAT or manifest.get("kind") != MODEL_ARTIFACT_KIND:
            raise ModelError(f"unsupported model artifact {manifest.get('kind')!r} v{manifest.get('format')} "
                             f"(this runtime reads {MODEL_ARTIFACT_KIND!r} v{MODEL_ARTIFACT_FORMAT}): re-convert it "
                             "with `make setup`")
        config_name = manifest.get("config_name")
        config = _checked_config(config_name, manifest["config"], max_context)
        dtype = dtype or ("float16" if device.has_f16 else "float32")
        if dtype == "float16" and not device.has_f16:
            raise ModelError(f"{device.adapter_name} has no shader-f16; use float32")
        names = _kernel_names(library, config_name, config, dtype)
        attention_names = _attention_kernel_names(library, config, dtype, device)
        esize = DTYPE_BYTES[dtype]
        chunk = CPU_PREFILL_CHUNK if device.is_cpu else GPU_PREFILL_CHUNK
        _check_limits(device, library, list(names.values()) + [attention_names["tiled"], attention_names["prefill"]], {
            "the largest weight tensor": max(t["nbytes"] for t in manifest["tensors"].values()),
            "one layer's KV cache": PagedKVCache.layer_bytes(config, esize),
            "the largest activation buffer": max(cls.scratch_sizes(config, esize, chunk).values()),
        })
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
        model = cls(device, library, config, weights, dtype, config_name)
        model.attention_names = attention_names
        model.tiled_defect = tiled_defect(library.specs[attention_names["tiled"]])
        model.sharded_variants = frozenset(v for v in SHARDED_VARIANTS if (v, False) in attention_names)
        model.runs_subgroups = ("subgroup", False) in attention_names
        progress("compiling kernels")
        for role, name in names.items():
            model.kernels[role] = await library.kernel(name)
        model.attention["tiled"] = await library.kernel(attention_names["tiled"])
        model.prefill_attention = await library.kernel(attention_names["prefill"])
        # What this adapter's rule picks: one variant over the whole context, and split (GPUs).
        variant = model._pick_variant([config.max_context]).variant
        await model.prepare_variant(variant, split=not device.is_cpu)
        return model

    async def prepare_variant(self, variant: str, split: bool = True) -> None:
        """Compile a sharded-family variant's kernels (over the whole context, and split + the merge)."""
        wanted = [(variant, False)] + ([(variant, True), "merge"] if split else [])
        for key in wanted:
            if key not in self.attention:
                if key not in self.attention_names:
                    raise ModelError(f"the kernel artifact has no {variant!r} decode attention for this model")
                self.attention[key] = await self.library.kernel(self.attention_names[key])

    async def force_variant(self, override: str | None) -> None:
        """Hold the sharded family to a variant and split count ('shards:8', 'subgroup', ...; None:
        the adapter's rule again), for benchmarks and tests."""
        if override is not None:
            choice = parse_sharded_override(override)
            if choice.variant == "subgroup" and not self.runs_subgroups:
                raise ModelError("this device cannot run the subgroup kernels")
            await self.prepare_variant(choice.variant, split=True)
        self.sharded_override = override

    def _pick_variant(self, contexts: list[int]) -> AttentionChoice:
        return pick_sharded_variant(contexts, self.config.attention_shape, is_cpu=self.device.is_cpu,
                                    subgroups=self.runs_subgroups, available=self.sharded_variants,
                                    max_rows=MAX_SPLITS, override=self.sharded_override)

    # -- scratch buffers ----------------------------------------------------------------------
    @staticmethod
    def scratch_sizes(c: LlamaConfig, e: int, n: int) -> dict[str, int]:
        """Bytes of each activation buffer for passes of up to `n` tokens (`e` bytes per element)."""
        max_pages = PagedKVCache.pages_for(c)
        return {
            "ids": 4 * n, "positions": 4 * n, "slots": 4 * n,
            "x_a": e * n * c.dim, "x_b": e * n * c.dim, "normed": e * n * c.dim,
            "qkv": e * n * c.qkv_dim, "q": e * n * c.n_heads * c.head_dim,
            "attn": e * n * c.n_heads * c.head_dim, "lse": 4 * n * c.n_heads,
            "gate_up": e * n * 2 * c.ffn_dim, "ffn": e * n * c.ffn_dim,
            # decode attention's page table (one sequence; prefill attention reads page_ids too)
            "indptr": 4 * 2, "page_ids": 4 * max_pages, "last_len": 4,
            "zeros": 4,  # rope offsets for decode attention (unused: RoPE is applied at append); WebGPU zero-fills
            **split_workspace_bytes(MAX_SPLITS, c.attention_shape),
        }

    def _ensure_scratch(self, tokens: int) -> None:
        """Activation buffers for up to `tokens` tokens per pass (grown on demand, never shrunk)."""
        if tokens <= self._scratch_tokens:
            return
        c, e, dev = self.config, self.esize, self.device
        n = max(tokens, 1)
        for name, size in self.scratch_sizes(c, e, n).items():
            if name in self.buffers:
                dev.destroy(self.buffers[name])  # passes already submitted keep it alive until done
            self.buffers[name] = dev.storage_buffer(size)
        for plan in self._decode_plans.values():  # they bound the old buffers
            plan.release()
        self._decode_plans.clear()
        self._recorded.clear()
        for name, size in {"last": e * c.dim, "logits": 4 * c.vocab_size,
                           "next_id": 4}.items():
            if name not in self.buffers:  # one-token buffers never grow
                self.buffers[name] = dev.storage_buffer(size)
        if dev.has_timestamps and self._stamps is None:
            # Each layer's attention, then the whole pass (SPAN_BEGIN, SPAN_END); reused every pass:
            # query sets are scarce. A pass copies them out before the next one writes them.
            self._stamps = dev.timestamps(2 * c.n_layers + 2)
        if not self._staging:
            stamp_bytes = 8 * self._stamps.count if self._stamps is not None else 0
            self._staging = [dev.staging_buffer(STAMPS_OFFSET + stamp_bytes) for _ in range(PIPELINE_DEPTH)]
        self._scratch_tokens = n

    # -- one forward pass -----------------------------------------------------------------------
    async def forward(self, token_ids: list[int], attention: str = "auto", sampling: Sampling = GREEDY,
                      draw: float = 0.0, kind: str | None = None) -> int:
        """Run `token_ids` (appended to the cache) and return the next token id: the argmax, or
        with a non-greedy `sampling` the token that `draw` (uniform in [0, 1)) picks. `kind`
        labels the pass in the stats (default: "prefill" for several tokens, else "decode")."""
        return await self.finish(self.submit(token_ids, attention, sampling, draw, kind))

    def submit(self, token_ids: list[int] | None, attention: str = "auto", sampling: Sampling = GREEDY,
               draw: float = 0.0, kind: str | None = None) -> InFlightPass:
        """Encode and submit one pass without waiting for it; `finish` reads its token id.

        `token_ids=None` runs one token whose id is still on the GPU: the one the last submitted
        pass chose. So a decode step can be submitted before the previous step's id is read back.
        """
        started = time.perf_counter()  # the step time covers encoding, GPU work and readback
        c = self.config
        n = 1 if token_ids is None else len(token_ids)
        if n == 0:
            raise ModelError("nothing to run: the prompt is empty")
        if self.kv.length + n > c.max_context:
            raise ModelError(f"context would reach {self.kv.length + n} tokens; this model holds {c.max_context}")
        if token_ids is None and not self.cached_ids:
            raise ModelError("no token on the GPU to continue from: run the prompt first")
        self._ensure_scratch(n)
        start = self.kv.length
        context = start + n  # the last token sees the prefix and every token of the pass
        try:  # a decode step asks which nest; a prefill pass always runs the causal prefill kernel
            nest = pick_decode_nest([context], attention, self.tiled_defect) if n == 1 else "prefill"
        except ValueError as err:
            raise ModelError(str(err)) from err
        choice = self._pick_variant([context]) if nest == "sharded" else AttentionChoice(nest)
        slots = self.kv.reserve(n)
        # None marks an id that is still on the GPU; `finish` of the pass that chooses it fills it in.
        self.cached_ids.extend([None] if token_ids is None else token_ids)
        indptr, page_ids, last_len = self.kv.page_table([context])
        dev, buf = self.device, self.buffers
        if token_ids is not None:  # a one-token pass reads its id where the last pass's argmax wrote
            dev.write(buf["ids"] if n > 1 else buf["next_id"], array("i", token_ids).tobytes())
        dev.write(buf["positions"], array("i", range(start, start + n)).tobytes())
        dev.write(buf["slots"], array("i", slots).tobytes())
        dev.write(buf["indptr"], indptr.tobytes())
        dev.write(buf["page_ids"], page_ids.tobytes())
        dev.write(buf["last_len"], last_len.tobytes())

        if len(self._in_flight) >= PIPELINE_DEPTH:
            raise ValueError(f"at most {PIPELINE_DEPTH} passes can be in flight: finish one first")
        stamps = self._stamps
        staging = self._staging[self._passes_submitted % PIPELINE_DEPTH]
        self._passes_submitted += 1
        batch = dev.batch()
        plan_key = (choice.variant, choice.split, sampling.greedy)  # the dispatches a decode pass makes
        replay = n == 1 and self.replay_recorded
        recorded = self._recorded.get(plan_key) if replay else None
        if recorded is not None:  # a decode pass as before: new per-step values, the same dispatches
            self._decode_plans[plan_key].refresh(self._per_step_values(choice, len(page_ids), sampling, draw))
            batch.replay(recorded)
        else:
            batch.tape = [] if replay else None
            self._encode_forward(batch, n, choice, len(page_ids), stamps, sampling, draw, plan_key)
            if replay:
                self._recorded[plan_key] = dev.record(batch.stop_recording(),
                                                      self._decode_plans[plan_key].per_step_bounds)
        # One readback per pass: the chosen id, then the raw timestamps, copied side by side.
        batch.copy(buf["next_id"], 0, staging, 0, 4)
        if stamps is not None:
            batch.resolve(stamps)
            batch.copy(stamps.resolved, 0, staging, STAMPS_OFFSET, 8 * stamps.count)
        batch.submit()
        encode_ms = (time.perf_counter() - started) * 1e3
        self._in_flight.append(staging)
        return InFlightPass(staging, kind or ("prefill" if n > 1 else "decode"), n, start, context, nest,
                            str(choice), started, encode_ms, batch.dispatches)

    async def finish(self, step: InFlightPass) -> int:
        """Wait for a submitted pass, record its stats and return the token id it chose."""
        next_id, ticks = await self._read_back(step)
        end = step.start + step.tokens
        if end < len(self.cached_ids) and self.cached_ids[end] is None:
            self.cached_ids[end] = next_id  # the next pass, already submitted, was fed this id on the GPU
        attention_ms = gpu_ms = None
        note = "no timestamp-query on this adapter"
        if ticks is not None:
            layers = self.config.n_layers
            gpu_ms = (ticks[2 * layers + 1] - ticks[2 * layers]) / 1e6
            spans = [ticks[2 * i + 1] - ticks[2 * i] for i in range(layers)]
            attention_ms = sum(spans) / 1e6
            note = "quantized timestamps (100 us steps)" if all(s % 100_000 == 0 for s in spans) else ""
        now = time.perf_counter()
        # Pipelined steps overlap: a step's time runs from when the previous id arrived (or from its
        # own start, if that is later) to when its own id arrives.
        step_ms = (now - max(step.started, self._last_finish)) * 1e3
        self._last_finish = now
        self.stats.append(StepStats(step.kind, step.tokens, step.context, step.nest, step.variant, attention_ms,
                                    step_ms, note, round(step.encode_ms, 3), gpu_ms, step.dispatches))
        return next_id

    async def discard(self, step: InFlightPass) -> None:
        """Undo the last submitted pass (a step run ahead that is not wanted): its K/V slots are
        forgotten and it leaves no stats. Waits for it, since its readback buffer is reused."""
        if step.start + step.tokens != self.kv.length:
            raise ValueError("only the last submitted pass can be discarded")
        await self._read_back(step)
        self.rollback(step.start)

    async def _read_back(self, step: InFlightPass) -> tuple[int, list[int] | None]:
        if not self._in_flight or self._in_flight[0] is not step.staging:
            raise ValueError("passes must be finished in the order they were submitted")
        self._in_flight.pop(0)
        stamps = self._stamps
        size = STAMPS_OFFSET + (8 * stamps.count if stamps is not None else 0)
        raw = await self.device.read_staging(step.staging, size)
        (next_id,) = struct.unpack_from("<i", raw)
        ticks = list(memoryview(raw)[STAMPS_OFFSET:].cast("Q")) if stamps is not None else None
        return next_id, ticks

    @property
    def replayed_by(self) -> list[str]:
        """What replays recorded decode passes: RecordedPasses (Python) or BrowserRecordedPasses (JS)."""
        return sorted({type(recorded).__name__ for recorded in self._recorded.values()})

    def _attention_kernels(self, choice: AttentionChoice) -> list:
        """The dispatches of one attention call: prefill, tiled, a variant over the whole context, or
        a variant's split kernel and the merge that combines the S partial results."""
        if choice.variant == "prefill":
            return [self.prefill_attention]
        if choice.variant == "tiled":
            return [self.attention["tiled"]]
        key = (choice.variant, choice.split)
        if key not in self.attention:
            raise ModelError(f"decode attention {choice} is not compiled (see LlamaModel.prepare_variant)")
        return [self.attention[key], self.attention["merge"]] if choice.split else [self.attention[key]]

    def _attention_call(self, layer: int, n: int, nnz_pages: int, choice: AttentionChoice) -> tuple[dict, dict]:
        """Buffers and values of one layer's attention (the values are the same in every layer)."""
        c, buf = self.config, self.buffers
        if choice.variant == "prefill":  # the pass's n tokens after the kv.length - n cached before them
            return ({"q": buf["q"], "pages": self.kv.layers[layer], "page_ids": buf["page_ids"], "output": buf["attn"]},
                    {"n": n, "num_pages": self.kv.num_pages, "used_pages": nnz_pages, "start": self.kv.length - n,
                     "sm_scale": c.head_dim ** -0.5})
        # RoPE was applied at append (adjacent pairs, as the GGUF's Q/K expect): rotary_mode 0.
        # The page table grows with the context: attention's values change every step.
        return attention_call(
            q=buf["q"], pages=self.kv.layers[layer], page_table_indptr=buf["indptr"],
            page_table_values=buf["page_ids"], length_info=buf["last_len"], k_rope_pos_offset=buf["zeros"],
            q_rope_position=buf["zeros"], output=buf["attn"], lse=buf["lse"], batch=n, nnz_pages=nnz_pages,
            max_num_pages=self.kv.num_pages, sm_scale=c.head_dim ** -0.5, rope_theta=c.rope_theta,
            workspace={name: buf[name] for name in SPLIT_WORKSPACE}, num_splits=choice.num_splits)

    @staticmethod
    def _sample_values(sampling: Sampling, draw: float) -> dict:
        return {"top_k": sampling.top_k, "temperature": sampling.temperature, "top_p": sampling.top_p, "draw": draw}

    def _per_step_values(self, choice: AttentionChoice, nnz_pages: int, sampling: Sampling, draw: float) -> list:
        """(kernel, values) of each kernel of a decode pass whose values change per step: attention
        (the context grows) and the sampler (a new draw)."""
        buffers, values = self._attention_call(0, 1, nnz_pages, choice)
        pairs = [(kernel, v) for kernel, _, v in attention_dispatches(self._attention_kernels(choice), buffers, values)]
        if not sampling.greedy:
            pairs.append((self.kernels["sample"], self._sample_values(sampling, draw)))
        return pairs

    def _encode_forward(self, batch, n: int, choice: AttentionChoice, nnz_pages: int, stamps, sampling: Sampling,
                        draw: float, plan_key: tuple) -> None:
        """The whole forward pass as kernel dispatches (bound per pass: shapes change with n)."""
        c, w, buf, k = self.config, self.weights, self.buffers, self.kernels
        phase = "decode" if n == 1 else "prefill"
        tokens = {"n": n}
        plan = self._decode_plans.setdefault(plan_key, DispatchPlan()) if n == 1 else None
        attention = self._attention_kernels(choice)
        if plan is not None:
            plan.start()

        def run(kernel, buffers, values=tokens, per_step=False):
            if plan is not None:
                plan.dispatch(batch, kernel, buffers, values, per_step=per_step)
                return
            bound = kernel.bind(buffers, values)  # a prefill pass: its own shapes, bound once
            bound.dispatch(batch)
            bound.release_after(batch)

        def matmul(role, name, x, y, *, norm=None, resid=None):
            buffers = {"x": x, "w": w[f"{name}.q4"], "scale": w[f"{name}.scale"], "wmin": w[f"{name}.min"], "y": y}
            if norm is not None:
                buffers["norm"] = w[norm]
            if resid is not None:
                buffers["resid"] = resid
            run(k[f"{role}_{phase}"], buffers)

        def normed_matmul(role, name, x, y, norm):
            """norm(x) @ W^T: the RMSNorm folded into the matmul, or (CPU rasterizers) run before it."""
            if self.fold_norms:
                matmul(f"norm_{role}", name, x, y, norm=norm)
            else:
                run(k["rms_norm"], {"x": x, "weight": w[norm], "out": buf["normed"]})
                matmul(role, name, buf["normed"], y)

        def swiglu_ffn(name, x, h, norm):
            """h = silu(norm(x) @ Wg^T) * (norm(x) @ Wu^T), folded into one matmul or in three kernels."""
            if self.fold_norms:
                matmul("norm_gate_up_swiglu", name, x, h, norm=norm)
            else:
                normed_matmul("gate_up", name, x, buf["gate_up"], norm)
                run(k["swiglu"], {"gate_up": buf["gate_up"], "h": h})

        x, x_mid = buf["x_a"], buf["x_b"]
        # The pass's GPU time runs from the embedding's start to the head's end (timestamps).
        span_begin, span_end = 2 * c.n_layers, 2 * c.n_layers + 1
        with batch.timed((stamps, span_begin, None)) if stamps is not None else nullcontext():
            # a one-token pass embeds the id the last pass chose (or the host wrote) in next_id
            run(k["embed"], {"ids": buf["ids"] if n > 1 else buf["next_id"], "q8": w["embed.q8"],
                             "scale": w["embed.scale"], "out": x})
        for layer in range(c.n_layers):
            p = f"layers.{layer}"
            pages = self.kv.layers[layer]
            # attention block: x_mid = x + o(attention(rope(qkv(norm(x)))))
            normed_matmul("qkv", f"{p}.qkv", x, buf["qkv"], f"{p}.attn_norm")
            run(k["rope_append"], {"qkv": buf["qkv"], "positions": buf["positions"], "slots": buf["slots"],
                                   "pages": pages, "q": buf["q"]}, {"n": n, "num_pages": self.kv.num_pages})
            attn_buffers, attn_values = self._attention_call(layer, n, nnz_pages, choice)
            with batch.timed((stamps, 2 * layer, 2 * layer + 1)) if stamps is not None else nullcontext():
                for kernel, kernel_buffers, values in attention_dispatches(attention, attn_buffers, attn_values):
                    run(kernel, kernel_buffers, values, per_step=True)
            matmul("o_residual", f"{p}.o", buf["attn"], x_mid, resid=x)
            # feed-forward block: x = x_mid + down(swiglu(gate_up(norm(x_mid)))), swiglu in gate_up's epilogue
            swiglu_ffn(f"{p}.gate_up", x_mid, buf["ffn"], f"{p}.ffn_norm")
            matmul("down_residual", f"{p}.down", buf["ffn"], x, resid=x_mid)
        # head: only the last token's logits are needed (a decode pass's x is that token already)
        last = x
        if n > 1:
            batch.copy(x, (n - 1) * c.dim * self.esize, buf["last"], 0, c.dim * self.esize)
            last = buf["last"]
        head = {"w": w["embed.q8"], "scale": w["embed.scale"], "y": buf["logits"]}  # the tied embedding, q8
        with batch.timed((stamps, None, span_end)) if stamps is not None else nullcontext():
            if self.fold_norms:
                run(k["norm_lm_head"], {"x": last, "norm": w["final_norm"], **head}, {"n": 1})
            else:
                run(k["rms_norm"], {"x": last, "weight": w["final_norm"], "out": buf["normed"]}, {"n": 1})
                run(k["lm_head"], {"x": buf["normed"], **head}, {"n": 1})
            if sampling.greedy:
                run(k["argmax"], {"logits": buf["logits"], "out": buf["next_id"]}, {})
            else:  # the draw changes every step
                run(k["sample"], {"logits": buf["logits"], "out": buf["next_id"]}, self._sample_values(sampling, draw),
                    per_step=True)

    def reset(self) -> None:
        self.kv.reset()
        self.cached_ids.clear()
        self.stats.clear()
        self._in_flight.clear()  # passes left unfinished (an error midway) are abandoned

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens (a new turn reuses that prefix)."""
        self.kv.truncate(length)
        del self.cached_ids[length:]

    async def read_logits(self) -> bytes:
        """The last pass's logits as raw f32 bytes (tests compare them with a reference)."""
        return await self.device.read(self.buffers["logits"], 4 * self.config.vocab_size)


def _checked_config(config_name: str | None, values: dict, max_context: int | None) -> LlamaConfig:
    """The artifact's config, which must be the contract's config of that name (the kernels' shapes)."""
    if config_name not in MODEL_CONFIGS:
        raise ModelError(f"the model artifact is for config {config_name!r}, which has no kernels here "
                         f"(known: {sorted(MODEL_CONFIGS)}); add it to model_glue/contract.py and rebuild")
    config = LlamaConfig.from_dict(values)
    if config.kernel_shape() != MODEL_CONFIGS[config_name].kernel_shape():
        raise ModelError(f"the model artifact's {config_name!r} config differs from the contract's; "
                         "re-convert it with `make setup`")
    if max_context:
        config = LlamaConfig.from_dict({**values, "max_context": min(max_context, config.max_context)})
    return config


def _kernel_names(library, config_name: str, config: LlamaConfig, dtype: str) -> dict[str, str]:
    """Artifact kernel name of every role the forward pass runs (decode attention apart)."""
    names = {role: model_kernel_name(config_name, role, dtype) for role in LLAMA_ROLES}
    missing = sorted(name for name in names.values() if name not in library.specs)
    if missing:
        raise ModelError(f"the kernel artifact lacks {len(missing)} kernels of this model (e.g. {missing[0]}); "
                         "rebuild it with `python -m app build`")
    return names


def _attention_kernel_names(library, config: LlamaConfig, dtype: str, device) -> dict:
    """"prefill", "tiled", "merge" and (variant, split) -> artifact name, for the attention kernels the
    artifact holds for the model's shape and this device runs (prefill, tiled, the merge and "shards"
    must be there; "subgroup" is the build model_glue.attention.pick_subgroup_build picks, if any)."""
    shape = config.attention_shape
    names = {"prefill": prefill_attention_kernel_name(shape, dtype), "tiled": attention_kernel_name("tiled", shape, dtype),
             "merge": merge_kernel_name(shape, dtype)}
    builds = {(library.specs[n].meta["row_lanes"], library.specs[n].meta["subgroup_size"]) for n in library.names(
        kind="decode_attention", variant="subgroup", dtype=dtype, sliding_window=False, head_dim=shape.head_dim,
        num_kv_heads=shape.num_kv_heads, num_qo_heads=shape.num_qo_heads)}
    build = pick_subgroup_build(builds, device.subgroup_min_size, device.subgroup_max_size)
    tags = {"subgroup": subgroup_tag(*build) if build else None}
    for variant in SHARDED_VARIANTS:
        if variant == "subgroup" and build is None:
            continue
        for split in (False, True):
            name = attention_kernel_name(variant, shape, dtype, split=split, tag=tags.get(variant))
            if name in library.specs:
                names[variant, split] = name
    missing = [key for key in ("tiled", "merge", ("shards", False), ("shards", True)) if key not in names]
    missing += ["prefill"] if names["prefill"] not in library.specs else []
    if missing:
        raise ModelError(f"the kernel artifact lacks the decode attention kernels of this model ({missing}); "
                         "rebuild it with `python -m app build`")
    return names


def _check_limits(device, library, kernel_names, buffer_bytes: dict[str, int]) -> None:
    """Refuse an adapter below what the model's kernels and buffers need, naming each limit."""
    unmet = []
    for name in kernel_names:
        unmet += unmet_limits(library.specs[name], device.limits)
    for limit in BUFFER_LIMITS:
        have = device.limits.get(limit)
        unmet += [f"{limit} is {have} on this adapter, but {what} needs {nbytes} bytes"
                  for what, nbytes in buffer_bytes.items() if have is not None and nbytes > have]
    if unmet:
        raise AdapterLimitError("this GPU adapter's limits are too low for the model: " + "; ".join(unmet))


@dataclass
class Generation:
    """The result of `generate`: ids, why it stopped, and the per-pass statistics."""

    token_ids: list[int] = field(default_factory=list)
    stop_reason: str = ""
    stats: list[StepStats] = field(default_factory=list)
    seed: int | None = None  # the sampling seed used (None: greedy)
    reused_tokens: int = 0  # prompt tokens whose K/V were already in the cache (not prefilled again)
    prefill_tokens: int = 0  # prompt tokens prefilled by this call
    prefill_ms: float = 0.0  # wall time from the call to the first token (prefill passes and their readback)
    decode_ms: float = 0.0  # wall time of the decode steps (one per generated token after the first)

    @property
    def decode_steps(self) -> int:
        return max(len(self.token_ids) - 1, 0)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


async def generate(model: LlamaModel, prompt_ids: list[int], *, max_new_tokens: int, stop_ids=(),
                   attention: str = "auto", sampling: Sampling = GREEDY, reuse_cache: bool = False,
                   forced_ids=None, on_token=None, on_prefill=None, should_stop=lambda: False) -> Generation:
    """Prefill the prompt (in chunks), then one decode step per token, each token chosen by
    `sampling` (greedy by default; a seeded sampling run is reproducible).

    With `reuse_cache`, the cache keeps its longest prefix shared with `prompt_ids` and only the
    rest is prefilled (a chat's next turn); at least the last prompt token always runs, since its
    logits give the first new token. `should_stop` is asked between prefill chunks and after
    every token: a stop during prefill ends with no tokens and stop_reason STOPPED_IN_PREFILL.
    `on_prefill(done, total)` reports prompt tokens prefilled so far. With `forced_ids`
    (teacher forcing) step i is fed forced_ids[i - 1] instead of its own prediction, and the run
    makes exactly len(forced_ids) predictions; `token_ids` holds the predictions.
    """
    started = time.perf_counter()
    result = Generation()
    model.stats.clear()
    if not prompt_ids:
        raise ModelError("the prompt is empty")
    sampling.check()
    if len(prompt_ids) + max_new_tokens > model.config.max_context:
        model.reset()  # the next request starts from an empty cache
        raise ModelError(f"prompt ({len(prompt_ids)} tokens) plus {max_new_tokens} new tokens exceeds the "
                         f"context of {model.config.max_context} tokens; shorten the conversation")
    draws = None
    if not sampling.greedy:
        result.seed = random.randrange(2**31) if sampling.seed is None else sampling.seed
        draws = random.Random(result.seed)
    keep = min(common_prefix(model.cached_ids, prompt_ids), len(prompt_ids) - 1) if reuse_cache else 0
    model.rollback(keep)
    result.reused_tokens, result.prefill_tokens = keep, len(prompt_ids) - keep
    try:
        await _run_generation(model, prompt_ids[keep:], result, max_new_tokens, stop_ids, attention,
                              sampling, draws, forced_ids, on_token, on_prefill, should_stop, started)
    except BaseException:
        model.reset()  # a pass that failed midway leaves the cache's contents unknown
        raise
    result.stats = list(model.stats)
    return result


async def _run_generation(model, new_ids, result, max_new_tokens, stop_ids, attention, sampling, draws, forced_ids,
                          on_token, on_prefill, should_stop, started) -> None:
    def draw() -> float:
        return 0.0 if draws is None else draws.random()

    # Prefill chunks are pipelined too: chunk i+1 is submitted before chunk i is read back.
    pending = None

    async def finish_chunk(step):
        token = await model.finish(step)
        if on_prefill is not None:
            on_prefill(min(step.start - start_length + step.tokens, len(new_ids)), len(new_ids))
        return token

    start_length = model.kv.length
    chunk = model.prefill_chunk
    for chunk_start in range(0, len(new_ids), chunk):
        if should_stop():
            if pending is not None:
                await finish_chunk(pending)  # what was submitted stays in the cache, as before
            result.stop_reason = STOPPED_IN_PREFILL
            return
        last_chunk = chunk_start + chunk >= len(new_ids)  # only its token is kept, and drawn
        step = model.submit(new_ids[chunk_start:chunk_start + chunk], attention,
                            sampling if last_chunk else GREEDY, draw() if last_chunk else 0.0, kind="prefill")
        if pending is not None:
            await finish_chunk(pending)
        pending = step
    next_id = await finish_chunk(pending)
    decode_started = time.perf_counter()
    result.prefill_ms = (decode_started - started) * 1e3
    limit = max_new_tokens if forced_ids is None else len(forced_ids)

    def submit_step(predicted: int, known_id: int | None = None):
        """The decode step that predicts token `predicted + 1`. Its input, token `predicted`, is
        the id the host knows, or else still on the GPU (the previous step chose it), unless
        teacher forcing feeds another."""
        fed = [known_id] if known_id is not None else None
        if forced_ids is not None:
            fed = [forced_ids[predicted - 1]]
        return model.submit(fed, attention, sampling, draw())

    # Pipelined: step t+1 is submitted before step t's id is read back, so the GPU works while the
    # host reads an id, reports it and encodes the next step. A stop found in an id read back
    # discards the one step already submitted after it; nothing of it remains.
    pending = ahead = None
    while True:
        result.token_ids.append(next_id)
        result.decode_ms = (time.perf_counter() - decode_started) * 1e3
        if on_token is not None:
            await on_token(next_id)
        if forced_ids is None and next_id in stop_ids:
            result.stop_reason = "stop token"
        elif len(result.token_ids) >= limit:
            result.stop_reason = "max tokens"
        elif should_stop():
            result.stop_reason = STOPPED_BY_USER
        if result.stop_reason:
            if pending is not None:
                await model.discard(pending)
            return
        if pending is None:  # the first step after the prefill, whose id the host has
            pending = submit_step(len(result.token_ids), next_id)
        if len(result.token_ids) + 1 < limit:  # the step after it may be wanted: submit it now
            ahead = submit_step(len(result.token_ids) + 1)
        next_id = await model.finish(pending)
        pending, ahead = ahead, None
