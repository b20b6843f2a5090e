"""How a model runs: one `RunOptions` object, checked once, flowing one way.

The page (or a benchmark, a test, the CLI) builds it; `ChatSession.reply` and `generate` pass it
on unchanged; `LlamaModel.use` checks it against the loaded model and makes it the options of the
passes that follow. Each field says in its metadata (`option`) what its text form is and whether it
is chosen at load (`max_context` sizes the KV cache, `matmul_subgroups` and `matmul_int8_x` pick the
kernels, `warm_up` runs then) or per request; `merged`, `per_request`, `check`'s flags and the text
forms (`option_value`) are derived from it. A None field means "this adapter's default" (`resolved`,
by model_glue.policy.option_defaults).
"""

from __future__ import annotations

import json
from functools import cache
from dataclasses import asdict, dataclass, field, fields, replace

from contract.attention import NEST_CHOICES, LayoutChoice
from model_glue.errors import ModelError
from model_glue.policy import option_defaults

MAX_PIPELINE_DEPTH = 8  # readback buffers allocated per model; a prefill needs 2 (chunk i+1 before i's id)
# A field's text form (the CLI's flags, the bench's modes and the page's URL all write options as text):
# "auto-on-off" (None: this adapter's default), "on-off", "count" (a whole number; None: the default)
# or "text" (parsed by the field itself).
OPTION_KINDS = ("auto-on-off", "on-off", "count", "text")


def option(default, kind: str, when: str = "request"):
    """A RunOptions field: its text form's kind (OPTION_KINDS) and when it is chosen: "load" (it shapes
    what loads: a request may only repeat it) or "request" (each request may change it; one whose None
    means this adapter's default keeps the loaded value where a request leaves it None)."""
    assert kind in OPTION_KINDS and when in ("load", "request")
    return field(default=default, metadata={"kind": kind, "when": when})


