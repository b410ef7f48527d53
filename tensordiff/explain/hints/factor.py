"""Factor hints: B = c × A (a loss reduction, DP averaging, gradient accumulation, a loss scale)

See docs/hints/factor.md."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np

from ...store import CaptureReader
from .base import MIN_EXPLAINED, Hint, NotApplicable, Site, explained_share, make_hint, rel_l2


def _data_parallel(cap: CaptureReader) -> int:
    """The data-parallel size of a run: merged rank files know it, a rank file says it in its ``parallel`` attribute."""
    if cap.merged:
        return cap.dp
    try:
        coords = json.loads(str(cap.attrs.get("parallel", "") or "{}"))
        return int(coords.get("dp") or coords.get("world_size") or 1) if isinstance(coords, dict) else 1
    except (ValueError, TypeError):
        return 1


def _hidden_size(site: Site) -> int | None:
    """The model's hidden size, from either capture's recorded config."""
    for cap in (site.ca, site.cb):
        try:
            cfg = json.loads(str(cap.attrs.get("model_config", "") or "{}"))
        except ValueError:
            continue
        value = cfg.get("hidden_size") if isinstance(cfg, dict) else None
        if isinstance(value, int) and value > 1:
            return value
    return None


def check_factor(site: Site) -> Iterator[Hint]:
    """B = c * A: a loss reduction (sum vs mean), DP averaging, gradient accumulation, a loss scale."""
    aa = float(np.vdot(site.xa, site.xa))
    if aa == 0:
        raise NotApplicable("A is all zeros")
    if not np.any(site.xb):
        # B is all zeros: no scale of A, but a tensor that is missing on B (a bias or weight not loaded or dropped,
        # a gradient that never arrived); at the first step's weights the checkpoint hint names it
        if site.a.phase != "weights":
            yield make_hint("factor", f"B's {site.b.label} is all zeros where A's is not: not computed, not loaded or "
                            "dropped on B (a missing bias or weight, a gradient that never arrived)", site, 0.0,
                            "B = 0 × A exactly", factor=0.0)
        return
    c = float(np.vdot(site.xa, site.xb)) / aa
    after = rel_l2(c * site.xa, site.xb)
    if abs(c - 1.0) < 1e-6 or explained_share(site.before, after) < MIN_EXPLAINED:
        return
    names = []
    for n in (2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        for value, text in ((n, f"{n}"), (1.0 / n, f"1/{n}")):
            if abs(c - value) <= 0.02 * value:
                names.append(text)
    why = (f"≈ {names[0]}: a sum vs mean over {names[0].split('/')[-1]} (tokens, micro-batches, ranks), "
           "DP averaging, gradient accumulation or a loss scale not undone" if names else
           "a scale applied on one side only (loss scale, learning-rate-like factor, init or checkpoint scaling)")
    hidden = _hidden_size(site)
    if hidden and site.a.phase == "forward" and any(abs(c - v) <= 0.01 * v for v in (hidden ** 0.5, hidden ** -0.5)):
        side = "B" if c > 1 else "A"
        yield make_hint("embedding-scale", f"B = {c:.6g} × A = {'√' if c > 1 else '1/√'}hidden ({hidden}): {side} "
                        f"scales the embeddings by √{hidden} and the other side does not (Gemma's normalizer, "
                        "Megatron-Bridge's embedding scaling): a conversion that dropped or added the embedding scale",
                        site, after, f"the least-squares factor {c:.6g} reproduces B to rel L2 {after:.1e}", factor=c)
        return
    dp_b, dp_a = _data_parallel(site.cb), _data_parallel(site.ca)
    if site.a.phase == "param_grad" and site.a.kind == "grad" and dp_b > 1 and abs(c - dp_b) <= 0.02 * dp_b:
        why = (f"≈ {dp_b}, B's data-parallel size: B sums the gradients over its {dp_b} data-parallel ranks instead "
               "of averaging them; the reduction's 1/DP is missing (megatron's gradient_scaling_factor, the division "
               "in a DDP comm hook or a hand-written all-reduce)")
    elif site.a.phase == "param_grad" and site.a.kind == "grad" and dp_a > 1 and abs(c * dp_a - 1) <= 0.02:
        why = (f"≈ 1/{dp_a}, 1 over A's data-parallel size: A sums the gradients over its {dp_a} data-parallel ranks "
               "instead of averaging them")
    yield make_hint("factor", f"B = {c:.6g} × A ({why})", site, after,
                f"the least-squares factor {c:.6g} reproduces B to rel L2 {after:.1e}", factor=c)
