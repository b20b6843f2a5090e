"""The forward pass of a Llama-shaped model as a fixed sequence of TVM-built kernel dispatches, read
top to bottom like llama2.c's run.c (`encode_forward`), and `PassEncoder`, through which every
dispatch goes: bound once through a plan, recorded for replay, bracketed by timestamps.

No numpy and no TVM: the same code runs in Pyodide and natively.
"""

from __future__ import annotations

from contextlib import contextmanager

from contract.attention import AttentionChoice
from contract.kernels import (INT8_X_MATMULS, INT8_X_SUFFIX, MATRIX_MATMULS, MATRIX_SUFFIX, SHORT_SUFFIX,
                              SPLIT_WORKSPACE, prefill_matmul_role)
from contract.model import head_tensor
from model_glue.attention import attention_call, attention_dispatches
from model_glue.kernel import DispatchPlan
from model_glue.pass_plan import PassPlan
from model_glue.step_stats import PassStamps


def forward_roles(fold_norms: bool, greedy: bool = True, o_merges: bool = False, int8_x: bool = False,
                  prefill_matrix: bool = False) -> list[str]:
    """The kernel roles `encode_forward` dispatches (contract.kernels.llama_kernels): with the norms
    and SwiGLU folded into the matmuls (GPUs) or apart (CPU rasterizers), argmax or the sampler,
    (`o_merges`: the shape has it) the o-projection that merges a split attention call,
    (`int8_x`, with folded norms) the decode matmuls' quantizers, the prefill matmuls' short tiles
    and (`prefill_matrix`, with folded norms) their subgroup-matrix builds. Only these are compiled."""
    matmuls = ["norm_qkv", "o_residual", "norm_gate_up_swiglu", "down_residual"] if fold_norms else \
        ["qkv", "o_residual", "gate_up", "down_residual"]
    apart = [] if fold_norms else ["rms_norm", "swiglu"]
    fused = ["norm_qkv_rope_append_decode"] if fold_norms else []  # a decode step's qkv + RoPE + K/V append
    fused += ["o_residual_merge_decode"] if o_merges else []
    if int8_x and fold_norms:  # the int8_x forms of the decode matmuls and their quantizers
        fused += [role + INT8_X_SUFFIX for role in INT8_X_MATMULS]
        fused += sorted(set(INT8_X_MATMULS.values())) + ["quantize_merge_decode"]
    prefill = [f"{m}_prefill{SHORT_SUFFIX}" for m in matmuls]
    if prefill_matrix and fold_norms:
        prefill += [f"{m}_prefill{short}{MATRIX_SUFFIX}" for m in MATRIX_MATMULS for short in ("", SHORT_SUFFIX)]
    return ["embed", "rope_append", *(f"{m}_{phase}" for phase in ("decode", "prefill") for m in matmuls), *prefill,
            *fused,
            *apart,
            "norm_lm_head" if fold_norms else "lm_head", "argmax" if greedy else "sample"]


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
        bound = kernel.bind(buffers, values)
        bound.dispatch(self.batch)
        bound.release_after(self.batch)

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


class ProfilingEncoder:
    """Encodes a pass with every dispatch in a timed compute pass of its own (`python -m app bench
    decode --profile`): dispatch i writes timestamps 2i and 2i + 1, and its kernel's name and bound
    buffers are kept in `dispatches`. The forward pass's own spans are left out (each dispatch is
    already timed alone)."""

    def __init__(self, batch, stamps):
        self.batch, self.stamps = batch, stamps
        self.dispatches: list[tuple[str, dict]] = []

    def run(self, kernel, buffers: dict, values: dict, per_step: bool = False) -> None:
        i = len(self.dispatches)
        bound = kernel.bind(buffers, values)
        bound.dispatch(self.batch, (self.stamps, 2 * i, 2 * i + 1))
        bound.release_after(self.batch)
        self.dispatches.append((kernel.name, buffers))

    @contextmanager
    def timed(self, begin: int | None, end: int | None):
        yield

    @contextmanager
    def whole_pass(self, stamps: PassStamps):
        yield


