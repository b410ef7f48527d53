"""Dtype hints: B computes or stores the tensor in BF16/FP16

See docs/hints/dtype.md."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from ... import dtypes
from .base import MIN_EXPLAINED, Hint, Site, explained_share, make_hint, rel_l2


def _representable(x: np.ndarray, dtype: Any) -> float:
    x32 = x.astype(np.float32)
    return float(np.mean(x32.astype(dtype).astype(np.float32) == x32))


def check_dtype(site: Site) -> Iterator[Hint]:
    """B computes (or stores) this tensor in BF16/FP16: recomputed from rounded inputs it matches B, or its values
    sit on the narrow grid with an error of the format's rounding size (2^-8 for BF16)."""
    a = site.a
    linear = None  # (input, weight) of a linear layer whose exact product reproduces A
    if a.phase == "forward" and a.kind == "output":
        w = site.weights(a.module).get("weight")
        ins = site.inputs(a.module, a.call)
        if w is not None and w.ndim == 2 and ins and ins[0].shape[-1] == w.shape[1] \
                and rel_l2(ins[0] @ w.T, site.xa) <= 0.05 * site.before:
            linear = (ins[0], w)
    narrow = [("FP16", np.dtype(np.float16), 2.0 ** -11)]
    if "bfloat16" in dtypes.NUMPY_DTYPES:  # ml_dtypes installed
        narrow.insert(0, ("BF16", dtypes.NUMPY_DTYPES["bfloat16"], 2.0 ** -8))
    for name, dt, eps in narrow:
        # 1. the linear layer recomputed from rounded inputs and weight, output rounded
        if linear is not None:
            x, w = linear
            r = lambda v, dt=dt: v.astype(np.float32).astype(dt).astype(np.float64)
            after = rel_l2(r(r(x) @ r(w).T), site.xb)
            if explained_share(site.before, after) >= MIN_EXPLAINED:
                yield make_hint("dtype", f"B computes {a.module} in {name}: inputs, weight and output rounded to "
                            f"{name}", site, after, f"A's input and weight rounded to {name}, multiplied in "
                            f"float64, the product rounded: reproduces B to rel L2 {after:.1e}", dtype=name)
                return
        # 2. the signature: B's values are all numbers of the narrow format, A's are not
        share_b = _representable(site.xb, dt)
        share_a = _representable(site.xa, dt)
        if share_b > 0.95 and share_a < 0.5:
            near = eps / 64 <= site.before <= 4 * eps
            explained = share_b if near else 0.5 * share_b
            yield Hint("dtype", f"B's values are {name} numbers: B computes or stores this tensor in {name}", explained,
                       site.before, math.nan,
                       f"{share_b:.1%} of B's values are exact {name} numbers, {share_a:.1%} of A's; relative error "
                       f"{site.before:.1e} = 2^{math.log2(site.before):.1f} ({name} rounding: 2^{math.log2(eps):.0f})",
                       {"dtype": name, "share_b": share_b, "signature_only": True})
            return
