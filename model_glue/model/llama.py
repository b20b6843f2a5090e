"""A Llama-shaped model on WebGPU: its weights, kernels, KV cache and activation buffers, and the
passes that run it.

`submit` encodes one pass (model_glue.model.forward, the forward pass itself) through a bound plan or a
recorded replay and hands it to the pipeline of passes in flight (model_glue.model.pipeline); `finish`
reads its token id back and records its statistics (model_glue.model.step_stats). Every decode step asks
model_glue.model.attention which kernels run: the tiled nest up to 256 tokens, above that the sharded nest
in the layout and split count this adapter's rule picks; a pass of several tokens runs the causal
prefill kernel. Loading is model_glue.loading, generation model_glue.model.generate. No numpy and no TVM:
the same code runs in Pyodide and natively.
"""

from __future__ import annotations

import time
from array import array

from contract.attention import AttentionChoice
from contract.model import DTYPE_BYTES, LlamaConfig
from contract.slices import vocab_row_bytes, vocab_slices
from contract.kernels import (Matmul, int8_x_form, matmul_role, matmul_subgroup_lanes,
                              o_merge_matmul, prefill_matrix)
from model_glue.model.attention import AttentionKernels
from model_glue.errors import ModelError
from model_glue.model.forward import (LeavingOutEncoder, PassEncoder, ProfilingEncoder, encode_forward, forward_roles,
                                      per_step_values)
from model_glue.gpu.kernel import DispatchPlan
from model_glue.model.kv_cache import PagedKVCache
from model_glue.options import RunOptions
from model_glue.model.pass_plan import PREFILL_ON_MATRICES, PassPlan
from model_glue.model.pipeline import PassPipeline, PendingPass
from model_glue.policy import DECODE_BATCH_MAX_TOKENS, choose_decode_attention, merges_in_o, short_token_tile
from model_glue.model.scratch import ScratchBuffers
from model_glue.model.step_stats import StepStats, stamp_count

def query_contexts(n: int, start: int) -> list[int]:
    """The prefix each of a pass's n tokens attends to, after `start` cached tokens (causal)."""
    return list(range(start + 1, start + n + 1))


