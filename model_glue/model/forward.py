"""The forward pass of a Llama-shaped model as a fixed sequence of TVM-built kernel dispatches, read
top to bottom like llama2.c's run.c (`encode_forward`), and `PassEncoder`, through which every
dispatch goes: bound once through a plan, recorded for replay, bracketed by timestamps.

No numpy and no TVM: the same code runs in Pyodide and natively.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache

from contract.attention import AttentionChoice
from contract.family import FAMILIES, Family
from contract.kernels import (INT8_X_MATMULS, POST_NORM_MATMULS, SPLIT_WORKSPACE, Int8XForm, Matmul, Role,
                              folded_matmuls, matmul_role, o_merge_matmul, rope_values)
from contract.model import codes_tensor, head_tensor, layer_rope_theta, layer_window
from contract.slices import RowSlice
from model_glue.gpu.webgpu import BufferSlice
from model_glue.model.attention import attention_call, attention_dispatches
from model_glue.gpu.kernel import DispatchPlan
from model_glue.model.pass_plan import PassPlan
from model_glue.model.step_stats import PassStamps


def forward_roles(fold_norms: bool, greedy: bool = True, o_merges: bool = False, int8_x: Int8XForm | None = None,
                  prefill_matrix: bool = False, arch: Family = FAMILIES["llama"]) -> list[str]:
    """The kernel roles `encode_forward` dispatches (contract.kernels.llama_kernels): with the norms
    and SwiGLU folded into the matmuls (GPUs) or apart (CPU rasterizers), argmax or the sampler,
    (`o_merges`: the shape has it) the o-projection that merges a split attention call,
    (`int8_x`, with folded norms) the decode matmuls' int8_x builds and the quantizers their form
    dispatches, the prefill matmuls' short tiles
    and (`prefill_matrix`, with folded norms) their subgroup-matrix builds; the family's (`arch`)
    post-norms. Only these are compiled."""
    matmuls = folded_matmuls(arch, fold_norms)
    apart = [] if fold_norms else [Role.RMS_NORM, Role.SWIGLU]
    apart += [Role.NORM_RESIDUAL] if arch.post_norms else []
    fused = [matmul_role(Matmul.NORM_QKV_ROPE_APPEND)] if fold_norms and arch.fused_rope_append else []  # a decode step's qkv + RoPE + K/V append
    fused += [matmul_role(o_merge_matmul(arch))] if o_merges else []
    fused += [matmul_role(m) for m in POST_NORM_MATMULS.values()] if fold_norms and arch.post_norms else []
    if int8_x is not None and fold_norms:  # the int8_x forms of the decode matmuls and their quantizers
        fused += [matmul_role(m, int8_x=True) for m in INT8_X_MATMULS] + int8_x.quantizers()
    prefill = [matmul_role(m, prefill=True, short=short) for short in (False, True) for m in matmuls]
    if prefill_matrix and fold_norms:
        prefill += [matmul_role(m, prefill=True, short=short, matrix=True) for m in folded_matmuls(arch, True)
                    for short in (False, True)]
    return [Role.EMBED, Role.ROPE_APPEND, *(matmul_role(m) for m in matmuls), *prefill, *fused, *apart,
            Role.NORM_LM_HEAD if fold_norms else Role.LM_HEAD, Role.ARGMAX if greedy else Role.SAMPLE]


class PassEncoder:
    """Encodes one pass into a Batch. A decode pass goes through its DispatchPlan (bound once, the
    attention and sampler values refreshed per step) and onto a tape that later steps replay; a
    prefill pass goes through a plan of its own whose every value is per step (bound once, the
    uniforms rewritten for each pass's n). Without a plan each dispatch is bound for itself.
    `timed(begin, end)` brackets dispatches with the pass's timestamp queries (none on adapters
    without timestamp-query). `one_pass`: the whole pass is one compute pass, its first and last
    timestamps only (`whole_pass`); the spans inside it are not timed."""

    def __init__(self, batch, stamps, plan: DispatchPlan | None, every_value_per_step: bool = False,
                 one_pass: bool = False):
        self.batch, self.stamps, self.plan = batch, stamps, plan
        self.every_value_per_step = every_value_per_step  # a prefill pass: n changes every kernel's values
        self.one_pass = one_pass
        if plan is not None:
            plan.start()

    def run(self, kernel, buffers: dict, values: dict, per_step: bool = False) -> None:
        if self.plan is not None:
            self.plan.dispatch(self.batch, kernel, buffers, values, per_step=per_step or self.every_value_per_step)
            return
        dispatch_alone(self.batch, kernel, buffers, values)

    @contextmanager
    def timed(self, begin: int | None, end: int | None):
        if self.stamps is None or self.one_pass:
            yield
            return
        with self.batch.timed((self.stamps, begin, end)):
            yield

    @contextmanager
    def whole_pass(self, stamps: PassStamps):
        """With `one_pass`, the pass's dispatches in one compute pass timed at its start and end."""
        if self.stamps is None or not self.one_pass:
            yield
            return
        with self.batch.timed((self.stamps, stamps.pass_begin, stamps.pass_end)):
            yield


