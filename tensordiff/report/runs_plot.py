"""Pictures and a shareable page for ``tensordiff runs``: the PNG plot and the self-contained HTML report.

matplotlib is needed for the plot only (``pip install 'tensordiff[plot]'``); it is imported here, on demand.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import math
import os
from typing import Any

from .._version import __version__
from ..errors import UsageError
from ..runs.compare import Comparison
from ..runs.drift import DriftTable
from ..runs.run import Run
from .runs import DEFAULT_TOP

A_COLOR, B_COLOR, BAD_COLOR = "#1f77b4", "#d62728", "#b00020"


def rel_series(res: Comparison) -> tuple[list[float], list[int], float]:
    """The loss's relative difference per common step for a log axis: (values, the steps where the losses are
    bit-identical, the floor they are drawn at). A zero has no place on a log scale: it is drawn at a floor a
    decade below the smallest difference (or the threshold's 1e-6), so the curve has no unexplained gaps."""
    positive = [v for v in (res.rel_loss[s] for s in res.steps) if v > 0 and math.isfinite(v)]
    floor = 10 ** math.floor(math.log10(min(positive) / 10)) if positive else res.threshold * 1e-6
    equal = [s for s in res.steps if res.rel_loss[s] == 0]
    return [res.rel_loss[s] if res.rel_loss[s] != 0 else floor for s in res.steps], equal, floor


def _label(run: Run, side: str) -> str:
    return f"{side}: {os.path.basename(run.path)} ({run.kind})"


def plot_png(res: Comparison, dpi: int = 110, drift: DriftTable | None = None) -> bytes:
    """Loss curves of A and B (validation loss as markers), their relative error against the threshold,
    the grad norms where both runs logged them, and the layer x step drift heat map of two captures (``drift``).
    Returns the PNG's bytes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot and --html need matplotlib, which is not installed: "
                         "pip install 'tensordiff[plot]' (or pip install matplotlib)") from None
    a, b = res.a, res.b
    gn_steps = sorted(set(a.grad_norm) & set(b.grad_norm))
    panels = 3 if gn_steps else 2
    ratios = [2, 1.2, 1.2][:panels]
    heat = 0.0
    if drift is not None and drift.layers:
        heat = min(max(1.6, 0.16 * len(drift.layers) + 0.5), 14.0)  # inches: rows stay readable up to ~80 layers
        ratios.append(heat / 2.6 * 1.2 + 0.3)
    fig, axes = plt.subplots(len(ratios), 1, figsize=(9, 2.6 * panels + 0.6 + (heat + 0.9 if heat else 0)),
                             sharex=True, gridspec_kw={"height_ratios": ratios})
    ax = axes[0]
    for run, side, color, style in ((a, "A", A_COLOR, "-"), (b, "B", B_COLOR, "--")):
        steps = sorted(run.loss)
        ax.plot(steps, [run.loss[s] for s in steps], style, color=color, lw=1.2, label=_label(run, side) + " train")
        if run.val_loss:
            vs = sorted(run.val_loss)
            ax.plot(vs, [run.val_loss[s] for s in vs], "o" if side == "A" else "x", color=color, ms=5,
                    label=f"{side} validation")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    ax.set_title(res.verdict(), fontsize=10, color="#006400" if res.passed else BAD_COLOR, loc="left")

    ax = axes[1]
    steps = res.steps
    rel, equal, floor = rel_series(res)
    ax.semilogy(steps, rel, color="#444444", lw=1.0, label="loss |B − A| / |A|")
    if equal:
        ax.semilogy(equal, [floor] * len(equal), "v", color="#2ca02c", ms=3,
                    label=f"losses bit-identical ({len(equal)} steps, drawn at {floor:.0e})")
    if gn_steps:
        ax.semilogy(gn_steps, [abs(b.grad_norm[s] - a.grad_norm[s]) / abs(a.grad_norm[s])
                               if a.grad_norm[s] and b.grad_norm[s] != a.grad_norm[s] else math.nan for s in gn_steps],
                    color="#ff7f0e", lw=0.8, alpha=0.8, label="grad norm |B − A| / |A| (not judged)")
    ax.axhline(res.threshold, color=BAD_COLOR, ls="--", lw=1, label=f"threshold {res.threshold:.2%}")
    if res.warmup > 0:
        ax.axvspan(steps[0], min(res.warmup, steps[-1]), color="#999999", alpha=0.15, label="warm-up (not judged)")
    if res.first_over is not None:
        ax.axvline(res.first_over, color=BAD_COLOR, lw=1, label=f"first over: step {res.first_over}")
    low, high = ax.get_ylim()
    ax.set_ylim(low / 100, max(high, res.threshold * 3))  # room below the curves for the legend
    ax.set_ylabel("relative difference")
    ax.legend(fontsize=7, loc="lower right", ncol=2, framealpha=0.85)
    ax.grid(alpha=0.3, which="major")

    if gn_steps:
        ax = axes[2]
        if heat:
            ax.tick_params(labelbottom=False)
        ax.plot(gn_steps, [a.grad_norm[s] for s in gn_steps], "-", color=A_COLOR, lw=1.0, label="A grad norm")
        ax.plot(gn_steps, [b.grad_norm[s] for s in gn_steps], "--", color=B_COLOR, lw=1.0, label="B grad norm")
        ax.set_ylabel("grad norm")
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(alpha=0.3)
    if heat:
        assert drift is not None
        _heat_map(fig, axes[-1], drift, res.first_over)
    axes[-1].set_xlabel("step")
    fig.tight_layout(rect=(0, 0.55 / fig.get_figheight(), 1, 1) if heat else None)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


#: Marker of a layer's first drift step, by the kind that departed first.
KIND_MARKERS = {"weights": "s", "forward": "o", "backward": "v", "param_grad": "D"}


def _heat_map(fig: Any, ax: Any, drift: DriftTable, loss_over: int | None) -> None:
    """Layers (rows, execution order top down) x steps, colour = log10(departure / tolerance): blue within the noise,
    white at the tolerance, red beyond; grey where a step holds no value. A marker at each layer's first drift step
    (its shape: the kind that departed first), the baseline's end dashed, the step where the loss curves part a
    vertical line."""
    import matplotlib.colors as mcolors
    import numpy as np

    steps = np.asarray(drift.steps, dtype=float)
    rows = np.array([drift.layer_ratios(la) for la in drift.layers], dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log10(rows)
    lo, hi = -3.0, max(3.0, float(np.nanmax(np.where(np.isinf(logs), np.nan, logs), initial=3.0)))
    logs = np.where(np.isneginf(logs), lo, np.where(np.isposinf(logs), hi, logs))
    logs = np.clip(logs, lo, hi)
    # cell edges half-way between logged steps (every step or every Nth)
    mids = (steps[1:] + steps[:-1]) / 2 if len(steps) > 1 else np.array([])
    first_gap = (steps[1] - steps[0]) if len(steps) > 1 else 1.0
    last_gap = (steps[-1] - steps[-2]) if len(steps) > 1 else 1.0
    edges = np.concatenate([[steps[0] - first_gap / 2], mids, [steps[-1] + last_gap / 2]])
    # calm below the tolerance (light blue, bit-identical at the palest), loud above it (red)
    cmap = mcolors.LinearSegmentedColormap.from_list(
        "tensordiff_drift", [(0.0, "#c6dbef"), (0.5, "#f7f7f7"), (0.5001, "#fddbc7"), (0.75, "#d6604d"),
                             (1.0, "#67001f")])
    cmap.set_bad("#9e9e9e")
    norm = mcolors.TwoSlopeNorm(vmin=lo, vcenter=0.0, vmax=hi)
    mesh = ax.pcolormesh(edges, np.arange(len(drift.layers) + 1) - 0.5, np.ma.masked_invalid(logs), cmap=cmap,
                         norm=norm, shading="flat")
    ax.set_ylim(len(drift.layers) - 0.5, -0.5)
    every = max(1, math.ceil(len(drift.layers) / 60))
    ax.set_yticks(range(0, len(drift.layers), every))
    ax.set_yticklabels(drift.layers[::every], fontsize=7 if len(drift.layers) <= 30 else 6)
    ax.axvline(edges[drift.baseline], color="black", ls="--", lw=1.0,
               label=f"noise measured up to step {drift.steps[drift.baseline - 1]}")
    shown: set[str] = set()
    for y, layer in enumerate(drift.layers):
        cell = drift.layer_first(layer)
        if cell is None or cell.first is None:
            continue
        ax.plot(drift.steps[cell.first], y, KIND_MARKERS.get(cell.kind, "o"), ms=6, mfc="none", mec="black", mew=1.3,
                label=None if cell.kind in shown else f"first drift ({cell.kind})")
        shown.add(cell.kind)
    ranking = drift.ranking()
    if ranking:
        first = ranking[0]
        ax.plot(drift.steps[first.first], drift.layers.index(first.layer), "*", ms=13,  # type: ignore[index]
                mfc="#ffd700", mec="black", mew=0.8, label=f"earliest: {first.layer}")
    if drift.loss_parts is not None:
        ax.axvline(drift.steps[drift.loss_parts], color=BAD_COLOR, lw=1.4,
                   label=f"loss departs: step {drift.steps[drift.loss_parts]}")
    if loss_over is not None:
        ax.axvline(loss_over, color=BAD_COLOR, lw=1, ls=":", label=f"loss over threshold: step {loss_over}")
    cax = ax.inset_axes([1.012, 0.0, 0.015, 1.0])
    bar = fig.colorbar(mesh, cax=cax)
    bar.set_label("log10(departure / tolerance)", fontsize=7)
    bar.ax.tick_params(labelsize=7)
    ax.set_title(("DRIFT: " if drift.drifted else "NO DRIFT: ") + drift.verdict(), fontsize=8, loc="left",
                 color="#8a6d00" if drift.drifted else "#006400", wrap=True)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=3, framealpha=0.9)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.5em; } .pass { color: #006400; } .fail { color: #b00020; }
table { border-collapse: collapse; margin: 1em 0; } td, th { padding: .25em .8em; border-bottom: 1px solid #ddd; }
td.n { text-align: right; font-family: ui-monospace, monospace; } th { text-align: left; }
img { max-width: 100%; } code { background: #f4f4f4; padding: 0 .2em; } details { margin-top: 1em; }
"""


def _drift_html(drift: DriftTable | None, top: int) -> str:
    """The drift section of the page: its verdict, the earliest-drifting layers, what was not compared."""
    if drift is None:
        return ""
    from .runs import drift_rows, drift_title

    e = html.escape
    rows = "\n".join("<tr>" + "".join(f"<td{' class=n' if i in (1, 4, 5) else ''}>{e(v)}</td>" for i, v in enumerate(r))
                     + "</tr>" for r in drift_rows(drift, top))
    table = (f"<table><tr><th>layer</th><th>first drift</th><th>kind</th><th>first record over</th>"
             f"<th>ratio there</th><th>max ratio</th></tr>\n{rows}\n</table>" if rows else "")
    notes = "".join(f"<li>{e(n)}</li>" for n in drift.notes())
    mapping = f"<p><small>mapping: {e(drift.mapping_note)}</small></p>" if drift.mapping_note else ""
    return f"""<h2>Layer drift</h2>
<p>{e(drift_title(drift))}. The heat map (last panel above) colours each layer and step by log10(departure / tolerance):
blue within the noise of the first steps, red beyond it; a marker at each layer's first drift step.</p>
<p class="{'fail' if drift.drifted else 'pass'}"><b>{'DRIFT' if drift.drifted else 'NO DRIFT'}: {e(drift.verdict())}</b></p>
{table}
{f'<p>Not compared:</p><ul>{notes}</ul>' if notes else '<p>Every step and record was compared.</p>'}
{mapping}"""


def write_html(res: Comparison, path: str, png: bytes | None = None, drift: DriftTable | None = None,
               top: int = DEFAULT_TOP) -> None:
    """One file, nothing to fetch: the verdict, the measures, the plot (inline PNG), the layer drift table of two
    captures, and the per-step losses."""
    e = html.escape
    rows = "\n".join(f"<tr><td>{e(m)}</td><td class=n>{e(x)}</td><td class=n>{e(y)}</td><td class=n>{e(r)}</td></tr>"
                     for m, x, y, r in res.measures())
    per_step = "\n".join(
        f"<tr><td class=n>{s}</td><td class=n>{res.a.loss[s]:.6g}</td><td class=n>{res.b.loss[s]:.6g}</td>"
        f"<td class=n>{res.rel_loss[s]:.3e}</td></tr>" for s in res.steps)
    alt = "loss curves, relative error, grad norms" + (", layer drift heat map" if drift else "")
    img = (f'<img alt="{alt}" '
           f'src="data:image/png;base64,{base64.b64encode(png).decode()}">' if png else "")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>tensordiff runs: {e(os.path.basename(res.a.path))} vs {e(os.path.basename(res.b.path))}</title>
<style>{_CSS}</style></head><body>
<h1>tensordiff runs</h1>
<p>A <code>{e(res.a.describe())}</code><br>
B <code>{e(res.b.describe())}</code></p>
<p class="{'pass' if res.passed else 'fail'}"><b>{e(res.verdict())}</b></p>
<table><tr><th>{len(res.steps)} common steps, judged {e(res.judged_text())}</th><th>A</th><th>B</th><th>relative</th></tr>
{rows}
</table>
{img}
{_drift_html(drift, top)}
<details><summary>loss per common step</summary>
<table><tr><th>step</th><th>A</th><th>B</th><th>|B − A| / |A|</th></tr>
{per_step}
</table></details>
<p><small>tensordiff {e(__version__)}, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')};
threshold {res.threshold:g}, warm-up {res.warmup} steps.</small></p>
</body></html>
"""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)
