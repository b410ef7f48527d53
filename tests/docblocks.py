"""The fenced blocks of the workflow pages, each marked with what a test does with it (executable docs).

A marker is an HTML comment on the line before the fence (invisible on the rendered page)::

    <!-- doc-test: run -->             the commands (bash) or the code (python) are run as written; each exits 0
    <!-- doc-test: output -->          what the page shows a command print: its ``$ command`` lines are run (or,
                                       without one, the previous run block's last command is the one shown) and each
                                       shown line must be in what it prints, in order ('...' lines skip ahead)
    <!-- doc-test: skip REASON -->     illustrative: not run, and the reason says why

Every block of the pages in ``PAGES`` carries one: a new block without a marker fails the test, so a page cannot
drift from the tool unnoticed.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ("README.md", "docs/megatron-to-mindformers.md", "docs/mindformers-recipe.md", "docs/checkpoints.md",
         "docs/guide.md", "docs/mapping.md", "docs/megatron-lm.md", "docs/launchers.md", "docs/config.md",
         "docs/msprobe.md")
_FENCE = re.compile(r"^\s*```\s*([\w-]*)\s*$")
_BOX = str.maketrans("", "", "│╭╮╰╯─")  # a panel's frame: where it wraps depends on the width, not the words
_MARK = re.compile(r"^\s*<!--\s*doc-test:\s*(run|output|skip)\b\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    """the fence's line number (1-based)."""
    lang: str
    text: str
    kind: str
    """'run', 'output', 'skip', or '' where the block has no marker."""
    note: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not _FENCE.match(lines[j]):
            j += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mark = _MARK.match(prev)
        out.append(Block(page, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                         mark.group(1) if mark else "", mark.group(2) if mark else ""))
        i = j + 1
    return out


def commands(text: str) -> list[str]:
    """The shell commands of a bash block: comments and blank lines dropped, continuation lines joined."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    return out


@dataclass(frozen=True)
class Ran:
    command: str
    code: int
    output: str


def run(command: str, cwd: str, env: dict[str, str], timeout: int = 900) -> Ran:
    """One command as a user types it (bash, in ``cwd``), its exit code and what it printed (stdout and stderr)."""
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return Ran(command, proc.returncode, proc.stdout + proc.stderr)


def run_block(block: Block, cwd: str, env: dict[str, str]) -> list[Ran]:
    if block.lang == "python":
        path = os.path.join(cwd, f"_block_{block.line}.py")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(block.text)
        return [run(f"python {path}", cwd, env)]
    return [run(c, cwd, env) for c in commands(block.text)]


def shown(block: Block) -> tuple[list[str], list[str]]:
    """(the ``$`` commands of an output block, the lines it shows)."""
    cmds, lines = [], []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            cmds.append(line[2:])
        elif line.strip():
            lines.append(line)
    return cmds, lines


def missing(lines: list[str], printed: str) -> list[str]:
    """The shown lines that are not in ``printed`` in order (whitespace runs count as one space; a line holding
    '...' or '…' matches up to it)."""
    text = " ".join(printed.translate(_BOX).split())
    pos, out = 0, []
    for line in lines:
        want = " ".join(line.translate(_BOX).split())
        for cut in ("...", "…"):
            if cut in want:
                want = want[:want.index(cut)].rstrip()
        if not want:
            continue
        at = text.find(want, pos)
        if at < 0:
            out.append(line)
        else:
            pos = at + len(want)
    return out
