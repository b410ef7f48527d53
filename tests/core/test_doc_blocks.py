"""Every fenced block of the workflow pages says what a test does with it: run, checked output, or why it is only
illustrative (``tests/docblocks.py``). A block added without a marker fails here."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import docblocks


@pytest.mark.parametrize("page", docblocks.PAGES)
def test_every_block_is_run_checked_or_says_why_not(page):
    found = docblocks.blocks(page)
    assert found, page
    unmarked = [b.where for b in found if not b.kind]
    assert unmarked == [], f"add <!-- doc-test: run|output|skip REASON --> before the block at {unmarked}"
    assert all(b.note for b in found if b.kind == "skip"), "a skipped block says why"


def test_the_workflow_page_runs_its_commands_and_checks_what_it_shows():
    kinds = [b.kind for b in docblocks.blocks("docs/megatron-to-mindformers.md")]
    assert kinds[:3] == ["run", "output", "output"]


def test_shown_output_matches_in_order_across_wrapping_and_frames():
    printed = "╭─ First ─╮\n│ Step 0, weights: a.b weight differs │\n│ from B's  │\n1. 100.0% layout: x\n"
    assert docblocks.missing(["Step 0, weights: a.b weight differs from B's", "1. 100.0% layout: x"], printed) == []
    assert docblocks.missing(["1. 100.0% layout", "Step 0"], printed) == ["Step 0"]          # out of order
    assert docblocks.missing(["│ from B's ... anything"], printed) == []                     # '...' ends the line
    assert docblocks.commands("# c\na \\\n  b\n\nc  # x\n") == ["a    b", "c  # x"]
