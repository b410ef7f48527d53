"""Stage 5, report: every result renders itself through one theme (the only rich imports outside ``cli``).

* ``theme``: named styles (``tensordiff.*``), number formats, ``make_console``;
* ``diff``: ``DiffReport`` (tables per step and phase, the first divergence, the hints; the JSON report);
* ``ckpt``: ``CkptDiffReport``, ``ConvertSummary``;
* ``runs``: ``RunsReport``; ``runs_plot``: the PNG plot and the self-contained HTML page (matplotlib);
* ``capture``: ``CaptureListing`` (``ls``), ``RecordTable`` (``show``), ``ReplaySummary``, ``NoiseSummary``;
* ``config``: ``tensordiff config``'s tables (what differs in effect, what was compared);
* ``locate``: ``tensordiff locate``'s plan and, after ``--run``, the resumed iterations and the first divergence.

The library never prints: the CLI hands these to a console.
"""
