"""``tensordiff config A B``: two runs' configurations, before any tensor."""

from __future__ import annotations

import argparse
from typing import Any

from ..config import compare_settings, read_config
from ..report.config import ConfigReport
from ._args import add_output, console, write_json


def add_parsers(sub: Any) -> None:
    u = sub.add_parser("config", help="compare two runs' configurations: what differs in effect",
                       description="Compare two runs' settings before any tensor: Megatron-LM logs (the argument "
                                   "block), flags files or checkpoint folders, MindFormers YAMLs, Hugging Face "
                                   "config.json, captures (the model config they recorded). Exit 0: no setting "
                                   "differs in effect; 1: some do; 2: bad input.",
                       epilog="example: tensordiff config megatron.log llama.yaml --json config.json")
    u.add_argument("a", help="run A: a Megatron-LM log or flags file, a checkpoint folder, a YAML, a config.json or "
                             "a capture")
    u.add_argument("b", help="run B")
    u.add_argument("--json", metavar="FILE", help="also write a machine-readable report")
    add_output(u)
    u.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    diff = compare_settings(read_config(args.a), read_config(args.b))
    console(args).print(ConfigReport(diff))
    write_json(args.json, diff.as_dict())
    return 1 if diff.differ else 0