def dispatch_alone(batch, kernel, buffers: dict, values: dict) -> None:
    """Bind and dispatch a kernel for this pass only (no plan, nothing recorded)."""
    bound = kernel.bind(buffers, values)
    bound.dispatch(batch)
    bound.release_after(batch)


class SpansUntimed:
    """An encoder that times its dispatches its own way: the forward pass's spans write nothing."""

    @contextmanager
    def timed(self, begin: int | None, end: int | None):
        yield

    @contextmanager
    def whole_pass(self, stamps: PassStamps):
        yield


class ProfilingEncoder(SpansUntimed):
    """Encodes a pass with every dispatch timed (`python -m app bench decode --profile`): dispatch i
    writes timestamps 2i and 2i + 1, and its kernel's name and bound buffers are kept in `dispatches`.
    Each dispatch runs in a timed compute pass of its own, or (`in_pass`, on an adapter that writes
    timestamps inside passes) all run in one pass with the timestamps between them, as a step runs.
    The forward pass's own spans are left out (each dispatch is already timed alone)."""

    def __init__(self, batch, stamps, in_pass: bool = False):
        self.batch, self.stamps, self.in_pass = batch, stamps, in_pass
        self.dispatches: list[tuple[str, dict]] = []

    def run(self, kernel, buffers: dict, values: dict, per_step: bool = False) -> None:
        i = len(self.dispatches)
        bound = kernel.bind(buffers, values)
        if self.in_pass:
            with self.batch.timed((self.stamps, 2 * i, 2 * i + 1)):
                bound.dispatch(self.batch)
        else:
            bound.dispatch(self.batch, (self.stamps, 2 * i, 2 * i + 1))
        bound.release_after(self.batch)
        self.dispatches.append((kernel.name, buffers))


class LeavingOutEncoder(SpansUntimed):
    """Encodes a pass without the dispatches of the kernels named in `leave_out` (`python -m app bench
    decode --profile`'s in-step column): the caller times the pass as a whole, so that its difference
    from the whole step is what those kernels cost inside the step, their barriers and tails
    included. The result is wrong by design; only the time counts. Every dispatch's kernel name is
    kept in `names`, left out or not."""

    def __init__(self, batch, leave_out: frozenset[str]):
        self.batch, self.leave_out = batch, leave_out
        self.names: list[str] = []

    def run(self, kernel, buffers: dict, values: dict, per_step: bool = False) -> None:
        self.names.append(kernel.name)
        if kernel.name not in self.leave_out:
            dispatch_alone(self.batch, kernel, buffers, values)


