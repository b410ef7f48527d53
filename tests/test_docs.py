"""Executable docs: the workflow pages run as written on a tiny model pair, and what they show is what prints.

``docs/megatron-to-mindformers.md`` runs in order, every command exactly as written, in a folder holding the
repository's ``examples`` (as a clone's root does): the grouped-query-attention pair (megatron-core ``GPTModel``
against MindFormers' ``TrainingQwen3ForCausalLM``, statistics-only second step) must end *agree*, exit 0, and the
same run with fc1 loaded unconverted *diverged* at ``linear_fc1``'s weight with the layout hint, as the page shows.
Then the output blocks of ``docs/mapping.md`` that show commands on those files. Blocks are found and classified by
``tests/docblocks.py``; ``tests/core/test_doc_blocks.py`` checks that every block is marked.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import docblocks
from docblocks import ROOT


def _env() -> dict[str, str]:
    return dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="80",
                PYTHONDONTWRITEBYTECODE="1")


def run_page(page: str, cwd: str, only: tuple[str, ...] = ("run", "output")) -> list[str]:
    """Run a page's run and output blocks in order in ``cwd``; what went wrong, one line each (empty: all held)."""
    problems, last = [], None
    env = _env()
    for block in docblocks.blocks(page):
        if block.kind not in only or "needs=" in block.note:
            continue
        want = int(m.group(1)) if (m := re.search(r"exit=(\d+)", block.note)) else 0
        if block.kind == "run":
            ran_all = docblocks.run_block(block, cwd, env)
            for i, ran in enumerate(ran_all):
                expected_code = want if i == len(ran_all) - 1 else 0
                if ran.code != expected_code:
                    problems.append(f"{block.where}: `{ran.command}` exited {ran.code}, the page says "
                                    f"{expected_code}:\n{ran.output[-3000:]}")
                    return problems
                last = ran
            continue
        cmds, lines = docblocks.shown(block)
        for i, cmd in enumerate(cmds):
            ran = docblocks.run(cmd, cwd, env)
            expected_code = want if i == len(cmds) - 1 else 0
            if ran.code != expected_code:
                problems.append(f"{block.where}: `{cmd}` exited {ran.code}, the page says {expected_code}:\n"
                                f"{ran.output[-3000:]}")
                return problems
            last = ran
        if last is None:
            problems.append(f"{block.where}: an output block with no command before it")
            continue
        gone = docblocks.missing(lines, last.output)
        if gone:
            problems.append(f"{block.where}: `{last.command}` did not print, in this order: {gone}\n--- it printed:\n"
                            f"{last.output[-4000:]}")
    return problems


def test_every_name_the_pages_call_through_tensordiff_works_after_import_tensordiff():
    names = set()
    for page in ("README.md", *[os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))]):
        if page.endswith(".md"):
            with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
                names |= set(re.findall(r"\btensordiff\.([a-z_]+)\.([a-z_]+)\(", fh.read()))
    assert ("batch", "load") in names
    code = ("import sys, tensordiff\n"
            f"for pkg, fn in {sorted(names)!r}:\n"
            "    assert callable(getattr(getattr(tensordiff, pkg), fn)), (pkg, fn)\n"
            "print(sorted(m for m in ('torch', 'mindspore') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"  # calling through tensordiff. imported no framework the names did not need


needs_frameworks = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("megatron", "mindspore", "mindformers", "safetensors")),
    reason="needs megatron-core, MindSpore, MindFormers and safetensors")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    os.symlink(os.path.join(ROOT, "examples"), folder / "examples")
    return str(folder)


@pytest.fixture(scope="module")
def workflow(workdir):
    """docs/megatron-to-mindformers.md run as written in ``workdir``, once: (the folder, what went wrong). The pages
    after it run on its batch, checkpoint and captures."""
    return workdir, run_page("docs/megatron-to-mindformers.md", workdir)


WORKFLOW_FILES = ("batch.h5", "megatron.h5", "init.safetensors", "init.ckpt", "mindspore.h5", "mindspore-fc1.h5")


@needs_frameworks
def test_the_megatron_to_mindformers_workflow_runs_as_written_agrees_and_finds_the_fault(workflow):
    workdir, problems = workflow
    assert problems == [], "\n".join(problems)
    for name in WORKFLOW_FILES:
        assert os.path.exists(os.path.join(workdir, name)), name


needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """``make demo``'s pair, made with its commands: two megatron-core GPT runs, the second with the tanh GELU."""
    folder = tmp_path_factory.mktemp("demo")
    os.symlink(os.path.join(ROOT, "examples"), folder / "examples")
    for cmd in ("tensordiff capture -o a.h5 --steps 2 -- python examples/gpt/train.py",
                "tensordiff capture -o b.h5 --steps 2 -- python examples/gpt/train.py --fault gelu-tanh"):
        ran = docblocks.run(cmd, str(folder), _env())
        assert ran.code == 0, ran.output[-3000:]
    return str(folder)


@needs_megatron
@pytest.mark.parametrize("page", ["README.md", "docs/guide.md"])
def test_the_pages_on_make_demos_pair_run_as_written_and_print_what_they_show(demo, page):
    assert sum(b.kind in ("run", "output") for b in docblocks.blocks(page)) >= {"README.md": 1}.get(page, 5)
    problems = run_page(page, demo)
    assert problems == [], "\n".join(problems)


@needs_megatron
def test_the_megatron_lm_pages_cpu_commands_run_as_written_and_agree_across_tp(tmp_path):
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    problems = run_page("docs/megatron-lm.md", str(tmp_path))
    assert problems == [], "\n".join(problems)
    assert (tmp_path / "tp2.rank1.h5").exists()


@needs_frameworks
def test_the_recipe_builds_both_models_converts_the_weights_and_loads_them_strictly(tmp_path):
    problems = run_page("docs/mindformers-recipe.md", str(tmp_path))
    assert problems == [], "\n".join(problems)
    assert (tmp_path / "mcore.safetensors").exists() and (tmp_path / "mf.safetensors").exists()


@needs_frameworks
def test_the_checkpoint_page_converts_and_checks_the_workflows_weights_saved_as_megatron_lm_does(workflow):
    workdir, problems = workflow
    assert os.path.exists(os.path.join(workdir, "init.safetensors")), "the workflow page made no checkpoint: " + \
        "\n".join(problems)
    proc = subprocess.run([sys.executable, "-c", "import torch; from safetensors.torch import load_file; "
                           "torch.save({'model': load_file('init.safetensors'), 'iteration': 0}, 'mcore.pt')"],
                          cwd=workdir, env=_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    problems = run_page("docs/checkpoints.md", workdir)
    assert problems == [], "\n".join(problems)
    assert os.path.exists(os.path.join(workdir, "mcore-back.pt"))


@needs_frameworks
def test_the_mapping_pages_commands_print_what_it_shows_on_the_workflows_captures(workflow):
    workdir, problems = workflow
    assert os.path.exists(os.path.join(workdir, "mindspore.h5")), "the workflow page made no capture: " + \
        "\n".join(problems)
    problems = run_page("docs/mapping.md", workdir, only=("output",))
    assert problems == [], "\n".join(problems)


_LOAD_CHECK = """
import sys, torch
from examples.megatron_vs_mindformers.megatron_side import build_mcore, state_for_saving
from examples.megatron_vs_mindformers.spec import FAMILIES

snippet = open(sys.argv[1], encoding="utf-8").read()
source, model = build_mcore(FAMILIES["qwen3"], 1), build_mcore(FAMILIES["qwen3"], 2)
torch.save({"model": state_for_saving(source), "iteration": 10}, "mcore.pt")   # as Megatron-LM saves it
exec(snippet, {"model": model})
same = [torch.equal(a, b) for a, b in zip(source.state_dict().values(), model.state_dict().values()) if torch.is_tensor(a)]
print("loaded", sum(same), "of", len(same))
torch.save({"model": {"decoder.no_such.weight": torch.zeros(1)}}, "mcore.pt")  # a file of another model
try:
    exec(snippet, {"model": model})
except AssertionError as err:
    print("refused:", err)
"""


@needs_frameworks
def test_the_checkpoint_pages_load_snippet_loads_a_megatron_lm_file_or_says_what_it_did_not(tmp_path):
    block = next(b for b in docblocks.blocks("docs/checkpoints.md") if "needs=model" in b.note)
    (tmp_path / "snippet.py").write_text(block.text)
    proc = subprocess.run([sys.executable, "-c", _LOAD_CHECK, "snippet.py"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    loaded = re.search(r"loaded (\d+) of (\d+)", proc.stdout)
    assert loaded and loaded.group(1) == loaded.group(2) and int(loaded.group(1)) > 10, proc.stdout
    assert "refused: not in the model: ['decoder.no_such.weight']" in proc.stdout
