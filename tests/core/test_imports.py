"""The dependency rule, enforced by reading every module's imports (module level and inside functions).

    cli → report → {explain → config → ckpt, runs → ckpt} → diff → store → core (errors, dtypes, record, transforms, ...)
    capturing → store, frameworks;  batch → frameworks;  compat → nothing of tensordiff

torch and MindSpore (and the frameworks built on them) are imported only in ``frameworks/``, the capture
adapters and ``compat/``; rich only in ``report/``, ``cli/`` and ``_progress`` (the one progress bar, drawn for
any stage's long work); and no two modules import each other,
directly or through others.
"""

from __future__ import annotations

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tensordiff")

#: Leaf modules every stage may use.
CORE = {"_version", "_native",
        "errors", "_text", "_yaml", "_regex", "_watchdog", "_warn", "_progress", "dtypes", "record", "transforms",
        "mapping", "stats"}
#: Stage -> the stages it may import (besides itself and the core).
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "store": set(),
    "frameworks": set(),
    "capturing": {"store", "frameworks"},
    "batch": {"frameworks"},
    "diff": {"store"},
    "explain": {"diff", "store", "frameworks", "config"},
    "ckpt": {"diff", "frameworks"},
    "runs": {"store", "ckpt", "diff"},
    "config": {"ckpt", "store"},
    "report": {"explain", "ckpt", "runs", "diff", "store", "config"},
    "cli": {"report", "explain", "ckpt", "runs", "diff", "store", "capturing", "batch", "config"},
    "root": {"capturing", "cli"},
    "compat": set(),
}
FRAMEWORKS = {"torch", "mindspore", "megatron", "mindformers", "transformers"}
#: Where a framework may be imported.
FRAMEWORK_HOMES = ("tensordiff.frameworks.", "tensordiff.capturing.torch.", "tensordiff.capturing.mindspore.",
                   "tensordiff.capturing.auto", "tensordiff.capturing.megatron", "tensordiff.compat.")
FRAMEWORK_HOMES += ("tensordiff.capturing.mindformers_callback",)  # the MindFormers Trainer's callback (MindSpore)
#: Other third-party packages and the only places that may import them.
CONFINED = {"rich": ("tensordiff.report.", "tensordiff.cli.", "tensordiff._progress"),
            "matplotlib": ("tensordiff.report.runs_plot",),
            "safetensors": ("tensordiff.ckpt.safetensors_io",), "regex": ("tensordiff._regex",)}


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    root = os.path.dirname(PACKAGE)
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES.get(module, "").endswith("__init__.py")


def _imports(module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in ``module``: tensordiff modules resolved, others top-level names."""
    with open(MODULES[module], encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    package = module if _is_package(module) else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            submodules = [n for n in names if n in MODULES]
            out += [(n, node.lineno) for n in submodules]
            if len(submodules) < len(names):
                out.append((target, node.lineno))
    return out


def _stage(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    head = parts[1]
    if head == "__main__":
        return "root"
    return "core" if head in CORE else head


def test_every_module_is_in_a_known_stage():
    unknown = sorted({_stage(m) for m in MODULES} - set(ALLOWED))
    assert not unknown, f"modules outside the known stages: {unknown}; add them to ALLOWED with their rule"


def test_each_stage_imports_only_the_stages_below_it():
    bad = []
    for module in MODULES:
        stage = _stage(module)
        for target, line in _imports(module):
            if not target.startswith("tensordiff"):
                continue
            other = _stage(target)
            if other == stage or (other == "core" and stage != "compat"):
                continue
            if other not in ALLOWED[stage]:
                bad.append(f"{module}:{line} ({stage}) imports {target} ({other})")
    assert not bad, "imports against the dependency direction:\n" + "\n".join(bad)


def test_frameworks_are_imported_only_in_frameworks_capture_adapters_and_compat():
    bad = []
    for module in MODULES:
        for target, line in _imports(module):
            top = target.split(".")[0]
            if top in FRAMEWORKS and not (module + ".").startswith(FRAMEWORK_HOMES) \
                    and not module.startswith(FRAMEWORK_HOMES):
                bad.append(f"{module}:{line} imports {target}")
            homes = CONFINED.get(top)
            if homes is not None and not module.startswith(homes):
                bad.append(f"{module}:{line} imports {target} (allowed only in {', '.join(homes)})")
    assert not bad, "\n".join(bad)


def test_compat_imports_nothing_of_tensordiff():
    bad = [f"{m}:{line} imports {t}" for m in MODULES if _stage(m) == "compat"
           for t, line in _imports(m) if t.startswith("tensordiff")]
    assert not bad, "\n".join(bad)


def test_no_module_imports_itself_through_others():
    graph = {m: sorted({t for t, _ in _imports(m) if t in MODULES and t != m}) for m in MODULES}
    # a package imports its own submodules to re-export them; a submodule importing its package back is a cycle
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(" → ".join(c) for c in cycles)


@pytest.mark.parametrize("module", ["tensordiff.diff", "tensordiff.store", "tensordiff.explain", "tensordiff.ckpt",
                                    "tensordiff.runs", "tensordiff.report.diff",
                                    "tensordiff.config"])
def test_the_framework_free_stages_load_without_torch_or_mindspore(module):
    import subprocess
    import sys

    code = ("import sys\n"
            "for name in ('torch', 'mindspore', 'megatron', 'mindformers', 'transformers'):\n"
            "    sys.modules[name] = None  # importing it now raises ImportError\n"
            f"import {module}\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.path.dirname(PACKAGE)))
    assert proc.returncode == 0, proc.stderr[-2000:]