@dataclass(frozen=True)
class RunOptions:
    # Tokens the KV cache holds (prompt + reply), at most the model's context length. Load time only.
    max_context: int | None = option(None, "count", "load")
    # The decode attention nest: "auto" (model_glue.policy.pick_decode_nest), or "tiled" / "sharded"
    # forced (comparison mode).
    attention: str = option("auto", "text")
    # The sharded nest held to a layout and split count (benchmarks, tests): a LayoutChoice, or its text
    # such as "shards:8", parsed once here. None: the adapter's rule (model_glue.policy.pick_layout).
    layout: LayoutChoice | None = option(None, "text")
    # Replay recorded decode passes (in the page: one call into JS); False encodes every pass in Python.
    replay: bool = option(True, "on-off")
    # Fold each RMSNorm into the matmul after it and SwiGLU into gate/up (6 dispatches a layer instead of 9).
    fold_norms: bool | None = option(None, "auto-on-off")
    # Prompt tokens per prefill pass (longer prompts go in chunks; the stop button acts between them).
    prefill_chunk: int | None = option(None, "count")
    # Decode steps in flight (2..MAX_PIPELINE_DEPTH); a stop discards them.
    pipeline_depth: int | None = option(None, "count")
    # At load, run a dummy prompt and a decode step (then forget them), so the first prompt finds its
    # passes bound (model_glue.loading.warm_up). Load time only.
    warm_up: bool | None = option(None, "auto-on-off", "load")
    # Time each layer's attention (inside the step's pass where the adapter writes timestamps there,
    # else in a timed compute pass of its own) in every Nth decode step: where
    # the context is a multiple of N, and the first step after a prompt. The other steps are one compute
    # pass, timed as a whole (attention_ms None). 1: every step; 0: none.
    time_attention_every: int | None = option(None, "count")
    # A split attention call's partial states merged inside the o-projection (one dispatch a layer fewer)
    # rather than by the merge kernel. None: where model_glue.policy.merges_in_o says it pays; True:
    # wherever the shape has the kernel; False: never. Where the int8 decode matmuls run (matmul_int8_x),
    # the o-projection's quantizer merges instead, whatever this says.
    merge_in_o: bool | None = option(None, "auto-on-off")
    # The decode matmuls' subgroup builds (lanes' partials added by shuffles; contract.kernels.
    # MatmulSpec.subgroup_lanes). None: where this adapter's subgroups fit a build the artifact has;
    # True: required; False: never (benchmarks compare the two). Load time only.
    matmul_subgroups: bool | None = option(None, "auto-on-off", "load")
    # The decode step's q4 matmuls reading x as int8 codes made by a quantize dispatch before each, with
    # integer dot products (contract.kernels.MatmulSpec.int8_x). None: model_glue.policy.pick_matmul_int8_x's
    # rule; True: required; False: never (benchmarks compare the two). Load time only.
    matmul_int8_x: bool | None = option(None, "auto-on-off", "load")
    # The prefill matmuls on subgroup matrices (the tensor cores; contract.kernels.MatmulSpec.matrix),
    # where the model loaded them (model_glue.policy.pick_prefill_matrix). None: wherever loaded; True:
    # required (an error where they were not loaded, with the reason); False: the scalar tiled kernels.
    prefill_matrix: bool | None = option(None, "auto-on-off")
    # The prefill attention's subgroup-matrix build (kernels.prefill_attention_matrix). None: wherever
    # those matmuls run and the artifact has it for the shape; True: required (an error where it cannot
    # run, with the reason); False: the scalar causal kernel (benchmarks and the check compare the two).
    prefill_attention_matrix: bool | None = option(None, "auto-on-off")
    # A prefill pass of at most model_glue.policy.DECODE_BATCH_MAX_TOKENS tokens (a chat's follow-up turn)
    # runs its attention with the decode kernels, a batch of its tokens each over its own prefix
    # (LlamaModel.prefill_attention); False: the causal prefill kernel (benchmarks compare the two).
    short_prefill_decode_attention: bool = option(True, "on-off")

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
        for name, kind in option_kinds().items():  # the flags: true or false (or None: the default)
            value = getattr(self, name)
            if (kind == "on-off" and not isinstance(value, bool)
                    or kind == "auto-on-off" and value not in (None, True, False)):
                raise ModelError(f"{name} must be true or false{' (or None: the default)' * (kind == 'auto-on-off')}, "
                                 f"not {value!r}")
        if self.prefill_chunk is not None and (not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1):
            raise ModelError(f"prefill_chunk must be a positive number of tokens, not {self.prefill_chunk!r}")
        if self.pipeline_depth is not None and self.pipeline_depth not in range(2, MAX_PIPELINE_DEPTH + 1):
            raise ModelError(f"pipeline_depth must be 2..{MAX_PIPELINE_DEPTH} passes, not {self.pipeline_depth!r}")
        return self

    def resolved(self, *, is_cpu: bool, context_length: int) -> "RunOptions":
        """Every None filled with this adapter's default; max_context capped at the model's context."""
        self.check()
        defaults = option_defaults(is_cpu)
        return replace(self, max_context=min(self.max_context or context_length, context_length),
                       **{name: defaults[name] if getattr(self, name) is None else getattr(self, name)
                          for name in defaults})

    def merged(self, request: "RunOptions | None") -> "RunOptions":
        """A request's options over these (resolved) ones: the request's None fields keep ours."""
        if request is None:
            return self
        request.check()
        for name in load_time_options():
            if getattr(request, name) not in (None, getattr(self, name)):
                raise ModelError(f"{name} is chosen when the model loads ({getattr(self, name)}); "
                                 f"load it again for {getattr(request, name)}")
        return replace(self, **{name: getattr(request, name) for name, kind in option_kinds().items()
                                if name not in load_time_options()
                                and not (getattr(request, name) is None and kind in ("auto-on-off", "count"))})

    def per_request(self) -> "RunOptions":
        """These options as a request to a loaded model: the load-time fields left to the model's."""
        return replace(self, **dict.fromkeys(load_time_options()))

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
        """Options by field name, each typed or in its text form (`option_value`); unknown names are refused."""
        if not isinstance(values, dict):
            raise ModelError(f"bad run options: {values!r} is not an object")
        kinds = option_kinds()
        unknown = sorted(set(values) - set(kinds))
        if unknown:
            raise ModelError(f"unknown run options {unknown} (known: {sorted(kinds)})")
        return cls(**{name: option_value(name, value) for name, value in values.items()}).check()

    def to_json(self) -> dict:
        values = asdict(self)
        values["layout"] = None if self.layout is None else str(self.layout)
        return values


TRUE_WORDS, FALSE_WORDS = ("on", "true", "1"), ("off", "false", "0")


@cache  # read for every field of every request; the fields never change
def option_kinds() -> dict[str, str]:
    """Field name -> its kind (OPTION_KINDS), from the field's metadata."""
    return {f.name: f.metadata["kind"] for f in fields(RunOptions)}


@cache
def load_time_options() -> tuple[str, ...]:
    """The fields chosen when the model loads (a request may only repeat them)."""
    return tuple(f.name for f in fields(RunOptions) if f.metadata["when"] == "load")


def option_value(name: str, value):
    """A field's value from its text form ("auto" / "on" / "off", a whole number, a layout such as
    "shards:8", a nest), or `value` itself where it is not text (JSON's own booleans and numbers)."""
    kind = option_kinds()[name]
    if not isinstance(value, str) or kind == "text":
        return value
    word = value.strip().lower()
    if kind == "auto-on-off" and word == "auto":
        return None
    if kind in ("auto-on-off", "on-off") and word in TRUE_WORDS + FALSE_WORDS:
        return word in TRUE_WORDS
    if kind == "count" and word.isdigit():
        return int(word)
    expected = {"auto-on-off": "auto, on or off", "on-off": "on or off", "count": "a whole number"}[kind]
    raise ModelError(f"{name} must be {expected}, not {value!r}")