# -- attention calls ------------------------------------------------------------------------------------
def attention_buffers(m, layer: int, n: int, nnz_pages: int, choice: AttentionChoice) -> tuple[dict, dict]:
    """Buffers and values of one layer's attention (the values are the same in every layer)."""
    c, buf = m.config, m.buffers
    if choice.nest == "prefill":  # the pass's n tokens after the kv.length - n cached before them
        return ({"q": buf["q"], "pages": m.kv.layers[layer], "page_ids": buf["page_ids"], "output": buf["attn"]},
                {"n": n, "num_pages": m.kv.num_pages, "used_pages": nnz_pages, "start": m.kv.length - n,
                 "sm_scale": c.head_dim ** -0.5})
    # RoPE was applied at append (adjacent pairs, as the GGUF's Q/K expect): rotary_mode 0.
    # The page table grows with the context: attention's values change every step.
    return attention_call(
        q=buf["q"], pages=m.kv.layers[layer], page_table_indptr=buf["indptr"],
        page_table_values=buf["page_ids"], length_info=buf["last_len"], k_rope_pos_offset=buf["rope_offsets"],
        q_rope_position=buf["rope_offsets"], output=buf["attn"], lse=buf["lse"], batch=n, nnz_pages=nnz_pages,
        max_num_pages=m.kv.num_pages, sm_scale=c.head_dim ** -0.5, rope_theta=c.rope_theta,
        workspace={name: buf[name] for name in SPLIT_WORKSPACE}, num_splits=choice.num_splits)


def pass_attention_kernels(m, plan: PassPlan) -> list:
    """The attention kernels a pass dispatches: without the merge where the o-projection or its
    int8 quantizer merges the split call's partial states (PassPlan.merges_split)."""
    kernels = m.attention_kernels(plan.attention)
    return kernels[:-1] if plan.merges_split else kernels


def role_values(m, role: str, **pass_values) -> dict:
    """The values a model kernel runs with: the model's sizes it is not compiled for (its spec's
    `values`: row counts, vocabulary, eps, RoPE's) and the pass's (`n`, ...)."""
    return {**m.kernel_values[role], **pass_values}


def per_step_values(m, plan: PassPlan, nnz_pages: int, sampling, draw: float) -> list:
    """(kernel, values) of each kernel of a decode pass whose values change per step: attention
    (the context grows), the merging o-projection or quantizer (S may change) and the sampler (a new draw)."""
    choice = plan.attention
    buffers, values = attention_buffers(m, 0, 1, nnz_pages, choice)
    pairs = [(kernel, v) for kernel, _, v in attention_dispatches(pass_attention_kernels(m, plan), buffers, values)]
    if plan.o_merges:
        pairs.append((m.kernels["o_residual_merge_decode"], role_values(m, "o_residual_merge_decode",
                                                                        **o_merge_values(choice))))
    if plan.quantizer_merges:
        pairs.append((m.kernels["quantize_merge_decode"], role_values(m, "quantize_merge_decode",
                                                                      num_splits=choice.num_splits)))
    if sampling is not None and not sampling.greedy:
        pairs.append((m.kernels["sample"], role_values(m, "sample", **sampling.kernel_values(draw))))
    return pairs


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


