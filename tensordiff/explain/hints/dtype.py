"""Dtype hints: B computes or stores the tensor in BF16/FP16

See docs/hints/dtype.md."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from ... import dtypes
from ...record import Record
from ...store import CaptureReader
from .base import MIN_EXPLAINED, Hint, Site, explained_share, make_hint, rel_l2


def _representable(x: np.ndarray, dtype: Any) -> float:
    x32 = x.astype(np.float32)
    return float(np.mean(x32.astype(dtype).astype(np.float32) == x32))


def _representable_nonzero(x: np.ndarray, dtype: Any) -> float:
    """The share of the nonzero values that are exact numbers of ``dtype`` (a gradient's zeros are in every format)."""
    nz = x[x != 0]
    return _representable(nz, dtype) if nz.size else 0.0


def _local_of(site: Site, side: str) -> Record | None:
    """That side's local gradient (before the data-parallel reduction) of the parameter whose reduced gradient is
    compared here."""
    a, b = site.a, site.b
    if a.phase != "param_grad" or a.kind != "grad" or b.kind != "grad" or site.row.pair.join is not None:
        return None
    cap, rec = (site.ca, a) if side == "A" else (site.cb, b)
    return next((r for r in cap.records(rec.step) if r.kind == "grad_local" and r.module == rec.module
                 and r.call == rec.call and r.slot == rec.slot), None)


def _reduced_in(copies: list[np.ndarray], dt: Any) -> np.ndarray:
    """Each rank's local gradient rounded to ``dt``, summed in ``dt`` (rounded after each addition), over DP (a
    power-of-two 1/DP is exact in either order: megatron and torch's compress hook scale first)."""
    acc = copies[0].astype(np.float32).astype(dt).astype(np.float64)
    for x in copies[1:]:
        acc = (acc + x.astype(np.float32).astype(dt).astype(np.float64)).astype(np.float32).astype(dt).astype(np.float64)
    return acc / len(copies)


def _reduction_info(cap: CaptureReader, step: int) -> dict[str, Any]:
    """What the capture knows of a step's data-parallel reduction (its ``grad_reduction`` attribute), or {}."""
    try:
        info = json.loads(str(cap.step_attrs(step).get("grad_reduction", "") or "{}"))
    except (ValueError, KeyError, OSError):
        return {}
    return info if isinstance(info, dict) else {}


def _how(info: dict[str, Any]) -> str:
    parts = [str(info["by"])] if info.get("by") else []
    if info.get("comm_hook"):
        parts.append(f"comm hook {info['comm_hook']}")
    if info.get("buffer_dtype"):
        parts.append(f"gradient buffer {'/'.join(map(str, info['buffer_dtype']))}")
    return ", ".join(parts)


def check_reduction_dtype(site: Site, narrow: list[tuple[str, Any, float]]) -> Iterator[Hint]:
    """One side's reduced parameter gradient sits on the BF16/FP16 grid while its local one (before the data-parallel
    reduction) does not: that side reduces the gradients in that format (megatron without grad_reduce_in_fp32, torch
    DDP's bf16_compress_hook, a port that casts before the all-reduce). With its rank files at hand, each rank's
    local gradient rounded and summed in the format (B's side), or averaged in FP32 (A's side), is the hypothesis
    for B."""
    for side in ("B", "A"):
        local = _local_of(site, side)
        cap = site.cb if side == "B" else site.ca
        xl = cap.array(local) if local is not None else None
        if local is None or xl is None:
            continue
        xl = np.asarray(xl, dtype=np.float64)
        reduced = site.xb if side == "B" else site.xa
        for name, dt, eps in narrow:
            share, share_local = _representable_nonzero(reduced, dt), _representable_nonzero(xl, dt)
            if share <= 0.95 or share_local >= 0.5:
                continue
            copies = cap.dp_copies(local) if not site.row.pair.ops else None
            info = _reduction_info(cap, local.step)
            evidence = (f"{share:.1%} of {side}'s reduced gradient values are exact {name} numbers, {share_local:.1%} "
                        f"of its local ones (before the data-parallel reduction, {local.dtype}); relative error "
                        f"{site.before:.1e} = 2^{math.log2(site.before):.1f} ({name} rounding: 2^{math.log2(eps):.0f})")
            details: dict[str, Any] = {"dtype": name, "reduction": True, "side": side, "share_reduced": share,
                                       "share_local": share_local}
            if copies and reduced.shape == copies[0].shape:
                if side == "B":  # B's own ranks, reduced in the narrow format: B
                    after = rel_l2(_reduced_in(copies, dt), site.xb)
                    how = f"rounded to {name} and summed in {name} reproduces B"
                else:  # A's own ranks, averaged in FP32: what B computes
                    after = rel_l2(np.mean(np.stack([c.astype(np.float64) for c in copies]), axis=0), site.xb)
                    how = "averaged in FP32 reproduces B"
                explained = explained_share(site.before, after)
                evidence += (f"; each of {side}'s {len(copies)} data-parallel ranks' local gradient {how} to rel L2 "
                             f"{after:.1e}")
                details["dp"] = len(copies)
            else:
                after = math.nan
                explained = share if eps / 64 <= site.before <= 4 * eps else 0.5 * share
                details["signature_only"] = True
            if _how(info):
                evidence += f"; {side}'s reduction: {_how(info)}"
                details["grad_reduction"] = info
            yield Hint("dtype", f"{side} reduces gradients in {name}; reduce in FP32 (megatron grad_reduce_in_fp32, "
                       f"torch DDP without the {name.lower()} compress hook)", explained, site.before, after, evidence,
                       details)
            return


#: The most a wider compute (float64 for a float32 output) moves a linear layer's output, in roundings of the stored
#: dtype: its accumulation error over the inner dimension (1e-7..1e-6 relative in float32).
WIDER_GAP = 1000
#: ... and never more than this (relative L2): in BF16 a thousand roundings would be any gap at all.
WIDER_MAX = 0.05


def _higher_precision(site: Site) -> Iterator[Hint]:
    """One side computes a linear layer in a wider dtype than it stores (float64 for float32): its output is the
    exact product of the agreeing input and weight, rounded once to the stored dtype, and the other side's is not."""
    a = site.a
    if a.phase != "forward" or a.kind != "output" or not dtypes.is_float(a.dtype) or site.b.dtype != a.dtype:
        return
    if not site.before <= min(WIDER_GAP * dtypes.resolution(a.dtype), WIDER_MAX):
        return  # a wider compute moves the output by the stored dtype's accumulation error, not more
    w = site.weights(a.module).get("weight")
    ins = site.inputs(a.module, a.call)
    if w is None or w.ndim != 2 or not ins or ins[0].shape[-1] != w.shape[1]:
        return
    exact = ins[0] @ w.T  # float64: the product as a wider compute makes it
    bias = site.weights(a.module).get("bias")
    if bias is not None and bias.shape == exact.shape[-1:]:
        exact = exact + bias
    stored = dtypes.NUMPY_DTYPES.get(a.dtype)
    once = exact.astype(stored).astype(np.float64) if stored is not None else exact
    if once.shape != site.xa.shape:
        return
    err_a, err_b = rel_l2(once, site.xa), rel_l2(once, site.xb)
    for side, mine, other, of in (("B", err_b, err_a, site.b), ("A", err_a, err_b, site.a)):
        if mine <= 0.05 * site.before and other >= 0.5 * site.before:
            yield make_hint("dtype", f"{side} computes {of.module or '<model>'} in float64 (a wider dtype than its "
                            f"{a.dtype} output): the exact product of the same input and weight, rounded once",
                            site, mine, f"the input × weight in float64 rounded to {a.dtype} reproduces {side} to rel "
                            f"L2 {mine:.1e}, the other side to {other:.1e} (its {a.dtype} accumulation)",
                            dtype="float64", side=side)
            return


def check_dtype(site: Site) -> Iterator[Hint]:
    """B computes (or stores) this tensor in BF16/FP16: recomputed from rounded inputs it matches B, or its values
    sit on the narrow grid with an error of the format's rounding size (2^-8 for BF16). At a reduced parameter
    gradient whose local one is not on the grid: B reduces the gradients in that format."""
    a = site.a
    linear = None  # (input, weight) of a linear layer whose exact product reproduces A
    if a.phase == "forward" and a.kind == "output":
        w = site.weights(a.module).get("weight")
        ins = site.inputs(a.module, a.call)
        if w is not None and w.ndim == 2 and ins and ins[0].shape[-1] == w.shape[1] \
                and rel_l2(ins[0] @ w.T, site.xa) <= 0.05 * site.before:
            linear = (ins[0], w)
    wider = list(_higher_precision(site))
    if wider:
        yield from wider
        return
    narrow: list[tuple[str, Any, float]] = [("FP16", np.dtype(np.float16), 2.0 ** -11)]
    if "bfloat16" in dtypes.NUMPY_DTYPES:  # ml_dtypes installed
        narrow.insert(0, ("BF16", dtypes.NUMPY_DTYPES["bfloat16"], 2.0 ** -8))
    reduction = list(check_reduction_dtype(site, narrow))
    if reduction:
        yield from reduction
        return
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
