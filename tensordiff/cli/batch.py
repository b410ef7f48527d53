"""``tensordiff batch -o FILE --vocab V``: one batch file both frameworks load (``--check FILE`` reads one)."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from .. import batch as batches
from ..errors import UsageError


def add_parsers(sub: Any) -> None:
    b = sub.add_parser("batch", help="write one batch file that both frameworks load",
                       description="Write a batch file (tokens, labels, loss mask, attention mask, position ids, seed) that "
                                   "each framework loads with tensordiff.batch.load(path, vocab_size, framework). With "
                                   "--check, read an existing file and check it against a vocabulary instead.",
                       epilog="example: tensordiff batch -o batch.h5 --vocab 128 --seq 16 --batch 2 --seed 0")
    b.add_argument("-o", "--output", help="batch file to write")
    b.add_argument("--vocab", type=int, help="the model's vocabulary size")
    b.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    b.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    b.add_argument("--seed", type=int, default=0, help="seed of the ids or of the text windows (default 0)")
    b.add_argument("--text", help="take windows of this UTF-8 text file, one byte per token (needs --vocab >= 256)")
    b.add_argument("--low", type=int, default=1, help="smallest random id (default 1: id 0 is often padding)")
    b.add_argument("--mindrecord", metavar="FILE",
                   help="also write the rows as a MindRecord file (column input_ids, [S+1] ids a row: what MindFormers' "
                        "Trainer reads through a MindDataset train_dataset); needs MindSpore")
    b.add_argument("--check", metavar="FILE", help="check FILE (against --vocab when given) and print it")
    b.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.check:
        b = batches.read(args.check, args.vocab)
        ids = np.concatenate([b.tokens.ravel(), b.labels.ravel()])
        print(f"{args.check}: batch {b.batch_size} x seq {b.seq_length}, ids {ids.min()}..{ids.max()}, "
              f"source {b.attrs.get('source', '?')}, seed {b.attrs.get('seed', '?')}"
              + (f"; fits vocab {args.vocab}" if args.vocab else ""))
        return 0
    if not args.output or args.vocab is None:
        raise UsageError("tensordiff batch needs -o FILE and --vocab V, e.g. tensordiff batch -o batch.h5 --vocab 128 --seq 16")
    b = batches.make(args.vocab, args.seq, args.batch, seed=args.seed, text=args.text, low=args.low)
    batches.save(args.output, b)
    print(f"tensordiff: wrote {args.output}: batch {b.batch_size} x seq {b.seq_length}, vocab {args.vocab}, "
          f"{b.attrs['source']}, seed {args.seed}")
    if args.mindrecord:
        batches.save_mindrecord(args.mindrecord, b)
        print(f"tensordiff: wrote {args.mindrecord}: {b.batch_size} rows of input_ids [{b.seq_length + 1}] (MindRecord)")
    return 0