# -- attention calls ------------------------------------------------------------------------------------
def attention_buffers(m, layer: int, n: int, nnz_pages: int, choice: AttentionChoice,
                      window: bool = False) -> tuple[dict, dict]:
    """Buffers and values of one layer's attention (the values are the same in every layer), or
    (`window`) of a sliding-window layer's: its page table covers the window (LlamaModel._write_inputs)."""
    c, buf = m.config, m.buffers
    if window:
        return attention_call(
            q=buf["q"], pages=m.kv.layers[layer], page_table_indptr=buf["window_indptr"],
            page_table_values=buf["window_page_ids"], length_info=buf["window_length_info"],
            k_rope_pos_offset=buf["rope_offsets"], q_rope_position=buf["rope_offsets"], output=buf["attn"],
            lse=buf["lse"], batch=n, nnz_pages=m.window_pages, max_num_pages=m.kv.num_pages,
            sm_scale=c.head_dim ** -0.5, rope_theta=c.rope_theta,
            workspace={name: buf[name] for name in SPLIT_WORKSPACE}, num_splits=choice.num_splits)
    if choice.nest == "prefill":  # the pass's n tokens after the kv.length - n cached before them
        return ({"q": buf["q"], "pages": m.kv.layers[layer], "page_ids": buf["page_ids"], "output": buf["attn"]},
                {"n": n, "num_pages": m.kv.num_pages, "used_pages": nnz_pages, "start": m.kv.length - n,
                 "sm_scale": c.head_dim ** -0.5, "window": layer_window(c, layer) or 0})  # 0: the whole causal prefix
    # RoPE was applied at append (adjacent pairs, as the GGUF's Q/K expect): rotary_mode 0.
    # The page table grows with the context: attention's values change every step.
    return attention_call(
        q=buf["q"], pages=m.kv.layers[layer], page_table_indptr=buf["indptr"],
        page_table_values=buf["page_ids"], length_info=buf["last_len"], k_rope_pos_offset=buf["rope_offsets"],
        q_rope_position=buf["rope_offsets"], output=buf["attn"], lse=buf["lse"], batch=n, nnz_pages=nnz_pages,
        max_num_pages=m.kv.num_pages, sm_scale=c.head_dim ** -0.5, rope_theta=c.rope_theta,
        workspace={name: buf[name] for name in SPLIT_WORKSPACE}, num_splits=choice.num_splits)


def pass_attention_kernels(m, plan: PassPlan, window: bool = False) -> list:
    """The attention kernels a pass dispatches (`window`: in its sliding-window layers): without the
    merge where the o-projection or its int8 quantizer merges the split call's partial states
    (PassPlan.merges_split)."""
    kernels = m.attention_kernels(plan.window_attention, window=True) if window else m.attention_kernels(plan.attention)
    return kernels[:-1] if plan.merges_split else kernels


def layer_attention_dispatches(m, plan: PassPlan, layer: int, nnz_pages: int) -> list[tuple]:
    """(kernel, buffers, values) of one layer's attention call. A sliding-window layer's merge runs with
    the other layers' values (the same B and S: the kernel is shared, and so is its uniform)."""
    buffers, values = attention_buffers(m, layer, plan.n, nnz_pages, plan.attention)
    if plan.window_attention is None or layer_window(m.config, layer) is None or plan.attention.nest == "prefill":
        return attention_dispatches(pass_attention_kernels(m, plan), buffers, values)
    window_buffers, window_values = attention_buffers(m, layer, plan.n, nnz_pages, plan.window_attention, window=True)
    dispatches = attention_dispatches(pass_attention_kernels(m, plan, window=True), window_buffers, window_values)
    return [(kernel, kernel_buffers, values if kernel.name == m.attention.merge else kernel_values)
            for kernel, kernel_buffers, kernel_values in dispatches]


def role_values(m, role: str, **pass_values) -> dict:
    """The values a model kernel runs with: the model's sizes it is not compiled for (its spec's
    `values`: row counts, vocabulary, eps, RoPE's) and the pass's (`n`, ...)."""
    return {**m.kernel_values[role], **pass_values}


def per_step_values(m, plan: PassPlan, nnz_pages: int, sampling, draw: float) -> list:
    """(kernel, values) of each kernel of a decode pass whose values change per step: attention
    (the context grows), the merging o-projection or quantizer (S may change) and the sampler (a new draw)."""
    choice = plan.attention
    layers = first_layer_of_each_kind(m.config)  # global and sliding-window calls differ in their values
    pairs = [(kernel, v) for layer in layers for kernel, _, v in layer_attention_dispatches(m, plan, layer, nnz_pages)]
    if plan.o_merges:
        merging = matmul_role(o_merge_matmul(m.config.arch))
        pairs.append((m.kernels[merging], role_values(m, merging, **o_merge_values(choice))))
    if plan.quantizer_merges:
        pairs.append((m.kernels[Role.QUANTIZE_MERGE], role_values(m, Role.QUANTIZE_MERGE,
                                                                      num_splits=choice.num_splits)))
    if sampling is not None and not sampling.greedy:
        pairs.append((m.kernels["sample"], role_values(m, "sample", **sampling.kernel_values(draw))))
    return pairs


