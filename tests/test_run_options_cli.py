"""One mapping from text to RunOptions: the CLI's flags, the bench's modes and the page's URL."""

import argparse

import pytest

from app.__main__ import build_parser
from app.run_options_cli import FIELD_HELP, parse_mode, run_options
from chat.api import constants
from contract.attention import LayoutChoice
from model_glue.errors import ModelError
from model_glue.options import RunOptions, option_kinds


def test_every_field_has_a_flag_a_help_line_and_a_url_name():
    assert set(FIELD_HELP) == set(option_kinds())
    assert constants()["RUN_OPTION_NAMES"] == [name for name in option_kinds() if name != "max_context"]


def test_generate_sets_what_the_bench_can():
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--layout", "shards:8", "--merge-in-o", "off",
                                      "--time-attention-every", "0", "--matmul-int8-x", "auto", "--replay", "off"])
    assert run_options(args) == RunOptions(layout=LayoutChoice("shards", 8), merge_in_o=False, time_attention_every=0,
                                           replay=False)
    assert run_options(build_parser().parse_args(["generate", "--prompt", "hi"])) == RunOptions()


def test_bench_modes_are_fields():
    args = build_parser().parse_args(["bench", "decode", "--mode", "default", "--mode", "attention=tiled",
                                      "--mode", "layout=shards,time_attention_every=2", "--fold-norms", "off"])
    assert args.modes == [{}, {"attention": "tiled"}, {"layout": "shards", "time_attention_every": "2"}]
    assert RunOptions.from_dict({**{"fold_norms": "off"}, **args.modes[2]}) == RunOptions(
        layout=LayoutChoice("shards"), time_attention_every=2, fold_norms=False)
    for bad in ("auto:one-pass", "layout", "speed=fast", "merge_in_o=sometimes"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_mode(bad)


def test_text_values_are_checked_by_the_options_themselves():
    assert RunOptions.from_dict({"prefill_matrix": "auto", "warm_up": "on", "pipeline_depth": "4"}) == RunOptions(
        prefill_matrix=None, warm_up=True, pipeline_depth=4)
    assert RunOptions.from_dict({"merge_in_o": False, "prefill_chunk": 64}).prefill_chunk == 64  # JSON's own types
    for bad, message in (({"pipeline_depth": "four"}, "a whole number"), ({"replay": "auto"}, "on or off"),
                         ({"pipeline_depth": "9"}, "2..8"), ({"layout": "rows:2"}, "sharded layout")):
        with pytest.raises(ModelError, match=message):
            RunOptions.from_dict(bad)
