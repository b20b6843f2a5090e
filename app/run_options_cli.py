"""The command line's one mapping to RunOptions: a flag per field, and the bench's modes as fields.

Every flag takes the field's text form (model_glue.options.option_value: auto / on / off, a whole
number, a layout such as shards:8), so `--merge-in-o off` on any command, `merge_in_o=off` in a
bench mode and `?merge_in_o=off` in the page's URL are the same option.
"""

from __future__ import annotations

import argparse

from contract.attention import NEST_CHOICES
from model_glue.errors import ModelError
from model_glue.options import RunOptions, option_kinds

# One line a field (model_glue/options.py says more beside each field).
FIELD_HELP = {
    "max_context": "tokens the KV cache holds (default: the model's context, at most 4,096 in the page)",
    "attention": f"the decode attention nest: {', '.join(NEST_CHOICES)}",
    "layout": "hold the sharded nest to a layout and split count, e.g. shards:8 or subgroup (default: the adapter's rule)",
    "replay": "replay recorded decode passes (off: encode every pass)",
    "fold_norms": "fold each RMSNorm and SwiGLU into the matmuls",
    "prefill_chunk": "prompt tokens per prefill pass",
    "pipeline_depth": "decode steps in flight (2..8)",
    "warm_up": "bind the passes at load with a dummy prompt",
    "time_attention_every": "time each layer's attention in every Nth decode step (1: every step, 0: none)",
    "merge_in_o": "merge a split attention call's states inside the o-projection",
    "matmul_subgroups": "the decode matmuls' subgroup builds (lanes' partials added by shuffles)",
    "matmul_int8_x": "the decode step's q4 matmuls on int8 codes of x",
    "prefill_matrix": "the prefill matmuls on subgroup matrices (the tensor cores)",
    "prefill_attention_matrix": "the prefill attention's subgroup-matrix build",
    "short_prefill_decode_attention": "a short follow-up turn's attention through the decode kernels",
}
METAVARS = {"auto-on-off": "auto|on|off", "on-off": "on|off", "count": "N", "text": "TEXT"}


def add_run_options(parser: argparse.ArgumentParser, *, leave_out: tuple[str, ...] = ()) -> None:
    """A `--field-name VALUE` flag for each RunOptions field but `leave_out` (fields the command sets)."""
    group = parser.add_argument_group("run options (model_glue.options.RunOptions; default: the adapter's)")
    for name, kind in option_kinds().items():
        if name not in leave_out:
            group.add_argument("--" + name.replace("_", "-"), dest=f"option_{name}", metavar=METAVARS[kind],
                               help=FIELD_HELP[name])


def given_options(args: argparse.Namespace) -> dict[str, str]:
    """The run options given on the command line, by field name, in their text form."""
    return {name: value for name in option_kinds() if (value := getattr(args, f"option_{name}", None)) is not None}


def run_options(args: argparse.Namespace, **fixed) -> RunOptions:
    """RunOptions of the flags given, with `fixed` (what the command itself sets) over them."""
    return RunOptions.from_dict({**given_options(args), **fixed})


def parse_mode(text: str) -> dict[str, str]:
    """A bench mode: RunOptions fields as `name=value` joined by commas, e.g. `attention=tiled` or
    `layout=shards,time_attention_every=0`; `default` is no field."""
    if text.strip() == "default":
        return {}
    pairs = [part.partition("=") for part in text.split(",") if part.strip()]
    bad = [name for name, eq, value in pairs if not eq or not value or name.strip() not in option_kinds()]
    if bad or not pairs:
        raise argparse.ArgumentTypeError(f"a mode is RunOptions fields as name=value joined by commas "
                                         f"(fields: {', '.join(option_kinds())}), not {text!r}")
    values = {name.strip(): value.strip() for name, _, value in pairs}
    try:
        RunOptions.from_dict(values)
    except ModelError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return values