@lru_cache(maxsize=16)  # asked every decode step; a config's layers never change
def first_layer_of_each_kind(c) -> tuple[int, ...]:
    """The first global layer and the first sliding-window one (where the model has them)."""
    first = {layer_window(c, i) is None: i for i in reversed(range(c.n_layers))}
    return tuple(sorted(first.values()))


def o_merge_values(choice: AttentionChoice) -> dict:
    return {"n": 1, "num_splits": choice.num_splits}


# -- the forward pass -------------------------------------------------------------------------------------
def _quantize_x(m, enc: PassEncoder, role: str, x, norm=None, values=None, per_step: bool = False) -> None:
    """x (times the norm's weight) as int8 codes and per-chunk stats in xq and xstats, for an int8_x
    decode matmul (kernels.quantize_x); `x` is a buffer, or the split call's partial states (a dict)."""
    buffers = dict(x) if isinstance(x, dict) else {"x": x}
    if norm is not None:
        buffers["norm"] = m.weights[norm]
    buffers.update({"xq": m.buffers["xq"], "xstats": m.buffers["xstats"]})
    enc.run(m.kernels[role], buffers, role_values(m, role, **(values or {})), per_step=per_step)


def _codes(m, prefix: str = "") -> dict:
    """The scratch pair that holds x's int8 codes and stats (`prefix` "ffn_": down's, from gate/up)."""
    return {"xq": m.buffers[f"{prefix}xq"], "xstats": m.buffers[f"{prefix}xstats"]}


def _matrix_buffers(m, name: str) -> dict:
    """A quantized matrix's tensors by their kernels' buffer names: its format's codes, scale, min
    (made once a model: every pass binds them; callers copy, never change, the dict)."""
    bound = m.matrix_bindings.get(name)
    if bound is None:
        w = m.weights
        bound = {"w": w[codes_tensor(m.config, name)], "scale": w[f"{name}.scale"]}
        if f"{name}.min" in w:
            bound["wmin"] = w[f"{name}.min"]
        m.matrix_bindings[name] = bound
    return bound


def _vocab_matrix(m, name: str) -> list[tuple[dict, RowSlice]]:
    """(tensors by buffer name, rows) of each of the model's vocabulary slices (LlamaModel.vocab_slices,
    contract.slices) of the embedding or the head ("embed", "head"): the whole matrix where it fits one
    binding (one slice), else each slice's BufferSlices. Made once a model, like `_matrix_buffers`."""
    key = f"{name}/slices"
    bound = m.matrix_bindings.get(key)
    if bound is None:
        whole = _matrix_buffers(m, name)
        if len(m.vocab_slices) == 1:
            bound = [(whole, m.vocab_slices[0])]
        else:
            suffix = {"w": codes_tensor(m.config, name)[len(name):], "scale": ".scale", "wmin": ".min"}
            row_bytes = {binding: m.vocab_row_bytes[suffix[binding]] for binding in whole}
            bound = [({binding: BufferSlice(buffer, *rows.bytes_of(row_bytes[binding]))
                       for binding, buffer in whole.items()}, rows) for rows in m.vocab_slices]
        m.matrix_bindings[key] = bound
    return bound


