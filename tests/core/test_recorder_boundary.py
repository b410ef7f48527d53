"""The recorder's boundary (``tensordiff/capturing/recorder.py``), enforced by reading the capture modules.

A controller (an adapter's hooks, ``--auto``, ``--megatron``, the MindFormers callback) uses a recorder's public
methods and reads its ``state``; it never reaches into the recorder's own underscore attributes. A subclass (an
adapter) overrides only the hooks named in ``Recorder.HOOKS`` and uses, of the recorder's own underscore attributes,
only those named in ``Recorder.FOR_ADAPTERS``. ``StepState`` is changed by the recorder alone.
"""

from __future__ import annotations

import ast
import os

CAPTURING = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tensordiff",
                         "capturing")
RECORDER = os.path.join(CAPTURING, "recorder.py")


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as fh:
        return ast.parse(fh.read())


def _recorder_class() -> ast.ClassDef:
    return next(n for n in _parse(RECORDER).body if isinstance(n, ast.ClassDef) and n.name == "Recorder")


def _declared(name: str) -> tuple[str, ...]:
    for node in _recorder_class().body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"Recorder.{name} is not declared")


HOOKS = _declared("HOOKS")
FOR_ADAPTERS = _declared("FOR_ADAPTERS")


def _members() -> tuple[set[str], set[str]]:
    """The recorder's own underscore attributes and methods, and its public methods and attributes."""
    own, public = set(), set()
    for node in ast.walk(_recorder_class()):
        name = None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = node.name
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            name = node.attr
        if name is None or name.startswith("__"):
            continue
        (own if name.startswith("_") else public).add(name)
    return own, public


OWN, PUBLIC = _members()


def _modules() -> dict[str, ast.Module]:
    out = {}
    for folder, _, files in os.walk(CAPTURING):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != RECORDER:
                out[os.path.relpath(path, CAPTURING)] = _parse(path)
    return out


MODULES = _modules()


def _recorder_classes() -> dict[str, tuple[str, ast.ClassDef]]:
    """The subclasses of ``Recorder`` in the capture modules (found by their bases' names): name -> (module, class)."""
    classes = {node.name: (module, node) for module, tree in MODULES.items() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef)}
    bases = {name: [ast.unparse(b).rpartition(".")[2] for b in node.bases] for name, (_, node) in classes.items()}

    def is_recorder(name: str, seen: int = 0) -> bool:
        return seen < 10 and any(b == "Recorder" or (b in bases and is_recorder(b, seen + 1)) for b in bases[name])

    return {name: classes[name] for name in classes if is_recorder(name)}


SUBCLASSES = _recorder_classes()


def test_the_recorder_classes_are_found():
    assert {"TorchCapture", "TrainingCapture", "MindSporeCapture", "MindSporeGraphCapture"} <= set(SUBCLASSES)
    assert set(HOOKS) <= PUBLIC and set(FOR_ADAPTERS) <= OWN


def test_no_module_reaches_into_a_recorder():
    bad = []
    for module, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in OWN | {"_state"} \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                bad.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "a recorder's own attributes used from outside it (use its public methods, state):\n" + \
        "\n".join(bad)


def test_subclasses_use_only_what_is_for_adapters_and_override_only_hooks():
    bad = []
    for name, (module, cls) in SUBCLASSES.items():
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__") \
                    and node.name in OWN | PUBLIC and node.name not in HOOKS:
                bad.append(f"{module}:{node.lineno} {name}.{node.name} overrides the recorder's own "
                           f"(override only {', '.join(HOOKS)})")
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and node.attr in OWN | {"_state"} and node.attr not in FOR_ADAPTERS:
                bad.append(f"{module}:{node.lineno} {name} uses self.{node.attr} (not in Recorder.FOR_ADAPTERS)")
    assert not bad, "\n".join(bad)


def test_only_the_recorder_changes_its_state():
    bad = []
    for module, tree in MODULES.items():
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute) \
                        and target.value.attr == "state":
                    bad.append(f"{module}:{node.lineno} {ast.unparse(target)}")
    assert not bad, "StepState changed outside the recorder:\n" + "\n".join(bad)
