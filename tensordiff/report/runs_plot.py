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

from .._version import __version__
from ..errors import UsageError
from ..runs.compare import Comparison
from ..runs.run import Run

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


def plot_png(res: Comparison, dpi: int = 110) -> bytes:
    """Loss curves of A and B (validation loss as markers), their relative error against the threshold,
    and the grad norms where both runs logged them. Returns the PNG's bytes."""
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
    fig, axes = plt.subplots(panels, 1, figsize=(9, 2.6 * panels + 0.6), sharex=True,
                             gridspec_kw={"height_ratios": [2, 1.2, 1.2][:panels]})
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
        ax.plot(gn_steps, [a.grad_norm[s] for s in gn_steps], "-", color=A_COLOR, lw=1.0, label="A grad norm")
        ax.plot(gn_steps, [b.grad_norm[s] for s in gn_steps], "--", color=B_COLOR, lw=1.0, label="B grad norm")
        ax.set_ylabel("grad norm")
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h1 { font-size: 1.3em; } .pass { color: #006400; } .fail { color: #b00020; }
table { border-collapse: collapse; margin: 1em 0; } td, th { padding: .25em .8em; border-bottom: 1px solid #ddd; }
td.n { text-align: right; font-family: ui-monospace, monospace; } th { text-align: left; }
img { max-width: 100%; } code { background: #f4f4f4; padding: 0 .2em; } details { margin-top: 1em; }
"""


def write_html(res: Comparison, path: str, png: bytes | None = None) -> None:
    """One file, nothing to fetch: the verdict, the measures, the plot (inline PNG) and the per-step losses."""
    e = html.escape
    rows = "\n".join(f"<tr><td>{e(m)}</td><td class=n>{e(x)}</td><td class=n>{e(y)}</td><td class=n>{e(r)}</td></tr>"
                     for m, x, y, r in res.measures())
    per_step = "\n".join(
        f"<tr><td class=n>{s}</td><td class=n>{res.a.loss[s]:.6g}</td><td class=n>{res.b.loss[s]:.6g}</td>"
        f"<td class=n>{res.rel_loss[s]:.3e}</td></tr>" for s in res.steps)
    img = (f'<img alt="loss curves, relative error and grad norms" '
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
