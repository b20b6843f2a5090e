"""A Llama-shaped model on WebGPU: the forward pass and the pipeline of passes in flight.

`_encode_forward` is the forward pass as a fixed sequence of TVM-built kernels, read top to
bottom like llama2.c's run.c; `PassEncoder` around it dispatches, binds once and records (decode
steps), and brackets attention with timestamps. `submit` / `finish` keep up to `pipeline_depth`
passes in flight (model_glue.options). No numpy and no TVM: the same code runs in Pyodide and natively. Loading is
model_glue.loading, the KV cache model_glue.kv_cache, generation model_glue.generate.

Every decode step asks `pick_decode_nest` which attention nest to run (above 256 tokens the
sharded family, whose variant and split count `pick_sharded_variant` picks for this adapter) and
records its timings; a pass of several tokens runs the causal prefill attention kernel.
"""

from __future__ import annotations

import struct
import time
from array import array
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

from contract.kernels import MAX_SPLITS, SHARDED_VARIANTS, SPLIT_WORKSPACE
from contract.model import DTYPE_BYTES, LlamaConfig
from model_glue.attention import (AttentionChoice, attention_call, attention_dispatches, parse_sharded_override,
                                  pick_decode_nest, pick_sharded_variant, split_workspace_bytes, tiled_defect)
from model_glue.errors import ModelError
from model_glue.kernel import DispatchPlan
from model_glue.kv_cache import PagedKVCache
from model_glue.options import MAX_PIPELINE_DEPTH, RunOptions

STAMPS_OFFSET = 8  # a pass's readback: the chosen id (4 bytes, padded), then its raw timestamps


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
    # How long the host waited for the pass's id. At steady state above 0: the host keeps up and the
    # GPU is the bound; near 0 with step_ms above gpu_ms: the host is, and the GPU waits for it.
    wait_ms: float = 0.0


def forward_roles(fold_norms: bool, greedy: bool = True) -> list[str]:
    """The kernel roles `_encode_forward` dispatches (contract.kernels.llama_kernels): with the norms
    and SwiGLU folded into the matmuls (GPUs) or apart (CPU rasterizers), argmax or the sampler.
    Only these are compiled."""
    matmuls = ["norm_qkv", "o_residual", "norm_gate_up_swiglu", "down_residual"] if fold_norms else \
        ["qkv", "o_residual", "gate_up", "down_residual"]
    apart = [] if fold_norms else ["rms_norm", "swiglu"]
    return ["embed", "rope_append", *(f"{m}_{phase}" for phase in ("decode", "prefill") for m in matmuls), *apart,
            "norm_lm_head" if fold_norms else "lm_head", "argmax" if greedy else "sample"]


class PlanKey(NamedTuple):
    """What fixes the dispatches of a decode pass: its attention kernels and argmax vs sampler."""

    variant: str
    split: bool
    greedy: bool


@dataclass
class PendingPass:
    """A submitted pass whose token id is not read back yet (`LlamaModel.finish` reads it)."""

    staging: object  # the readback buffer its id and timestamps are copied to
    tokens: int
    start: int  # cache length before it
    input_on_gpu: bool  # its one token is the id the previous pass chose, not yet known to the host
    stats: StepStats  # filled in by `finish` (timings)
    started: float  # perf_counter() when its encoding began


class PassEncoder:
    """Encodes one pass into a Batch. A decode pass goes through its DispatchPlan (bound once, the
    attention and sampler values refreshed per step) and onto a tape that later steps replay; a
    prefill pass goes through a plan of its own whose every value is per step (bound once, the
    uniforms rewritten for each pass's n). Without a plan each dispatch is bound for itself.
    `timed(begin, end)` brackets dispatches with the pass's timestamp queries (none on adapters
    without timestamp-query)."""

    def __init__(self, batch, stamps, plan: DispatchPlan | None, every_value_per_step: bool = False):
        self.batch, self.stamps, self.plan = batch, stamps, plan
        self.every_value_per_step = every_value_per_step  # a prefill pass: n changes every kernel's values
        if plan is not None:
            plan.start()

    def run(self, kernel, buffers: dict, values: dict, per_step: bool = False) -> None:
        if self.plan is not None:
            self.plan.dispatch(self.batch, kernel, buffers, values, per_step=per_step or self.every_value_per_step)
            return
        bound = kernel.bind(buffers, values)
        bound.dispatch(self.batch)
        bound.release_after(self.batch)

    @contextmanager
    def timed(self, begin: int | None, end: int | None):
        if self.stamps is None:
            yield
            return
        with self.batch.timed((self.stamps, begin, end)):
            yield