def _matmul(m, enc: PassEncoder, plan: PassPlan, matmul: Matmul, weight: str, x, y, *, norm=None, resid=None,
            rope_io=None, values=None, per_step: bool = False, y_codes: dict | None = None,
            post_norm: tuple | None = None) -> None:
    """y = x @ W^T with the role's folds; `weight` names the matrix (its .q4 or .q8a, .scale, .min tensors).
    `x` is a buffer, a dict of the buffers x is made from (the merging o-projection's partial
    states), or (int8_x) the codes of x already written (`_codes`). `rope_io`: the RoPE + append
    epilogue's buffers, written instead of y; `y_codes`: where the epilogue also writes y's codes
    (MatmulSpec.quantizes_y); `post_norm`: (stream, the post-norm's weight, stream_out) where x is the
    last matmul's output, normalized and added to the stream first (MatmulSpec.adds_post_norm).
    Where the role reads int8 codes of x (PassPlan.int8_x) and x is not given as codes, its quantizer
    runs first, with the norm's weight, unless the matmul makes them itself (Int8XForm.quantizes_own_x:
    it reads x and the norm's weight)."""
    w, n = m.weights, plan.n
    int8_x = plan.int8_x is not None and matmul in INT8_X_MATMULS
    quantizes_x = int8_x and plan.int8_x.quantizes_own_x(matmul)
    role = matmul_role(matmul, prefill=n > 1, short=plan.short_tile, matrix=plan.matrix_matmuls, int8_x=int8_x)
    given_codes = isinstance(x, dict) and "xq" in x
    reads_codes = int8_x and not quantizes_x
    if reads_codes and not given_codes:
        _quantize_x(m, enc, INT8_X_MATMULS[matmul], x, norm)
    if given_codes or (isinstance(x, dict) and not int8_x):
        buffers = dict(x)  # codes written before, or the partial states the merging o-projection reads
    elif reads_codes:
        buffers = _codes(m)  # what its quantizer just wrote
    else:
        buffers = {"x": x}
    if y_codes is not None:
        buffers.update({"yq": y_codes["xq"], "ystats": y_codes["xstats"]})
    buffers.update(_matrix_buffers(m, weight))
    buffers.update(rope_io or {"y": y})
    if norm is not None and not reads_codes:
        buffers["norm"] = w[norm]
    if resid is not None:
        buffers["resid"] = resid
    if post_norm is not None:
        stream, weight_name, stream_out = post_norm
        buffers.update(stream=stream, post_norm=w[weight_name], stream_out=stream_out)
    enc.run(m.kernels[role], buffers, role_values(m, role, **{"n": n, **(values or {})}), per_step=per_step)


def _rms_norm(m, enc, n: int, x, norm: str):
    """norm(x) into the `normed` scratch buffer, a dispatch of its own (CPU rasterizers); returns it."""
    normed = m.buffers["normed"]
    enc.run(m.kernels[Role.RMS_NORM], {"x": x, "weight": m.weights[norm], "out": normed}, role_values(m, Role.RMS_NORM, n=n))
    return normed


def _norm_residual(m, enc, n: int, y, norm: str, resid, out) -> None:
    """out = resid + norm(y): a family's post-norm of an attention or FFN output, and the residual add."""
    enc.run(m.kernels[Role.NORM_RESIDUAL], {"x": y, "weight": m.weights[norm], "resid": resid, "out": out},
            role_values(m, Role.NORM_RESIDUAL, n=n))


def layer_rope(c, layer: int) -> dict:
    """The RoPE values of layer `layer` whose base differs from the model's (a sliding-window layer's)."""
    theta = layer_rope_theta(c, layer)
    if theta == c.rope_theta:
        return {}
    return {"rope_exponent": rope_values(c.n_heads, c.n_kv_heads, c.head_dim, theta, c.rope_scaling)["rope_exponent"]}


def _qkv(m, enc, plan: PassPlan, weight: str, x, y, norm: str) -> None:
    """qkv = norm(x) @ Wqkv^T: the RMSNorm folded into the matmul, or (CPU rasterizers) run before it."""
    if plan.fold_norms:
        _matmul(m, enc, plan, Matmul.NORM_QKV, weight, x, y, norm=norm)
    else:
        _matmul(m, enc, plan, Matmul.QKV, weight, _rms_norm(m, enc, plan.n, x, norm), y)


def _swiglu_ffn(m, enc, plan: PassPlan, weight: str, x, h, norm: str, h_codes: dict | None = None) -> None:
    """h = silu(norm(x) @ Wg^T) * (norm(x) @ Wu^T), folded into one matmul or in three kernels; with
    `h_codes`, the folded matmul also writes h's int8 codes there."""
    if plan.fold_norms:
        _matmul(m, enc, plan, Matmul.NORM_GATE_UP_SWIGLU, weight, x, h, norm=norm, y_codes=h_codes)
    else:
        gate_up = m.buffers["gate_up"]
        _matmul(m, enc, plan, Matmul.GATE_UP, weight, _rms_norm(m, enc, plan.n, x, norm), gate_up)
        enc.run(m.kernels[Role.SWIGLU], {"gate_up": gate_up, "h": h}, role_values(m, Role.SWIGLU, n=plan.n))