class LlamaModel:
    """Weights on the GPU plus the kernels and scratch buffers of one model (made by
    model_glue.loading.load_model)."""

    def __init__(self, device, library, config: LlamaConfig, config_name: str, dtype: str, weights: dict,
                 kernel_specs: dict, attention: AttentionKernels, options: RunOptions,
                 prefill_matrix_why_not: str | None = None):
        self.device = device
        self.library = library
        self.config = config
        self.config_name = config_name
        self.dtype = dtype
        self.esize = DTYPE_BYTES[dtype]
        self.weights = weights
        self.requantized: tuple[str, ...] = ()  # matrices a GGUF held as floats, quantized at load (loading)
        self.matrix_bindings: dict[str, dict] = {}  # matrix -> its tensors by binding name (forward._matrix_buffers)
        # The vocabulary's row slices (contract.slices): one, the whole vocabulary, unless the embedding's
        # (or head's) tensors exceed one storage binding of this adapter; the embedding and the head run
        # a dispatch per slice.
        self.vocab_slices = vocab_slices(config, device.limits.get("maxStorageBufferBindingSize"))
        self.vocab_row_bytes = vocab_row_bytes(config)  # bytes a row of each vocabulary tensor, by suffix
        # role -> artifact name and the sizes it runs with (contract.kernels.llama_kernels: a kernel is
        # compiled for row widths, not for this model, so its row counts, vocabulary, eps and RoPE
        # values are runtime values)
        self.kernel_names = {role: spec.name for role, spec in kernel_specs.items()}
        self.kernel_values = {role: spec.values for role, spec in kernel_specs.items()}
        self.matmul_subgroup_lanes = matmul_subgroup_lanes(kernel_specs)  # lanes reduced by shuffles, or None
        self.int8_x = int8_x_form(kernel_specs)  # decode matmuls on int8 codes of x (with folded norms), or None
        # prefill matmuls on subgroup matrices are loaded; if not, why not (RunOptions.prefill_matrix)
        self.has_prefill_matrix = prefill_matrix(kernel_specs)
        self.prefill_matrix_why_not = None if self.has_prefill_matrix else prefill_matrix_why_not
        self.kernels: dict = {}  # role -> Kernel, compiled for the roles the options use (`compile_roles`)
        self.attention = attention  # the artifact's attention kernels that run this shape here
        self._attention_compiled: dict = {}  # artifact name -> Kernel (`compile_attention`)
        self.options = options  # as loaded (resolved); a request's options are merged over them
        self.run = options  # the options of the passes being submitted (`use`)
        self.kv = PagedKVCache(device, config, self.esize, options.max_context)
        self.cached_ids: list[int] = []  # the token ids whose K/V the cache holds, in order
        self.buffers = ScratchBuffers(device, config, self.esize, self.kv.capacity)
        # Each layer's attention, then the whole pass (model_glue.model.step_stats.PassStamps); reused by
        # every pass (query sets are scarce): a pass copies them out before the next one writes them.
        stamps = device.timestamps(stamp_count(config.n_layers)) if device.has_timestamps else None
        self.pipeline = PassPipeline(device, stamps)
        # Decode passes (n = 1) dispatch the same kernels on the same buffers every step: their
        # bind groups are made once per plan, and only attention's and the sampler's values change.
        # Once a plan has run, its passes are recorded and later steps replay them (in the page,
        # with one call into JS).
        self._plans: dict[PassPlan, DispatchPlan] = {}  # PassPlan.key -> its bound dispatches
        self._recorded: dict[PassPlan, object] = {}  # ... and their recording
        self._inputs_written: dict[str, tuple] = {}  # name -> (buffer, bytes) last written (`_write_changed`)
        self._last_pass_tokens = 0  # tokens of the last submitted pass (1: a decode step)
        self._all_stamps_written = False  # a pass has written every timestamp query (`_times_attention`)
        self.stats: list[StepStats] = []
        self.window_pages = 0  # the page ids the last pass's sliding-window table holds (`_write_inputs`)

    @property
    def runs_subgroups(self) -> bool:
        """Whether this device runs the subgroup layout for the model's shape."""
        return "subgroup" in self.attention.layouts

    # -- options and the kernels they need ---------------------------------------------------------------
    async def compile_attention(self, layout: str | None = None, split: bool | None = None) -> None:
        """Compile the prefill and tiled kernels and a sharded layout's: over the whole context and
        (`split`, default on GPUs) its split kernel and the merge. `layout` defaults to what this
        adapter's rule picks for a long context."""
        if layout is None:
            layout = self._choose([self.kv.capacity], attention="sharded").layout
        split = not self.device.is_cpu if split is None else split
        choices = [AttentionChoice("tiled"), AttentionChoice("sharded", layout, 1)]
        choices += [AttentionChoice("sharded", layout, 2)] if split else []
        choices += [AttentionChoice("prefill")] if self.attention.prefill else []
        choices += [PREFILL_ON_MATRICES] if self.runs_prefill_attention_matrix() else []
        window = [c for c in choices if c.nest != "prefill"]  # the sliding-window layers' builds of the decode nests
        try:
            names = {name for choice in choices for name in self.attention.kernel_names(choice)}
            if self.attention.window is not None:
                names |= {name for choice in window for name in self.attention.window.kernel_names(choice)}
        except ValueError as err:
            raise ModelError(str(err)) from err
        await self._compile_attention_kernels(names)

    async def _compile_attention_kernels(self, names) -> None:
        wanted = sorted(set(names) - set(self._attention_compiled))
        self._attention_compiled.update(zip(wanted, await self.library.kernels(wanted)))  # concurrently

    async def compile_roles(self, fold_norms: bool, greedy: bool = True) -> None:
        """Compile the model kernels a forward pass with these folds and this token choice runs."""
        roles = forward_roles(fold_norms, greedy, o_merges=matmul_role(o_merge_matmul(self.config.arch)) in self.kernel_names,
                              int8_x=self.int8_x, prefill_matrix=self.has_prefill_matrix, arch=self.config.arch)
        wanted = [role for role in roles if role not in self.kernels]
        self.kernels.update(zip(wanted, await self.library.kernels(self.kernel_names[r] for r in wanted)))

    async def use(self, request: RunOptions | None, sampling=None) -> None:
        """Make `request` (merged over the loaded options) the options of the next passes: checked
        here once, the kernels it needs (a forced layout's, other folds', the sampler) compiled."""
        run = self.options.merged(request)
        if run.prefill_matrix and not self.has_prefill_matrix:
            raise ModelError(f"prefill_matrix was asked for, but {self.prefill_matrix_why_not or 'it was not loaded'}")
        if run.prefill_attention_matrix:
            self.check_prefill_attention_matrix(run)
        if self.runs_prefill_attention_matrix(run):
            await self._compile_attention_kernels(self.attention.kernel_names(PREFILL_ON_MATRICES))
        await self.compile_roles(run.fold_norms, sampling is None or sampling.greedy)
        if run.layout is not None:
            try:
                self.attention.check(run.layout)
            except ValueError as err:
                raise ModelError(str(err)) from err
            if self.attention.window is not None:
                try:
                    self.attention.window.check(run.layout)
                except ValueError as err:
                    raise ModelError(f"over the sliding window: {err}") from err
            await self.compile_attention(run.layout.layout, split=True)
        if run.fold_norms != self.run.fold_norms:
            self._drop_plans()  # a plan's dispatches follow the folds
        self.run = run

    def _choose(self, contexts: list[int], attention: str | None = None, window: bool = False) -> AttentionChoice:
        try:
            return choose_decode_attention(contexts, self.attention.window if window else self.attention,
                                           is_cpu=self.device.is_cpu, attention=attention or self.run.attention,
                                           forced=self.run.layout)
        except ValueError as err:
            raise ModelError(str(err)) from err

    def runs_prefill_matrix(self, run: RunOptions | None = None) -> bool:
        """Whether prefill passes run the matmuls' subgroup-matrix builds (RunOptions.prefill_matrix)."""
        run = run or self.run
        return bool(run.prefill_matrix) and self.has_prefill_matrix and run.fold_norms

    def runs_prefill_attention_matrix(self, run: RunOptions | None = None) -> bool:
        """Whether long prefill passes run the attention's subgroup-matrix build
        (RunOptions.prefill_attention_matrix): beside the matmuls' and where the artifact has it."""
        run = run or self.run
        return run.prefill_attention_matrix is not False and self.runs_prefill_matrix(run) \
            and bool(self.attention.prefill_matrix)

    def check_prefill_attention_matrix(self, run: RunOptions) -> None:
        """A ModelError where RunOptions.prefill_attention_matrix asks for what cannot run: it runs
        only beside the prefill matmuls' subgroup-matrix builds, where the artifact has it."""
        why = (f"the prefill matmuls' subgroup-matrix builds do not run ({self.prefill_matrix_why_not or 'not loaded'})"
               if not self.has_prefill_matrix else
               "it runs only beside the subgroup-matrix matmuls (prefill_matrix is false)" if run.prefill_matrix is False
               else None if self.attention.prefill_matrix else
               f"the kernel artifact has no subgroup-matrix prefill attention for {self.config.attention_shape}")
        if why:
            raise ModelError(f"prefill_attention_matrix was asked for, but {why}")

    def prefill_attention(self, n: int, start: int) -> AttentionChoice:
        """The attention of a prefill pass of n tokens after `start` cached ones. A short pass
        (RunOptions.short_prefill_decode_attention, at most DECODE_BATCH_MAX_TOKENS) runs the decode
        nests' kernels as a batch of its n tokens, each a query over its own prefix: the causal
        prefill kernel gives a KV head one workgroup for those few rows and walks the whole cached
        context serially. Else the causal prefill kernel: its subgroup-matrix build where it runs
        (`runs_prefill_attention_matrix`)."""
        if n <= DECODE_BATCH_MAX_TOKENS and (self.run.short_prefill_decode_attention or not self.attention.prefill):
            return self._choose(query_contexts(n, start))
        if not self.attention.prefill:
            raise ModelError(f"a pass of {n} tokens: this shape has no causal prefill kernel (head_dim "
                             f"{self.config.head_dim}), so its passes take at most {DECODE_BATCH_MAX_TOKENS} "
                             "(LlamaModel.prefill_chunk)")
        if self.runs_prefill_attention_matrix():
            return PREFILL_ON_MATRICES
        return AttentionChoice("prefill")

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens a prefill pass takes: the run's, or for a shape without a causal prefill kernel
        (head_dim over 128) at most what the decode kernels take as a batch of queries."""
        return self.run.prefill_chunk if self.attention.prefill else min(self.run.prefill_chunk, DECODE_BATCH_MAX_TOKENS)

    def window_attention(self, n: int, start: int, attention: AttentionChoice) -> AttentionChoice | None:
        """The attention of the pass's sliding-window layers (None: the model has none): the decode nests
        over each query's last `sliding_window` tokens, chosen by that length. Its split count is the
        other layers' (S is a per-step value of the merge, which both calls share)."""
        window = self.config.sliding_window
        if window is None:
            return None
        if attention.nest == "prefill":  # the causal kernel takes each layer's window as a value
            return attention
        choice = self._choose([min(c, window) for c in query_contexts(n, start)], window=True)
        if choice.nest == "sharded" and attention.nest == "sharded":
            choice = AttentionChoice(choice.nest, choice.layout, attention.num_splits)
        elif choice.nest == "sharded":  # the others tiled: the window's no longer than the context
            choice = AttentionChoice(choice.nest, choice.layout, 1)
        return choice

    def plan_pass(self, n: int, start: int, greedy: bool = True) -> PassPlan:
        """Every choice of a pass of n tokens after `start` cached ones, by model_glue.policy's rules:
        its attention; the int8_x decode matmuls (one-token passes with the norms folded, where loaded);
        where a split call's merge runs (the int8 quantizer before o where int8_x runs, else the
        o-projection where the shape has that build and the rule says it pays, else the merge
        dispatch); the prefill matmuls' builds and token tile."""
        run, context = self.run, start + n
        attention = self._choose([context]) if n == 1 else self.prefill_attention(n, start)
        int8_x = self.int8_x if n == 1 and run.fold_norms else None
        quantizer_merges = attention.split and int8_x is not None
        window = self.window_attention(n, start, attention)
        # every layer's call split alike (a window layer's may run unsplit, the tiled nest): only then o merges
        splits_alike = window is None or window.split
        o_merges = (n == 1 and not quantizer_merges and splits_alike
                    and matmul_role(o_merge_matmul(self.config.arch)) in self.kernel_names
                    and merges_in_o(self.config, self.dtype, attention, run.merge_in_o))
        matrix = n > 1 and self.runs_prefill_matrix()
        return PassPlan(n, attention, greedy, run.fold_norms, one_pass=not self._times_attention(n, context),
                        window_attention=window,
                        o_merges=o_merges, quantizer_merges=quantizer_merges, int8_x=int8_x, matrix_matmuls=matrix,
                        short_tile=n > 1 and short_token_tile(n, matrix))

    def attention_kernels(self, choice: AttentionChoice, window: bool = False) -> list:
        """The compiled kernels of one attention call (`window`: over the sliding window), in dispatch order."""
        names = (self.attention.window if window else self.attention).kernel_names(choice)
        missing = [name for name in names if name not in self._attention_compiled]
        if missing:
            raise ModelError(f"decode attention {choice} is not compiled (see LlamaModel.compile_attention)")
        return [self._attention_compiled[name] for name in names]

    # -- scratch buffers ------------------------------------------------------------------------------------
    def ensure_scratch(self, tokens: int) -> None:
        """Activation buffers for up to `tokens` tokens per pass (model_glue.model.scratch)."""
        if self.buffers.ensure(tokens):
            self._drop_plans()  # they bound the old buffers

    def _drop_plans(self) -> None:
        for plan in self._plans.values():
            plan.release()
        self._plans.clear()
        self._recorded.clear()

    # -- passes -----------------------------------------------------------------------------------------
    async def forward(self, token_ids: list[int], sampling=None, draw: float = 0.0) -> int:
        """Run `token_ids` (appended to the cache) and return the next token id: the argmax, or
        with a non-greedy `sampling` (model_glue.model.generate.Sampling) the token `draw` picks."""
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
        if token_ids is None and not self.pipeline.in_flight and not self.cached_ids:
            raise ModelError("no token on the GPU to continue from: run the prompt first")
        self.pipeline.check_room(self.run.pipeline_depth)
        start = self.kv.length
        context = start + n  # the last token sees the prefix and every token of the pass
        plan = self.plan_pass(n, start, greedy=sampling is None or sampling.greedy)
        slots = self.kv.reserve(n)
        self.ensure_scratch(n)
        if token_ids is not None:
            self.cached_ids.extend(token_ids)  # an id still on the GPU is added by the `finish` that reads it
        nnz_pages = self._write_inputs(token_ids, start, slots,
                                       [context] if plan.attention.nest == "prefill" else query_contexts(n, start))

        batch = self.device.batch()
        recorded = self._recorded.get(plan.key) if n == 1 and self.run.replay else None
        if recorded is not None:  # a decode pass as before: new per-step values, the same dispatches
            self._plans[plan.key].refresh(per_step_values(self, plan, nnz_pages, sampling, draw))
            batch.replay(recorded)
        else:
            # A prefill pass goes through a plan too, every value per step (n differs): its dispatches
            # are bound once, and a later prompt only rewrites a few uniforms.
            bound = self._plans.setdefault(plan.key, DispatchPlan())
            record = n == 1 and self.run.replay
            batch.tape = [] if record else None
            encode_forward(self, PassEncoder(batch, self.pipeline.stamps, bound, every_value_per_step=n > 1,
                                             one_pass=plan.one_pass), plan, nnz_pages, sampling, draw)
            if record:
                self._recorded[plan.key] = self.device.record(batch.stop_recording(), bound.per_step_bounds)
        stats = StepStats(kind or ("prefill" if n > 1 else "decode"), n, context, plan.attention.nest,
                          plan.kernel_label, None, 0.0, timing_note=plan.timing_note)
        self._last_pass_tokens = n
        self._all_stamps_written |= not plan.one_pass
        return self.pipeline.submit(batch, self.buffers["next_id"], stats, start=start,
                                    input_on_gpu=token_ids is None, started=started, attention_timed=not plan.one_pass)

    def _times_attention(self, n: int, context: int) -> bool:
        """Whether this pass times each layer's attention (else it is one compute pass): every prefill,
        and decode steps as RunOptions.time_attention_every says: the context a multiple of N, or the
        first step after a prompt. Every query is resolved after each pass, and one never written can
        hang the resolve on some drivers: so until a pass has written all of them, every pass does."""
        every = self.run.time_attention_every
        if n > 1 or every == 1 or not self._all_stamps_written:
            return True
        return every > 0 and (context % every == 0 or self._last_pass_tokens != 1)

    def _write_inputs(self, token_ids, start: int, slots: list[int], contexts: list[int]) -> int:
        """The pass's ids (a one-token pass reads its id where the last pass's argmax wrote), positions,
        K/V slots and page table (a decode batch's: one prefix per query, `contexts` long); returns
        the page ids the table holds."""
        buf = self.buffers
        indptr, page_ids, last_len = self.kv.page_table(contexts)
        if token_ids is not None:
            self.device.write(buf["ids"] if len(token_ids) > 1 else buf["next_id"], array("i", token_ids).tobytes())
        self._write_changed("positions", array("i", range(start, start + len(slots))).tobytes())
        self._write_changed("slots", array("i", slots).tobytes())
        self._write_changed("indptr", indptr.tobytes())  # the page table changes once per page of tokens
        self._write_changed("page_ids", page_ids.tobytes())
        self._write_changed("last_len", last_len.tobytes())
        if self.config.sliding_window is not None:
            indptr, page_ids, length_info = self.kv.window_page_table(contexts, self.config.sliding_window)
            self._write_changed("window_indptr", indptr.tobytes())
            self._write_changed("window_page_ids", page_ids.tobytes())
            self._write_changed("window_length_info", length_info.tobytes())
            self.window_pages = len(page_ids)
        return len(page_ids)

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
        next_id = await self.pipeline.finish(step, self.config.n_layers)
        in_flight = self.pipeline.in_flight
        if in_flight and in_flight[0].input_on_gpu:
            self.cached_ids.append(next_id)  # the next pass, already submitted, was fed this id on the GPU
        self.stats.append(step.stats)
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
            await self.pipeline.read_back(step)
        self.rollback(steps[0].start)

    def _lone_decode_step(self) -> tuple[int, PassPlan, int]:
        """A greedy decode step after the cached context, outside the pipeline (the profiler's): its
        position, plan and used pages, its K/V slot reserved and its inputs written."""
        start = self.kv.length
        plan = self.plan_pass(1, start)
        slots = self.kv.reserve(1)
        self.ensure_scratch(1)
        return start, plan, self._write_inputs(None, start, slots, [start + 1])

    async def profile_decode_step(self, stamps, in_pass: bool = False) -> tuple[AttentionChoice,
                                                                                list[tuple[str, dict, int]]]:
        """One greedy decode step after the cached context, every dispatch timed: in a pass of its own,
        or (`in_pass`) between its neighbours in the step's one pass
        (model_glue.model.forward.ProfilingEncoder; `stamps` holds exactly two queries per dispatch),
        then the model is reset (the step overwrote the last id). Returns the step's attention choice
        and (kernel name, bound buffers, GPU ns) per dispatch, in order."""
        if in_pass and not self.device.timestamps_inside_passes:
            raise ModelError("profiling inside the pass needs an adapter that writes timestamps inside passes")
        if self.pipeline.in_flight or not self.cached_ids:
            raise ModelError("profile a step after a finished run, with no pass in flight")
        start, plan, nnz_pages = self._lone_decode_step()
        batch = self.device.batch()
        enc = ProfilingEncoder(batch, stamps, in_pass)
        encode_forward(self, enc, plan, nnz_pages, None, 0.0)
        if 2 * len(enc.dispatches) != stamps.count:  # resolve only written queries (unwritten ones can hang)
            batch.submit()
            self.reset()
            raise ValueError(f"the step has {len(enc.dispatches)} dispatches; pass {2 * len(enc.dispatches)} queries")
        batch.resolve(stamps)
        batch.submit()
        ticks = await stamps.read_ns()
        self.reset()
        return plan.attention, [(name, buffers, ticks[2 * i + 1] - ticks[2 * i]) for i, (name, buffers) in enumerate(enc.dispatches)]

    async def time_decode_step_leaving_out(self, stamps,
                                           leave_outs: list[frozenset[str]]) -> tuple[list[str], list[float]]:
        """One greedy decode step after the cached context, encoded once per entry of `leave_outs`, each
        a compute pass of its own timed as a whole that leaves out the dispatches of the kernels named
        in the entry (model_glue.model.forward.LeavingOutEncoder), all in one submission, so the GPU runs
        them back to back. `stamps` holds exactly two queries per entry. Returns the kernel names the
        whole step dispatches, in order, and each pass's GPU seconds. The cache keeps its tokens (the
        step's own K/V row is dropped); the next-id buffer holds whatever the last pass wrote."""
        if self.pipeline.in_flight or not self.cached_ids:
            raise ModelError("time a step after a finished run, with no pass in flight")
        if stamps.count != 2 * len(leave_outs):  # resolve only written queries (unwritten ones can hang)
            raise ValueError(f"{len(leave_outs)} passes need {2 * len(leave_outs)} queries, not {stamps.count}")
        start, plan, nnz_pages = self._lone_decode_step()
        batch = self.device.batch()
        names: list[str] = []
        for i, leave_out in enumerate(leave_outs):
            enc = LeavingOutEncoder(batch, leave_out)
            with batch.timed((stamps, 2 * i, 2 * i + 1), own_pass=True):
                encode_forward(self, enc, plan, nnz_pages, None, 0.0)
            names = names or enc.names
        batch.resolve(stamps)
        batch.submit()
        ticks = await stamps.read_ns()
        self.kv.truncate(start)
        return names, [(ticks[2 * i + 1] - ticks[2 * i]) * 1e-9 for i in range(len(leave_outs))]

    def reset(self) -> None:
        self.kv.reset()
        self.cached_ids.clear()
        self.stats.clear()
        self.pipeline.abandon()  # passes left unfinished (an error midway)

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens (a new turn reuses that prefix)."""
        self.kv.truncate(length)
        del self.cached_ids[length:]

    def release(self) -> None:
        """Free the model's GPU memory now (weights, KV cache, activations, plans); the model is unusable
        after. A page that loads another model drops the whole device instead."""
        self._drop_plans()
        for buffer in [*self.weights.values(), *self.kv.layers, *self.buffers.values()]:
            self.device.destroy(buffer)
        self.weights, self.kv.layers = {}, []
        self.buffers.clear()

    async def read_logits(self) -> bytes:
        """The last pass's logits as raw f32 bytes (tests compare them with a reference)."""
        return await self.device.read(self.buffers["logits"], 4 * self.config.vocab_size)

    @property
    def replayed_by(self) -> list[str]:
        """What replays recorded decode passes: RecordedPasses (Python) or BrowserRecordedPasses (JS)."""
        return sorted({type(recorded).__name__ for recorded in self._recorded.values()})
