"""``tensordiff replay A B --module NAME --model MODULE:FUNCTION``: introduced in the module, or inherited?"""

from __future__ import annotations

import argparse
from typing import Any

from ..explain.replay import load_factory, replay
from ..mapping import RenameRules
from ..report.capture import ReplaySummary
from ._args import add_var, console, parse_vars, write_json


def add_parsers(sub: Any) -> None:
    r = sub.add_parser("replay", help="run one module of A's code on B's captured inputs: introduced or inherited?",
                       description="Build the model with --model (side A's framework), load the module's weights from "
                                   "A's capture and run it on A's and on B's captured inputs. Exit 1: the difference is "
                                   "introduced in the module; 0: inherited from its inputs; 2: error.",
                       epilog="example: tensordiff replay a.h5 b.h5 --module decoder.layers.1.mlp "
                              "--model examples.gpt.models:replay_model")
    r.add_argument("a")
    r.add_argument("b")
    r.add_argument("--module", required=True, help="the module (A's name) to replay")
    r.add_argument("--model", required=True, metavar="MODULE:FUNCTION", help="a function that builds side A's model")
    r.add_argument("--mapping", help="rename rules from B's names to A's (see docs/mapping.md)")
    add_var(r)
    r.add_argument("--step", type=int, default=None, help="step to replay (default: the first in both)")
    r.add_argument("--call", type=int, default=0, help="which call of the module (default 0)")
    r.add_argument("--json", metavar="FILE")
    r.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    mapping = RenameRules.load(args.mapping, parse_vars(args.var)) if args.mapping else None
    res = replay(args.a, args.b, args.module, load_factory(args.model), step=args.step, call=args.call, mapping=mapping)
    console(args).print(ReplaySummary(res))
    write_json(args.json, res.as_dict())
    if res.verdict == "unfaithful":
        return 2
    return 1 if res.verdict == "introduced" else 0