def _matmul(m, enc: PassEncoder, plan: PassPlan, matmul: str, weight: str, x, y, *, norm=None, resid=None,
            rope_io=None, values=None, per_step: bool = False, y_codes: dict | None = None) -> None:
    """y = x @ W^T with the role's folds; `weight` names the q4 matrix (its .q4/.scale/.min tensors).
    `x` is a buffer, a dict of the buffers x is made from (the merging o-projection's partial
    states), or (int8_x) the codes of x already written (`_codes`). `rope_io`: the RoPE + append
    epilogue's buffers, written instead of y; `y_codes`: where the epilogue also writes y's codes
    (MatmulSpec.quantizes_y). Where the role reads int8 codes of x (PassPlan.int8_x) and x is not
    given as codes, its quantizer runs first, with the norm's weight."""
    w, n = m.weights, plan.n
    role = f"{matmul}_decode" if n == 1 else prefill_matmul_role(matmul, plan.short_tile, plan.matrix_matmuls)
    int8_x = plan.int8_x and role in INT8_X_MATMULS
    given_codes = isinstance(x, dict) and "xq" in x
    if int8_x and not given_codes:
        _quantize_x(m, enc, INT8_X_MATMULS[role], x, norm)
    if int8_x:
        role += INT8_X_SUFFIX
    if given_codes or (isinstance(x, dict) and not int8_x):
        buffers = dict(x)  # codes written before, or the partial states the merging o-projection reads
    elif int8_x:
        buffers = _codes(m)  # what its quantizer just wrote
    else:
        buffers = {"x": x}
    if y_codes is not None:
        buffers.update({"yq": y_codes["xq"], "ystats": y_codes["xstats"]})
    buffers.update({"w": w[f"{weight}.q4"], "scale": w[f"{weight}.scale"], "wmin": w[f"{weight}.min"]})
    buffers.update(rope_io or {"y": y})
    if norm is not None and not int8_x:
        buffers["norm"] = w[norm]
    if resid is not None:
        buffers["resid"] = resid
    enc.run(m.kernels[role], buffers, role_values(m, role, **{"n": n, **(values or {})}), per_step=per_step)


def _normed_matmul(m, enc, plan: PassPlan, matmul: str, weight: str, x, y, norm: str) -> None:
    """norm(x) @ W^T: the RMSNorm folded into the matmul, or (CPU rasterizers) run before it."""
    if plan.fold_norms:
        _matmul(m, enc, plan, f"norm_{matmul}", weight, x, y, norm=norm)
    else:
        normed = m.buffers["normed"]
        enc.run(m.kernels["rms_norm"], {"x": x, "weight": m.weights[norm], "out": normed},
                role_values(m, "rms_norm", n=plan.n))
        _matmul(m, enc, plan, matmul, weight, normed, y)


def _swiglu_ffn(m, enc, plan: PassPlan, weight: str, x, h, norm: str, h_codes: dict | None = None) -> None:
    """h = silu(norm(x) @ Wg^T) * (norm(x) @ Wu^T), folded into one matmul or in three kernels; with
    `h_codes`, the folded matmul also writes h's int8 codes there."""
    if plan.fold_norms:
        _matmul(m, enc, plan, "norm_gate_up_swiglu", weight, x, h, norm=norm, y_codes=h_codes)
    else:
        gate_up = m.buffers["gate_up"]
        _normed_matmul(m, enc, plan, "gate_up", weight, x, gate_up, norm)
        enc.run(m.kernels["swiglu"], {"gate_up": gate_up, "h": h}, role_values(m, "swiglu", n=plan.n))


def encode_forward(m, enc: PassEncoder, plan: PassPlan, nnz_pages: int, sampling, draw: float) -> None:
    """The whole forward pass of model `m` (model_glue.model.LlamaModel) as `plan` lays it out, as
    kernel dispatches (in one compute pass where the encoder asks for it). The model gives the
    weights, buffers and compiled kernels; every choice is the plan's."""
    with enc.whole_pass(PassStamps(m.config.n_layers)):
        _forward(m, enc, plan, nnz_pages, sampling, draw)


