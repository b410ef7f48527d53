"""``tensordiff batch -o FILE --vocab V``: one batch file both frameworks load (``--check FILE`` reads one;
``--from-capture RUN.h5`` takes the rows a captured run trained on)."""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from .. import batch as batches
from ..errors import BatchError, UsageError
from ..store import CaptureFile


def add_parsers(sub: Any) -> None:
    b = sub.add_parser("batch", help="write one batch file that both frameworks load",
                       description="Write a batch file (tokens, labels, loss mask, attention mask, position ids, seed) that "
                                   "each framework loads with tensordiff.batch.load(path, vocab_size, framework). With "
                                   "--check, read an existing file and check it against a vocabulary instead.",
                       epilog="examples: tensordiff batch -o batch.h5 --vocab 128 --seq 16 --batch 2 --seed 0; "
                              "tensordiff batch --from-capture megatron.h5 -o batch.h5 --mindrecord batch.mindrecord")
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
    b.add_argument("--from-capture", metavar="CAPTURE",
                   help="take the rows from a capture instead: the token ids, labels and loss mask the captured run's "
                        "model was called with, every captured step in order (stored in full: capture with --tensors "
                        "all); e.g. what Megatron-LM trained on with --mock-data, for the other framework")
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
    if args.from_capture:
        return _from_capture(args)
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


def _from_capture(args: argparse.Namespace) -> int:
    if not args.output:
        raise UsageError("tensordiff batch --from-capture needs -o FILE, e.g. tensordiff batch --from-capture "
                         f"{args.from_capture} -o batch.h5")
    if args.text:
        raise UsageError("--from-capture and --text: choose one source of ids")
    calls, attrs = model_calls(args.from_capture)
    b = batches.from_calls(calls, attrs, args.vocab)
    batches.save(args.output, b)
    ids = np.concatenate([b.tokens.ravel(), b.labels[:, -1]])
    counted, total = int(b.loss_mask.sum()), b.loss_mask.size
    print(f"tensordiff: wrote {args.output}: {b.batch_size} rows x seq {b.seq_length} from the model's inputs of "
          f"step(s) {b.attrs['steps']} of {args.from_capture} ({b.attrs['calls']} call(s), in order), ids "
          f"{ids.min()}..{ids.max()}; its loss mask counts {counted} of {total} labels")
    if args.mindrecord:
        batches.save_mindrecord(args.mindrecord, b)
        per_step = b.batch_size // max(1, len(b.attrs["steps"].split(",")))
        print(f"tensordiff: wrote {args.mindrecord}: {b.batch_size} rows of input_ids [{b.seq_length + 1}] (MindRecord), "
              f"{per_step} a step: train on it with batch_size {per_step}, shuffle False, one epoch")
        if counted < total:
            print(f"tensordiff: note: the capture's loss mask leaves out {total - counted} label(s); the MindRecord holds "
                  "input_ids only, and MindFormers' Llama counts every position whose token is not its pad_token_id")
        zeros = int((b.tokens == 0).sum())
        if zeros:
            print(f"tensordiff: note: id 0 occurs {zeros} time(s); MindFormers' Llama takes tokens equal to its "
                  "pad_token_id (0 by default) for padding, in the attention mask and in the loss: unless 0 is padding "
                  "for the captured run too, set pad_token_id to an id that never occurs (-1)")
    return 0


def model_calls(path: str) -> tuple[list[batches.ModelCall], dict]:
    """Every call of the captured model, step after step (its ``<model>`` forward input records), with the batch
    attributes that say where they come from."""
    if any(c in path for c in "*?["):
        raise BatchError(f"{path}: --from-capture reads one capture file, not a pattern of rank files; pass the file of "
                         "a rank that holds the whole batch (rank 0 at data parallelism 1)")
    calls: list[batches.ModelCall] = []
    with CaptureFile(path) as cap:
        if not cap.steps:
            raise BatchError(f"{path}: no complete step in the capture; capture at least one training step")
        for step in cap.steps:
            inputs = [r for r in cap.records(step) if r.phase == "forward" and r.module == "" and r.kind == "input"]
            if not inputs:
                raise BatchError(f"{path}: step {step} has no record of the model's inputs; capture with inputs "
                                 "recorded (tensordiff capture records them unless inputs=False)")
            for call in sorted({r.call for r in inputs}):
                where = f"{path}: step {step}" + (f", call {call}" if call else "")
                calls.append(batches.ModelCall(where, {r.slot: cap.array(r) for r in inputs if r.call == call}))
        attrs = {"source": f"capture:{os.path.basename(path)}", "capture_framework": cap.framework,
                 "steps": ",".join(str(s) for s in cap.steps)}
    return calls, attrs
