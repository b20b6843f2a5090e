"""How a model runs: one `RunOptions` object, checked once, flowing one way.

The page (or a benchmark, a test, the CLI) builds it; `ChatSession.reply` and `generate` pass it
on unchanged; `LlamaModel.use` checks it against the loaded model and makes it the options of the
passes that follow. `max_context` (it sizes the KV cache), `matmul_subgroups` and `matmul_int8_x`
(which kernels compile) are chosen at load; every other field may change per request. A None field means "this adapter's default" (`resolved`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace

from contract.attention import NEST_CHOICES, LayoutChoice
from model_glue.errors import ModelError

# Prompt tokens per prefill pass (longer prompts go in chunks; the stop button acts between them).
# A GPU wants large chunks: the prefill kernels' tiles (128 tokens x 64 weight rows, 64 query rows)
# fill its SMs only from a few thousand tokens on (H200, `python -m app bench prefill`: 3,000 tokens
# at 26k tok/s in chunks of 2,048, 35k in one of 4,096). A CPU rasterizer has no idle cores to fill,
# and smaller chunks keep the stop button responsive there.
GPU_PREFILL_CHUNK = 4096
CPU_PREFILL_CHUNK = 256
# Decode steps in flight at once. The page learns of a finished step a while after it ends (mapAsync
# goes through Chromium's GPU process): on the H200, from a step's end on the GPU to the host's next
# submission starting there is ~2.2 ms (the GPU's gap between passes at depth 2, against 0.035 ms
# when it never waits). The steps queued behind the one being read must cover that and the host's
# occasional longer pauses: at depth 4 the 1B shape's steps (1 ms) still stalled now and then
# (gaps up to 1.5 ms; one run of eight at 764 instead of 910-942 tok/s); at 6 and 8 the worst gap was
# 0.043 ms (934-947 tok/s at 3,060 tokens; three page loads, two device calls, docs/benchmarks.md).
# A stop discards the steps in flight.
# A CPU rasterizer's step takes 100s of ms, far beyond that round trip: it keeps 4, as before (more
# steps in flight would only add work a stop throws away).
GPU_PIPELINE_DEPTH = 6
CPU_PIPELINE_DEPTH = 4
# Decode steps whose attention is timed per layer: one in this many (RunOptions.time_attention_every).
# Measured on the H200 (docs/benchmarks.md, natively): SmolLM2 at 1,536 tokens 1.166 ms a step in one
# pass, 1.643 with every layer's attention timed (61 passes), 1.234 with one step in 8 timed: 5.8% over
# one pass (the 1B shape 3.5%, the 8B 1.8%), above issue 25's 5% bar; hence one in 16.
ATTENTION_TIMING_EVERY = 16
MAX_PIPELINE_DEPTH = 8  # readback buffers allocated per model; a prefill needs 2 (chunk i+1 before i's id)


@dataclass(frozen=True)
class RunOptions:
    # Tokens the KV cache holds (prompt + reply), at most the model's context length. Load time only.
    max_context: int | None = None
    # The decode attention nest: "auto" (pick_decode_nest), or "tiled" / "sharded" forced (comparison mode).
    attention: str = "auto"
    # The sharded nest held to a layout and split count (benchmarks, tests): a LayoutChoice, or its text
    # such as "shards:8", parsed once here. None: the adapter's rule (model_glue.attention.pick_layout).
    layout: LayoutChoice | None = None
    # Replay recorded decode passes (in the page: one call into JS); False encodes every pass in Python.
    replay: bool = True
    # Fold each RMSNorm into the matmul after it and SwiGLU into gate/up (6 dispatches a layer instead
    # of 9). None: on GPUs, not on CPU rasterizers (there the folds cost more than the dispatches they save).
    fold_norms: bool | None = None
    # Prompt tokens per prefill pass. None: GPU_PREFILL_CHUNK on GPUs, CPU_PREFILL_CHUNK on CPU rasterizers.
    prefill_chunk: int | None = None
    # Decode steps in flight (2..MAX_PIPELINE_DEPTH). None: GPU_PIPELINE_DEPTH on GPUs, CPU_PIPELINE_DEPTH on CPU rasterizers.
    pipeline_depth: int | None = None
    # At load, run a dummy prompt and a decode step (then forget them), so the first prompt finds
    # its passes bound (model_glue.loading.warm_up). None: on GPUs, not on CPU rasterizers (seconds there). Load time only.
    warm_up: bool | None = None
    # Time each layer's attention (in a timed compute pass of its own) in every Nth decode step: where
    # the context is a multiple of N, and the first step after a prompt. The other steps are one compute
    # pass, timed as a whole (attention_ms None): on an H200 the 61 passes of a timed SmolLM2 step cost
    # 29% of its GPU time. 1: every step; 0: none. None: ATTENTION_TIMING_EVERY.
    time_attention_every: int | None = None
    # A split attention call's partial states merged inside the o-projection (one dispatch a layer
    # fewer) rather than by the merge kernel. None: where contract.kernels.o_merges_splits says it pays
    # (the o workgroups' reads of the states stay small); True: always; False: never. Where the int8
    # decode matmuls run (matmul_int8_x), the o-projection's quantizer merges instead, whatever this says.
    merge_in_o: bool | None = None
    # The decode matmuls' subgroup builds (lanes' partials added by shuffles; contract.kernels.
    # MatmulSpec.subgroup_lanes). None: where this adapter's subgroups fit a build the artifact has;
    # True: required; False: never (benchmarks compare the two). Load time only.
    matmul_subgroups: bool | None = None
    # The decode step's q4 matmuls reading x as int8 codes made by a quantize dispatch before each,
    # with integer dot products (contract.kernels.MatmulSpec.int8_x; with the norms folded, beside the
    # subgroup builds). None: for models of model_glue.loading.INT8_X_MIN_DIM or wider (where they pay),
    # if the artifact has them for the subgroup build this adapter runs; True: required; False: never
    # (benchmarks compare the two). Load time only.
    matmul_int8_x: bool | None = None
    # The prefill matmuls on subgroup matrices (the tensor cores; contract.kernels.MatmulSpec.matrix),
    # where the model loaded them (model_glue.loading.pick_prefill_matrix: the adapter offers them, f16,
    # folded norms). None: wherever loaded; True: required (an error where they were not loaded, with
    # the reason); False: the scalar tiled kernels (benchmarks and the check compare the two).
    prefill_matrix: bool | None = None
    # The prefill attention's subgroup-matrix build (kernels.prefill_attention_matrix). None: wherever
    # those matmuls run and the artifact has it for the shape; True: required (an error where it cannot
    # run, with the reason); False: the scalar causal kernel (benchmarks and the check compare the two).
    prefill_attention_matrix: bool | None = None
    # A prefill pass of at most model_glue.attention.DECODE_BATCH_MAX_TOKENS tokens (a chat's follow-up turn)
    # runs its attention with the decode kernels, a batch of its tokens each over its own prefix
    # (LlamaModel.prefill_attention); False: the causal prefill kernel (benchmarks compare the two).
    short_prefill_decode_attention: bool = True

    def __post_init__(self):
        if isinstance(self.layout, str):  # the one place a layout's text is parsed
            try:
                object.__setattr__(self, "layout", LayoutChoice.parse(self.layout))
            except ValueError as err:
                raise ModelError(str(err)) from err

    def check(self) -> "RunOptions":
        """This object if every field is valid, else a ModelError naming the field."""
        if self.max_context is not None and (not isinstance(self.max_context, int) or self.max_context < 1):
            raise ModelError(f"max_context must be a positive number of tokens, not {self.max_context!r}")
        if self.attention not in NEST_CHOICES:
            raise ModelError(f"attention must be one of {', '.join(NEST_CHOICES)}, not {self.attention!r}")
        if self.layout is not None and not isinstance(self.layout, LayoutChoice):
            raise ModelError(f"layout must be a sharded layout such as 'shards:8', not {self.layout!r}")
        if self.time_attention_every is not None and (not isinstance(self.time_attention_every, int)
                                                      or self.time_attention_every < 0):
            raise ModelError(f"time_attention_every must be 0 (never), 1 (every step) or N, "
                             f"not {self.time_attention_every!r}")
        flags = ("replay", "short_prefill_decode_attention")
        if not all(isinstance(getattr(self, f), bool) for f in flags) or any(
                getattr(self, f) not in (None, True, False)
                for f in ("fold_norms", "warm_up", "merge_in_o", "matmul_subgroups", "matmul_int8_x", "prefill_matrix",
                          "prefill_attention_matrix")):
            raise ModelError("replay, fold_norms, warm_up, merge_in_o, matmul_subgroups, matmul_int8_x, "
                             "prefill_matrix, prefill_attention_matrix and short_prefill_decode_attention are true or false")
        if self.prefill_chunk is not None and (not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1):
            raise ModelError(f"prefill_chunk must be a positive number of tokens, not {self.prefill_chunk!r}")
        if self.pipeline_depth is not None and self.pipeline_depth not in range(2, MAX_PIPELINE_DEPTH + 1):
            raise ModelError(f"pipeline_depth must be 2..{MAX_PIPELINE_DEPTH} passes, not {self.pipeline_depth!r}")
        return self

    def resolved(self, *, is_cpu: bool, context_length: int) -> "RunOptions":
        """Every None filled with this adapter's default; max_context capped at the model's context."""
        self.check()
        return replace(self, max_context=min(self.max_context or context_length, context_length),
                       fold_norms=not is_cpu if self.fold_norms is None else self.fold_norms,
                       prefill_chunk=self.prefill_chunk or (CPU_PREFILL_CHUNK if is_cpu else GPU_PREFILL_CHUNK),
                       pipeline_depth=self.pipeline_depth or (CPU_PIPELINE_DEPTH if is_cpu else GPU_PIPELINE_DEPTH),
                       warm_up=not is_cpu if self.warm_up is None else self.warm_up,
                       time_attention_every=ATTENTION_TIMING_EVERY if self.time_attention_every is None
                       else self.time_attention_every)

    def merged(self, request: "RunOptions | None") -> "RunOptions":
        """A request's options over these (resolved) ones: the request's None fields keep ours."""
        if request is None:
            return self
        request.check()
        if request.max_context not in (None, self.max_context):
            raise ModelError(f"max_context is chosen when the model loads ({self.max_context} tokens); "
                             f"load it again for {request.max_context}")
        for load_time in ("matmul_subgroups", "matmul_int8_x"):
            if getattr(request, load_time) not in (None, getattr(self, load_time)):
                raise ModelError(f"{load_time} is chosen when the model loads ({getattr(self, load_time)}); "
                                 f"load it again for {getattr(request, load_time)}")
        return replace(self, attention=request.attention, layout=request.layout, replay=request.replay,
                       short_prefill_decode_attention=request.short_prefill_decode_attention,
                       **{f: getattr(request, f) for f in ("fold_norms", "prefill_chunk", "pipeline_depth", "time_attention_every", "merge_in_o",
                                                    "prefill_matrix", "prefill_attention_matrix")
                          if getattr(request, f) is not None})

    @classmethod
    def from_json(cls, text: str | None) -> "RunOptions":
        """The page's options as JSON ({"attention": "tiled", ...}); unknown names are refused."""
        try:
            values = json.loads(text or "{}")
        except ValueError as err:
            raise ModelError(f"bad run options: {err}") from err
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict) -> "RunOptions":
        """The page's options, already decoded; unknown names are refused."""
        if not isinstance(values, dict):
            raise ModelError(f"bad run options: {values!r} is not an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ModelError(f"unknown run options {unknown} (known: {sorted(known)})")
        return cls(**values).check()

    def to_json(self) -> dict:
        values = asdict(self)
        values["layout"] = None if self.layout is None else str(self.layout)
        return values
