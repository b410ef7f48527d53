"""What is in a capture (``tensordiff ls``, ``show``), and the one-screen summaries of ``replay`` and ``noise``."""

from __future__ import annotations

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from .._text import plural, times_shape
from ..diff.noise import summary
from ..diff.nonfinite import describe, first_nonfinite
from ..explain.replay import ReplayResult
from ..record import PHASES, Record
from ..store import CaptureReader
from .theme import Name, table_width, wide

#: File attributes ``ls`` lists, in this order.
LS_ATTRS = ("framework", "framework_version", "megatron_core_version", "transformers_version", "model_class",
            "rank", "world_size", "created", "argv")


class CaptureListing:
    """The steps of a capture: records per phase, stored tensors, loss; its per-step scalars (``tensordiff ls``)."""

    def __init__(self, cap: CaptureReader):
        self.cap = cap

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        cap = self.cap
        yield Text(f"{cap.path}: {cap.nbytes() / 1e6:.2f} MB, format {cap.attrs.get('tensordiff_format')}")
        for key in LS_ATTRS:
            if key in cap.attrs:
                yield Text(f"  {key}: {cap.attrs[key]}")
        table = Table(title="steps", title_justify="left")
        table.add_column("step", justify="right")
        for phase in PHASES:
            table.add_column(phase, justify="right")
        table.add_column("tensors", justify="right")
        table.add_column("loss", justify="right")
        for step in cap.steps:
            recs = cap.records(step)
            counts = [str(sum(1 for r in recs if r.phase == p)) for p in PHASES]
            loss = cap.step_attrs(step).get("loss")
            table.add_row(str(step), *counts, str(sum(1 for r in recs if r.has_data and r.same_as < 0)),
                          f"{loss:.6g}" if isinstance(loss, float) else "-")
        yield table
        first = describe(first_nonfinite(cap))
        yield Text(f"  first NaN/Inf (execution order): {first}" if first else "  NaN/Inf: none in any step",
                   style="tensordiff.diverged" if first else "")
        if cap.incomplete_steps:
            yield Text(f"  incomplete steps (ignored): {cap.incomplete_steps}")
        for name, values in sorted(cap.scalars().items()):
            steps = sorted(values)
            yield Text(f"  scalar {name}: {len(steps)} steps ({steps[0]}..{steps[-1]}), last {values[steps[-1]]:.6g}")


class RecordTable:
    """Records of one step with their statistics (``tensordiff show``); min, max and NaN/Inf counts at 110+ columns."""

    def __init__(self, title: str, records: list[Record]):
        self.title = title
        self.records = records

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        wide_ = table_width(console, options) >= 110
        table = Table(title=self.title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        table.add_column("#", justify="right", style="tensordiff.dim", no_wrap=True)
        table.add_column("phase", no_wrap=True)
        table.add_column("module · tensor", overflow="fold", ratio=1)
        for col in ("dtype", "shape", "mean", "l2") + (("min", "max", "nan/inf") if wide_ else ()):
            table.add_column(col, justify="left" if col in ("dtype", "shape") else "right", no_wrap=True)
        for r in self.records:
            name = Text(r.label)
            if r.same_as >= 0:
                name.append(" (link)", style="tensordiff.dim")
            cells: list[Name | str] = [str(r.seq), r.phase, Name(name), r.dtype, times_shape(r.shape), f"{r.mean:.4g}",
                                       f"{r.l2:.4g}"]
            if wide_:
                cells += [f"{r.min:.4g}", f"{r.max:.4g}", f"{r.nan}/{r.inf}"]
            table.add_row(*cells)
        yield wide(table)


class ReplaySummary:
    """``tensordiff replay``: the four numbers and the verdict in one sentence."""

    def __init__(self, result: ReplayResult):
        self.result = result

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        res = self.result
        yield Text(f"replay of {res.module} ({res.module_class}), step {res.step}, call {res.call}, with A's code:")
        yield Text(f"  A's output vs B's output, as captured      {res.ab:10.3g}")
        yield Text(f"  on A's inputs, vs A's output (faithful?)   {res.replay_a:10.3g}")
        yield Text(f"  on B's inputs, vs B's output               {res.replay_b:10.3g}")
        yield Text(f"  on B's inputs, vs A's output               {res.replay_b_vs_a:10.3g}")
        for note in res.notes:
            yield Text(f"  note: {note}")
        yield Text(res.sentence())


class NoiseSummary:
    """``tensordiff noise``: what was written, and the noise per phase."""

    def __init__(self, path: str, noise: dict[tuple, float], how: str):
        self.path, self.noise, self.how = path, noise, how

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text(f"tensordiff: wrote {self.path}: noise of {plural(len(self.noise), 'tensor', 'tensors')} ({self.how})")
        for phase, (median, worst, count) in summary(self.noise).items():
            yield Text(f"  {phase:<10} {count:4d} {'tensor ' if count == 1 else 'tensors'}  median rel L2 {median:.1e}  "
                       f"max {worst:.1e}")