class LlamaModel:
    """Weights on the GPU plus the kernels and scratch buffers of one model (made by
    model_glue.loading.load_model)."""

    def __init__(self, device, library, config: LlamaConfig, config_name: str, dtype: str, weights: dict,
                 kernel_names: dict, attention_names: dict, options: RunOptions):
        self.device = device
        self.library = library
        self.config = config
        self.config_name = config_name
        self.dtype = dtype
        self.esize = DTYPE_BYTES[dtype]
        self.weights = weights
        self.kernel_names = kernel_names  # role -> artifact name (contract.kernels.llama_kernels)
        self.kernels: dict = {}  # role -> Kernel, compiled for the roles the options use (`compile_roles`)
        self.options = options  # as loaded (resolved); a request's options are merged over them
        self.run = options  # the options of the passes being submitted (`use`)
        self.kv = PagedKVCache(device, config, self.esize, options.max_context)
        self.cached_ids: list[int] = []  # the token ids whose K/V the cache holds, in order
        # Attention kernels: "prefill", "tiled", "merge" and (variant, split) for the sharded family,
        # compiled for what this adapter runs (`compile_attention`).
        self.attention_names = attention_names
        self.attention: dict = {}
        self.tiled_defect = tiled_defect(library.specs[attention_names["tiled"]])  # why tiled must not run
        self.sharded_variants = frozenset(v for v in SHARDED_VARIANTS if (v, False) in attention_names)
        self.runs_subgroups = ("subgroup", False) in attention_names
        self.buffers: dict = {}
        self._scratch_tokens = 0
        # Decode passes (n = 1) dispatch the same kernels on the same buffers every step: their
        # bind groups are made once per plan, and only attention's and the sampler's values change.
        # Once a plan has run, its passes are recorded and later steps replay them (in the page,
        # with one call into JS).
        self._plans: dict[PlanKey, DispatchPlan] = {}
        self._recorded: dict[PlanKey, object] = {}
        self._stamps = None
        # MAX_PIPELINE_DEPTH readback buffers, used in turn; `_in_flight` holds the unfinished passes.
        self._staging: list = []
        self._in_flight: list[PendingPass] = []
        self._passes_submitted = 0
        self._inputs_written: dict[str, tuple] = {}  # name -> (buffer, bytes) last written (`_write_changed`)
        self._last_finish = 0.0
        self.stats: list[StepStats] = []

    # -- options and the attention kernels they need -------------------------------------------------
    async def compile_attention(self, variant: str | None = None, split: bool | None = None) -> None:
        """Compile the prefill and tiled kernels and a sharded-family variant's: over the whole
        context, and (`split`, default on GPUs) split + the merge. `variant` defaults to what this
        adapter's rule picks."""
        if variant is None:
            variant = self._pick_variant([self.kv.capacity]).variant
        split = not self.device.is_cpu if split is None else split
        wanted = [key for key in ["prefill", "tiled", (variant, False)] + ([(variant, True), "merge"] if split else [])
                  if key not in self.attention]
        if any(key not in self.attention_names for key in wanted):
            raise ModelError(f"the kernel artifact has no {variant!r} decode attention for this model")
        compiled = await self.library.kernels(self.attention_names[key] for key in wanted)  # concurrently
        self.attention.update(zip(wanted, compiled))

    async def compile_roles(self, fold_norms: bool, greedy: bool = True) -> None:
        """Compile the model kernels a forward pass with these folds and this token choice runs."""
        wanted = [role for role in forward_roles(fold_norms, greedy) if role not in self.kernels]
        self.kernels.update(zip(wanted, await self.library.kernels(self.kernel_names[r] for r in wanted)))

    async def use(self, request: RunOptions | None, sampling=None) -> None:
        """Make `request` (merged over the loaded options) the options of the next passes: checked
        here once, the kernels it needs (a forced variant's, other folds', the sampler) compiled."""
        run = self.options.merged(request)
        await self.compile_roles(run.fold_norms, sampling is None or sampling.greedy)
        if run.variant is not None:
            choice = parse_sharded_override(run.variant)
            if choice.variant == "subgroup" and not self.runs_subgroups:
                raise ModelError("this device cannot run the subgroup kernels")
            if choice.variant not in self.sharded_variants:
                raise ModelError(f"the artifact has no {choice.variant!r} kernels for this model")
            await self.compile_attention(choice.variant, split=True)
        if run.fold_norms != self.run.fold_norms:
            self._drop_plans()  # a plan's dispatches follow the folds
        self.run = run

    def _pick_variant(self, contexts: list[int]) -> AttentionChoice:
        return pick_sharded_variant(contexts, self.config.attention_shape, is_cpu=self.device.is_cpu,
                                    subgroups=self.runs_subgroups, available=self.sharded_variants,
                                    max_rows=MAX_SPLITS, override=self.run.variant)

    # -- scratch buffers ----------------------------------------------------------------------
    @staticmethod
    def scratch_sizes(c: LlamaConfig, e: int, n: int, capacity: int) -> dict[str, int]:
        """Bytes of each activation buffer for passes of up to `n` tokens (`e` bytes per element)
        with a KV cache of `capacity` tokens."""
        return {
            "ids": 4 * n, "positions": 4 * n, "slots": 4 * n,
            "x_a": e * n * c.dim, "x_b": e * n * c.dim, "normed": e * n * c.dim,
            "qkv": e * n * c.qkv_dim, "q": e * n * c.n_heads * c.head_dim,
            "attn": e * n * c.n_heads * c.head_dim, "lse": 4 * n * c.n_heads,
            "gate_up": e * n * 2 * c.ffn_dim, "ffn": e * n * c.ffn_dim,
            # decode attention's page table (one sequence; prefill attention reads page_ids too)
            "indptr": 4 * 2, "page_ids": 4 * PagedKVCache.pages_for(capacity), "last_len": 4,
            # TVM's decode signature has RoPE offsets; RoPE is applied at append (rotary_mode 0), so
            # the kernels never read them: one zero-filled word serves both.
            "rope_offsets": 4,
            **split_workspace_bytes(MAX_SPLITS, c.attention_shape),
        }

    def ensure_scratch(self, tokens: int) -> None:
        """Activation buffers for up to `tokens` tokens per pass (grown on demand, never shrunk)."""
        if tokens <= self._scratch_tokens:
            return
        c, e, dev = self.config, self.esize, self.device
        # A power of two: prompts of other lengths then fit the same buffers, so the plans bound
        # to them (model_glue.kernel.DispatchPlan) live on.
        n = 1 << (max(tokens, 1) - 1).bit_length()
        for name, size in self.scratch_sizes(c, e, n, self.kv.capacity).items():
            if name in self.buffers:
                dev.destroy(self.buffers[name])  # passes already submitted keep it alive until done
            self.buffers[name] = dev.storage_buffer(size)
        self._drop_plans()  # they bound the old buffers
        for name, size in {"last": e * c.dim, "logits": 4 * c.vocab_size, "next_id": 4}.items():
            if name not in self.buffers:  # one-token buffers never grow
                self.buffers[name] = dev.storage_buffer(size)
        if dev.has_timestamps and self._stamps is None:
            # Each layer's attention, then the whole pass (SPAN_BEGIN, SPAN_END); reused every pass:
            # query sets are scarce. A pass copies them out before the next one writes them.
            self._stamps = dev.timestamps(2 * c.n_layers + 2)
        if not self._staging:
            stamp_bytes = 8 * self._stamps.count if self._stamps is not None else 0
            self._staging = [dev.staging_buffer(STAMPS_OFFSET + stamp_bytes) for _ in range(MAX_PIPELINE_DEPTH)]
        self._scratch_tokens = n

    def _drop_plans(self) -> None:
        for plan in self._plans.values():
            plan.release()
        self._plans.clear()
        self._recorded.clear()

    # -- passes in flight ---------------------------------------------------------------------------
    async def forward(self, token_ids: list[int], sampling=None, draw: float = 0.0) -> int:
        """Run `token_ids` (appended to the cache) and return the next token id: the argmax, or
        with a non-greedy `sampling` (model_glue.generate.Sampling) the token `draw` picks."""
        return await self.finish(self.submit(token_ids, sampling, draw))

    def submit(self, token_ids: list[int] | None, sampling=None, draw: float = 0.0,
               kind: str | None = None) -> PendingPass:
        """Encode and submit one pass without waiting for it; `finish` reads its token id.

        `token_ids=None` runs one token whose id is still on the GPU: the one the last submitted
        pass chose. So a decode step can be submitted before the previous step's id is read back.
        `sampling` None is greedy. `kind` labels the pass in the stats (default: "prefill" for
        several tokens, else "decode"; a prompt's last chunk may be one token).
        """
        started = time.perf_counter()  # the step time covers encoding, GPU work and readback
        n = 1 if token_ids is None else len(token_ids)
        if n == 0:
            raise ModelError("nothing to run: the prompt is empty")
        if token_ids is None and not self._in_flight and not self.cached_ids:
            raise ModelError("no token on the GPU to continue from: run the prompt first")
        if len(self._in_flight) >= self.run.pipeline_depth:
            raise ValueError(f"at most {self.run.pipeline_depth} passes can be in flight: finish one first")
        greedy = sampling is None or sampling.greedy
        start = self.kv.length
        context = start + n  # the last token sees the prefix and every token of the pass
        try:  # a decode step asks which nest; a prefill pass always runs the causal prefill kernel
            nest = pick_decode_nest([context], self.run.attention, self.tiled_defect) if n == 1 else "prefill"
        except ValueError as err:
            raise ModelError(str(err)) from err
        choice = self._pick_variant([context]) if nest == "sharded" else AttentionChoice(nest)
        slots = self.kv.reserve(n)
        self.ensure_scratch(n)
        if token_ids is not None:
            self.cached_ids.extend(token_ids)  # an id still on the GPU is added by the `finish` that reads it
        _, page_ids, _ = self._write_inputs(token_ids, start, slots, context)

        stamps = self._stamps
        staging = self._staging[self._passes_submitted % MAX_PIPELINE_DEPTH]
        self._passes_submitted += 1
        batch = self.device.batch()
        key = PlanKey(choice.variant, choice.split, greedy)
        recorded = self._recorded.get(key) if n == 1 and self.run.replay else None
        if recorded is not None:  # a decode pass as before: new per-step values, the same dispatches
            self._plans[key].refresh(self._per_step_values(choice, len(page_ids), sampling, draw))
            batch.replay(recorded)
        else:
            # A prefill pass goes through a plan too, every value per step (n differs): its dispatches
            # are bound once, and a later prompt only rewrites a few uniforms.
            plan = self._plans.setdefault(key, DispatchPlan())
            record = n == 1 and self.run.replay
            batch.tape = [] if record else None
            self._encode_forward(PassEncoder(batch, stamps, plan, every_value_per_step=n > 1), n, choice,
                                 len(page_ids), sampling, draw)
            if record:
                self._recorded[key] = self.device.record(batch.stop_recording(), plan.per_step_bounds)
        # One readback per pass: the chosen id, then the raw timestamps, copied side by side.
        batch.copy(self.buffers["next_id"], 0, staging, 0, 4)
        if stamps is not None:
            batch.resolve(stamps)
            batch.copy(stamps.resolved, 0, staging, STAMPS_OFFSET, 8 * stamps.count)
        batch.submit()
        self.device.start_read(staging, self._readback_bytes())  # mapped once the pass is done
        stats = StepStats(kind or ("prefill" if n > 1 else "decode"), n, context, nest, str(choice), None, 0.0,
                          encode_ms=round((time.perf_counter() - started) * 1e3, 3), dispatches=batch.dispatches)
        step = PendingPass(staging, n, start, token_ids is None, stats, started)
        self._in_flight.append(step)
        return step

    def _write_inputs(self, token_ids, start: int, slots: list[int], context: int):
        """The pass's ids (a one-token pass reads its id where the last pass's argmax wrote), positions,
        K/V slots and page table."""
        buf = self.buffers
        indptr, page_ids, last_len = self.kv.page_table([context])
        if token_ids is not None:
            self.device.write(buf["ids"] if len(token_ids) > 1 else buf["next_id"], array("i", token_ids).tobytes())
        self._write_changed("positions", array("i", range(start, start + len(slots))).tobytes())
        self._write_changed("slots", array("i", slots).tobytes())
        self._write_changed("indptr", indptr.tobytes())  # the page table changes once per page of tokens
        self._write_changed("page_ids", page_ids.tobytes())
        self._write_changed("last_len", last_len.tobytes())
        return indptr, page_ids, last_len

    def _write_changed(self, name: str, data: bytes) -> None:
        """Write an input only the host writes, unless it already holds `data` (each write is a few
        calls into JS in the page)."""
        buffer = self.buffers[name]
        written = self._inputs_written.get(name)
        if written is not None and written[0] is buffer and written[1] == data:
            return
        self.device.write(buffer, data)
        self._inputs_written[name] = (buffer, data)

    async def finish(self, step: PendingPass) -> int:
        """Wait for a submitted pass, record its stats and return the token id it chose."""
        waited = time.perf_counter()
        next_id, ticks = await self._read_back(step)
        now = time.perf_counter()
        if self._in_flight and self._in_flight[0].input_on_gpu:
            self.cached_ids.append(next_id)  # the next pass, already submitted, was fed this id on the GPU
        stats = step.stats
        stats.timing_note = "no timestamp-query on this adapter"
        if ticks is not None:
            layers = self.config.n_layers
            stats.gpu_ms = (ticks[2 * layers + 1] - ticks[2 * layers]) / 1e6
            spans = [ticks[2 * i + 1] - ticks[2 * i] for i in range(layers)]
            stats.attention_ms = sum(spans) / 1e6
            stats.timing_note = "quantized timestamps (100 us steps)" if all(s % 100_000 == 0 for s in spans) else ""
        stats.wait_ms = round((now - waited) * 1e3, 3)
        # Pipelined steps overlap: a step's time runs from when the previous id arrived (or from its
        # own start, if that is later) to when its own id arrives.
        stats.step_ms = (now - max(step.started, self._last_finish)) * 1e3
        self._last_finish = now
        self.stats.append(stats)
        return next_id

    async def discard(self, steps: list[PendingPass]) -> None:
        """Undo the last submitted passes (steps run ahead that are not wanted), oldest first: their
        K/V slots are forgotten and they leave no stats. Waits for them, since their readback
        buffers are reused."""
        if not steps:
            return
        last = steps[-1]
        if last.start + last.tokens != self.kv.length:
            raise ValueError("only the last submitted passes can be discarded")
        for step in steps:
            await self._read_back(step)
        self.rollback(steps[0].start)

    async def _read_back(self, step: PendingPass) -> tuple[int, list[int] | None]:
        if not self._in_flight or self._in_flight[0] is not step:
            raise ValueError("passes must be finished in the order they were submitted")
        self._in_flight.pop(0)
        stamps = self._stamps
        raw = await self.device.read_staging(step.staging, self._readback_bytes())
        (next_id,) = struct.unpack_from("<i", raw)
        ticks = list(memoryview(raw)[STAMPS_OFFSET:].cast("Q")) if stamps is not None else None
        return next_id, ticks

    def _readback_bytes(self) -> int:
        """A pass's readback: its id, then its timestamps."""
        return STAMPS_OFFSET + (8 * self._stamps.count if self._stamps is not None else 0)

    def reset(self) -> None:
        self.kv.reset()
        self.cached_ids.clear()
        self.stats.clear()
        for step in self._in_flight:  # passes left unfinished (an error midway) are abandoned
            self.device.cancel_read(step.staging)
        self._in_flight.clear()

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens (a new turn reuses that prefix)."""
        self.kv.truncate(length)
        del self.cached_ids[length:]

    async def read_logits(self) -> bytes:
        """The last pass's logits as raw f32 bytes (tests compare them with a reference)."""
        return await self.device.read(self.buffers["logits"], 4 * self.config.vocab_size)

    @property
    def replayed_by(self) -> list[str]:
        """What replays recorded decode passes: RecordedPasses (Python) or BrowserRecordedPasses (JS)."""
        return sorted({type(recorded).__name__ for recorded in self._recorded.values()})

    # -- attention calls ------------------------------------------------------------------------------
    def _attention_kernels(self, choice: AttentionChoice) -> list:
        """The dispatches of one attention call: prefill, tiled, a variant over the whole context, or
        a variant's split kernel and the merge that combines the S partial results."""
        if choice.variant in ("prefill", "tiled"):
            return [self.attention[choice.variant]]
        key = (choice.variant, choice.split)
        if key not in self.attention:
            raise ModelError(f"decode attention {choice} is not compiled (see LlamaModel.compile_attention)")
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
            page_table_values=buf["page_ids"], length_info=buf["last_len"], k_rope_pos_offset=buf["rope_offsets"],
            q_rope_position=buf["rope_offsets"], output=buf["attn"], lse=buf["lse"], batch=n, nnz_pages=nnz_pages,
            max_num_pages=self.kv.num_pages, sm_scale=c.head_dim ** -0.5, rope_theta=c.rope_theta,
            workspace={name: buf[name] for name in SPLIT_WORKSPACE}, num_splits=choice.num_splits)

    def _per_step_values(self, choice: AttentionChoice, nnz_pages: int, sampling, draw: float) -> list:
        """(kernel, values) of each kernel of a decode pass whose values change per step: attention
        (the context grows) and the sampler (a new draw)."""
        buffers, values = self._attention_call(0, 1, nnz_pages, choice)
        pairs = [(kernel, v) for kernel, _, v in attention_dispatches(self._attention_kernels(choice), buffers, values)]
        if sampling is not None and not sampling.greedy:
            pairs.append((self.kernels["sample"], sampling.kernel_values(draw)))
        return pairs

    # -- the forward pass -------------------------------------------------------------------------------
    def _matmul(self, enc: PassEncoder, role: str, n: int, weight: str, x, y, *, norm=None, resid=None) -> None:
        """y = x @ W^T with the role's folds; `weight` names the q4 matrix (its .q4/.scale/.min tensors)."""
        w = self.weights
        buffers = {"x": x, "w": w[f"{weight}.q4"], "scale": w[f"{weight}.scale"], "wmin": w[f"{weight}.min"], "y": y}
        if norm is not None:
            buffers["norm"] = w[norm]
        if resid is not None:
            buffers["resid"] = resid
        enc.run(self.kernels[f"{role}_{'decode' if n == 1 else 'prefill'}"], buffers, {"n": n})

    def _normed_matmul(self, enc, role: str, n: int, weight: str, x, y, norm: str) -> None:
        """norm(x) @ W^T: the RMSNorm folded into the matmul, or (CPU rasterizers) run before it."""
        if self.run.fold_norms:
            self._matmul(enc, f"norm_{role}", n, weight, x, y, norm=norm)
        else:
            normed = self.buffers["normed"]
            enc.run(self.kernels["rms_norm"], {"x": x, "weight": self.weights[norm], "out": normed}, {"n": n})
            self._matmul(enc, role, n, weight, normed, y)

    def _swiglu_ffn(self, enc, n: int, weight: str, x, h, norm: str) -> None:
        """h = silu(norm(x) @ Wg^T) * (norm(x) @ Wu^T), folded into one matmul or in three kernels."""
        if self.run.fold_norms:
            self._matmul(enc, "norm_gate_up_swiglu", n, weight, x, h, norm=norm)
        else:
            gate_up = self.buffers["gate_up"]
            self._normed_matmul(enc, "gate_up", n, weight, x, gate_up, norm)
            enc.run(self.kernels["swiglu"], {"gate_up": gate_up, "h": h}, {"n": n})

    def _encode_forward(self, enc: PassEncoder, n: int, choice: AttentionChoice, nnz_pages: int, sampling,
                        draw: float) -> None:
        """The whole forward pass of n tokens as kernel dispatches."""
        c, w, buf, k = self.config, self.weights, self.buffers, self.kernels
        attention = self._attention_kernels(choice)
        x, x_mid = buf["x_a"], buf["x_b"]
        pass_begin, pass_end = 2 * c.n_layers, 2 * c.n_layers + 1  # timestamps of the whole pass
        with enc.timed(pass_begin, None):
            # a one-token pass embeds the id the last pass chose (or the host wrote) in next_id
            enc.run(k["embed"], {"ids": buf["ids"] if n > 1 else buf["next_id"], "q8": w["embed.q8"],
                                 "scale": w["embed.scale"], "out": x}, {"n": n})
        for layer in range(c.n_layers):
            p = f"layers.{layer}"
            # attention block: x_mid = x + o(attention(rope(qkv(norm(x)))))
            self._normed_matmul(enc, "qkv", n, f"{p}.qkv", x, buf["qkv"], f"{p}.attn_norm")
            enc.run(k["rope_append"], {"qkv": buf["qkv"], "positions": buf["positions"], "slots": buf["slots"],
                                       "pages": self.kv.layers[layer], "q": buf["q"]},
                    {"n": n, "num_pages": self.kv.num_pages})
            attn_buffers, attn_values = self._attention_call(layer, n, nnz_pages, choice)
            with enc.timed(2 * layer, 2 * layer + 1):
                for kernel, kernel_buffers, values in attention_dispatches(attention, attn_buffers, attn_values):
                    enc.run(kernel, kernel_buffers, values, per_step=True)
            self._matmul(enc, "o_residual", n, f"{p}.o", buf["attn"], x_mid, resid=x)
            # feed-forward block: x = x_mid + down(swiglu(gate_up(norm(x_mid))))
            self._swiglu_ffn(enc, n, f"{p}.gate_up", x_mid, buf["ffn"], f"{p}.ffn_norm")
            self._matmul(enc, "down_residual", n, f"{p}.down", buf["ffn"], x, resid=x_mid)
        # head: only the last token's logits are needed (a decode pass's x is that token already)
        last = x
        if n > 1:
            enc.batch.copy(x, (n - 1) * c.dim * self.esize, buf["last"], 0, c.dim * self.esize)
            last = buf["last"]
        head = {"w": w["embed.q8"], "scale": w["embed.scale"], "y": buf["logits"]}  # the tied embedding, q8
        with enc.timed(None, pass_end):
            if self.run.fold_norms:
                enc.run(k["norm_lm_head"], {"x": last, "norm": w["final_norm"], **head}, {"n": 1})
            else:
                enc.run(k["rms_norm"], {"x": last, "weight": w["final_norm"], "out": buf["normed"]}, {"n": 1})
                enc.run(k["lm_head"], {"x": buf["normed"], **head}, {"n": 1})
            if sampling is None or sampling.greedy:
                enc.run(k["argmax"], {"logits": buf["logits"], "out": buf["next_id"]}, {})
            else:  # the draw changes every step
                enc.run(k["sample"], {"logits": buf["logits"], "out": buf["next_id"]}, sampling.kernel_values(draw),
                        per_step=True)