def _forward(m, enc, plan: PassPlan, nnz_pages: int, sampling, draw: float) -> None:
    c, w, buf, k = m.config, m.weights, m.buffers, m.kernels
    n, choice = plan.n, plan.attention
    attention = pass_attention_kernels(m, plan)
    stamps = PassStamps(c.n_layers)
    x, x_mid = buf["x_a"], buf["x_b"]
    with enc.timed(stamps.pass_begin, None):
        # a one-token pass embeds the id the last pass chose (or the host wrote) in next_id
        enc.run(k["embed"], {"ids": buf["ids"] if n > 1 else buf["next_id"], "q8": w["embed.q8"],
                             "scale": w["embed.scale"], "out": x}, role_values(m, "embed", n=n))
    for layer in range(c.n_layers):
        p = f"layers.{layer}"
        # attention block: x_mid = x + o(attention(rope(qkv(norm(x))))); a split attention call's merge
        # runs in the o-projection or its quantizer where the plan says so
        rope_io = {"positions": buf["positions"], "slots": buf["slots"], "pages": m.kv.layers[layer], "q": buf["q"]}
        if n == 1 and plan.fold_norms:  # one dispatch: the rotated q out, K/V into the token's page slot
            _matmul(m, enc, plan, "norm_qkv_rope_append", f"{p}.qkv", x, None, norm=f"{p}.attn_norm",
                    rope_io=rope_io, values={"num_pages": m.kv.num_pages})
        else:
            _normed_matmul(m, enc, plan, "qkv", f"{p}.qkv", x, buf["qkv"], f"{p}.attn_norm")
            enc.run(k["rope_append"], {"qkv": buf["qkv"], **rope_io},
                    role_values(m, "rope_append", n=n, num_pages=m.kv.num_pages))
        attn_buffers, attn_values = attention_buffers(m, layer, n, nnz_pages, choice)
        with enc.timed(*stamps.attention(layer)):
            for kernel, kernel_buffers, values in attention_dispatches(attention, attn_buffers, attn_values):
                enc.run(kernel, kernel_buffers, values, per_step=True)
        if plan.o_merges:  # x of the o-projection is merged from the split call's partial states
            _matmul(m, enc, plan, "o_residual_merge", f"{p}.o", {name: buf[name] for name in SPLIT_WORKSPACE}, x_mid,
                    resid=x, values=o_merge_values(choice), per_step=True)
        elif plan.quantizer_merges:  # ... by the o-projection's quantizer
            _quantize_x(m, enc, "quantize_merge_decode", {name: buf[name] for name in SPLIT_WORKSPACE},
                        values={"num_splits": choice.num_splits}, per_step=True)
            _matmul(m, enc, plan, "o_residual", f"{p}.o", _codes(m), x_mid, resid=x)
        else:
            _matmul(m, enc, plan, "o_residual", f"{p}.o", buf["attn"], x_mid, resid=x)
        # feed-forward block: x = x_mid + down(swiglu(gate_up(norm(x_mid))))
        down_codes = _codes(m, "ffn_") if plan.down_codes_from_gate_up else None
        _swiglu_ffn(m, enc, plan, f"{p}.gate_up", x_mid, buf["ffn"], f"{p}.ffn_norm", h_codes=down_codes)
        _matmul(m, enc, plan, "down_residual", f"{p}.down", down_codes or buf["ffn"], x, resid=x_mid)
    # head: only the last token's logits are needed (a decode pass's x is that token already)
    last = x
    if n > 1:
        enc.batch.copy(x, (n - 1) * c.dim * m.esize, buf["last"], 0, c.dim * m.esize)
        last = buf["last"]
    head_matrix = head_tensor(c)  # the tied embedding or the head's own matrix, q8
    head = {"w": w[f"{head_matrix}.q8"], "scale": w[f"{head_matrix}.scale"], "y": buf["logits"],
            "best": buf["head_best"]}  # the logits (the sampler, tests) and each workgroup's best for argmax
    with enc.timed(None, stamps.pass_end):
        if plan.fold_norms:
            enc.run(k["norm_lm_head"], {"x": last, "norm": w["final_norm"], **head}, role_values(m, "norm_lm_head", n=1))
        else:
            enc.run(k["rms_norm"], {"x": last, "weight": w["final_norm"], "out": buf["normed"]},
                    role_values(m, "rms_norm", n=1))
            enc.run(k["lm_head"], {"x": buf["normed"], **head}, role_values(m, "lm_head", n=1))
        if plan.greedy:
            enc.run(k["argmax"], {"best": buf["head_best"], "out": buf["next_id"]}, role_values(m, "argmax"))
        else:  # the draw changes every step
            enc.run(k["sample"], {"logits": buf["logits"], "out": buf["next_id"]},
                    role_values(m, "sample", **sampling.kernel_values(draw)), per_step=True)