def encode_forward(m, enc: PassEncoder, plan: PassPlan, nnz_pages: int, sampling, draw: float) -> None:
    """The whole forward pass of model `m` (model_glue.model.llama.LlamaModel) as `plan` lays it out, as
    kernel dispatches (in one compute pass where the encoder asks for it). The model gives the
    weights, buffers and compiled kernels; every choice is the plan's."""
    with enc.whole_pass(PassStamps(m.config.n_layers)):
        _forward(m, enc, plan, nnz_pages, sampling, draw)


def _forward(m, enc, plan: PassPlan, nnz_pages: int, sampling, draw: float) -> None:
    c, w, buf, k = m.config, m.weights, m.buffers, m.kernels
    n, choice, arch = plan.n, plan.attention, c.arch
    stamps = PassStamps(c.n_layers)
    x, x_mid = buf["x_a"], buf["x_b"]
    # a decode step of a post-norm family (folded norms): each post-norm and its residual add run in
    # the prologue of the next normed matmul, which writes the stream (MatmulSpec.adds_post_norm)
    folds_post_norms = n == 1 and plan.fold_norms and arch.post_norms
    with enc.timed(stamps.pass_begin, None):
        # a one-token pass embeds the id the last pass chose (or the host wrote) in next_id; each
        # vocabulary slice writes the tokens whose ids it holds (one slice, unless past a binding)
        for matrix, rows in _vocab_matrix(m, "embed"):
            enc.run(k[Role.EMBED], {"ids": buf["ids"] if n > 1 else buf["next_id"], **matrix, "out": x},
                    role_values(m, Role.EMBED, n=n, vocab=rows.rows, row_base=rows.first))
    for layer in range(c.n_layers):
        p = f"layers.{layer}"
        # attention block: x_mid = x + o(attention(rope(qkv(norm(x))))) (the family's post-norm of o's
        # output before the add); a split attention call's merge runs in the o-projection or its
        # quantizer where the plan says so
        rope_io = {"positions": buf["positions"], "slots": buf["slots"], "pages": m.kv.layers[layer], "q": buf["q"]}
        if n == 1 and plan.fold_norms and arch.fused_rope_append:  # one dispatch: rotated q out, K/V into the page slot
            _matmul(m, enc, plan, Matmul.NORM_QKV_ROPE_APPEND, f"{p}.qkv", x, None, norm=f"{p}.attn_norm",
                    rope_io=rope_io, values={"num_pages": m.kv.num_pages})
        else:  # the family's bias and QK-norm, then RoPE at the layer's base (its own for a sliding window)
            if folds_post_norms and layer > 0:  # x = x_mid + norm(the last down's output) made first
                _matmul(m, enc, plan, Matmul.POST_NORM_QKV, f"{p}.qkv", buf["normed"], buf["qkv"],
                        norm=f"{p}.attn_norm", post_norm=(x_mid, f"layers.{layer - 1}.post_ffn_norm", x))
            else:
                _qkv(m, enc, plan, f"{p}.qkv", x, buf["qkv"], f"{p}.attn_norm")
            head_norms = {"q_norm": w[f"{p}.q_norm"], "k_norm": w[f"{p}.k_norm"]} if arch.qk_norm else {}
            bias = {"qkv_bias": w[f"{p}.qkv_bias"]} if arch.qkv_bias else {}
            enc.run(k[Role.ROPE_APPEND], {"qkv": buf["qkv"], **bias, **head_norms, **rope_io},
                    role_values(m, Role.ROPE_APPEND, n=n, num_pages=m.kv.num_pages, **layer_rope(c, layer)))
        with enc.timed(*stamps.attention(layer)):
            for kernel, kernel_buffers, values in layer_attention_dispatches(m, plan, layer, nnz_pages):
                enc.run(kernel, kernel_buffers, values, per_step=True)
        split_states = {name: buf[name] for name in SPLIT_WORKSPACE}
        if arch.post_norms:  # x_mid = x + norm(attn @ Wo^T)
            if plan.o_merges:
                _matmul(m, enc, plan, Matmul.O_MERGE, f"{p}.o", split_states, buf["normed"],
                        values=o_merge_values(choice), per_step=True)
            else:
                _matmul(m, enc, plan, Matmul.O, f"{p}.o", buf["attn"], buf["normed"])
            if not folds_post_norms:  # else gate/up makes x_mid
                _norm_residual(m, enc, n, buf["normed"], f"{p}.post_attn_norm", x, x_mid)
        elif plan.o_merges:  # x of the o-projection is merged from the split call's partial states
            _matmul(m, enc, plan, Matmul.O_RESIDUAL_MERGE, f"{p}.o", split_states, x_mid,
                    resid=x, values=o_merge_values(choice), per_step=True)
        elif plan.quantizer_merges:  # ... by the o-projection's quantizer
            _quantize_x(m, enc, Role.QUANTIZE_MERGE, split_states,
                        values={"num_splits": choice.num_splits}, per_step=True)
            _matmul(m, enc, plan, Matmul.O_RESIDUAL, f"{p}.o", _codes(m), x_mid, resid=x)
        else:
            _matmul(m, enc, plan, Matmul.O_RESIDUAL, f"{p}.o", buf["attn"], x_mid, resid=x)
        # feed-forward block: x = x_mid + down(act(gate) * up of norm(x_mid)) (the family's post-norm of
        # down's output before the add)
        down_codes = _codes(m, "ffn_") if plan.int8_x and plan.int8_x.down_codes_from_gate_up else None
        if folds_post_norms:  # x_mid = x + norm(o's output) made first
            _matmul(m, enc, plan, Matmul.POST_NORM_GATE_UP_SWIGLU, f"{p}.gate_up", buf["normed"], buf["ffn"],
                    norm=f"{p}.ffn_norm", post_norm=(x, f"{p}.post_attn_norm", x_mid))
        else:
            _swiglu_ffn(m, enc, plan, f"{p}.gate_up", x_mid, buf["ffn"], f"{p}.ffn_norm", h_codes=down_codes)
        if arch.post_norms:
            _matmul(m, enc, plan, Matmul.DOWN, f"{p}.down", buf["ffn"], buf["normed"])
            if not folds_post_norms or layer == c.n_layers - 1:  # else the next qkv makes x
                _norm_residual(m, enc, n, buf["normed"], f"{p}.post_ffn_norm", x_mid, x)
        else:
            _matmul(m, enc, plan, Matmul.DOWN_RESIDUAL, f"{p}.down", down_codes or buf["ffn"], x, resid=x_mid)
    # head: only the last token's logits are needed (a decode pass's x is that token already)
    last = x
    if n > 1:
        enc.batch.copy(x, (n - 1) * c.dim * m.esize, buf["last"], 0, c.dim * m.esize)
        last = buf["last"]
    head = {"y": buf["logits"], "best": buf["head_best"]}  # the logits (the sampler, tests) and each workgroup's best for argmax
    with enc.timed(None, stamps.pass_end):
        # the tied embedding or the head's own matrix, a vocabulary slice a dispatch (one, unless past a
        # binding), each writing its columns of the logits and its workgroups' bests
        if plan.fold_norms:
            for matrix, rows in _vocab_matrix(m, head_tensor(c)):
                enc.run(k[Role.NORM_LM_HEAD], {"x": last, "norm": w["final_norm"], **matrix, **head},
                        role_values(m, Role.NORM_LM_HEAD, n=1, out_features=rows.rows, row_base=rows.first))
        else:
            normed = _rms_norm(m, enc, 1, last, "final_norm")
            for matrix, rows in _vocab_matrix(m, head_tensor(c)):
                enc.run(k[Role.LM_HEAD], {"x": normed, **matrix, **head},
                        role_values(m, Role.LM_HEAD, n=1, out_features=rows.rows, row_base=rows.first))
        if plan.greedy:
            enc.run(k[Role.ARGMAX], {"best": buf["head_best"], "out": buf["next_id"]}, role_values(m, Role.ARGMAX))
        else:  # the draw changes every step
            enc.run(k[Role.SAMPLE], {"logits": buf["logits"], "out": buf["next_id"]},
                    role_values(m, Role.SAMPLE, **sampling.kernel_values(draw)), per_step=True)
