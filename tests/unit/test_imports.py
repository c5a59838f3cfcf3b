"""Stages depend one way: no module reaches into another's private names, the plan IR
imports no other part of placer (its text form, passes and consumers import it), and the
plan imports none of its consumers (estimate, render, codegen, the CLI)."""
from __future__ import annotations

import ast
from pathlib import Path

import placer

PLACER = Path(placer.__file__).parent
# pasted into generated programs: they import nothing of placer
PASTED = ("codegen/runtime", "codegen/templates")


def _modules():
    for path in sorted(PLACER.rglob("*.py")):
        rel = path.relative_to(PLACER).as_posix()
        if not rel.startswith(PASTED):
            yield rel, ast.parse(path.read_text("utf-8"))


def _placer_imports(tree) -> list[tuple[str, list[str]]]:
    """(module, names) of every `import placer...` / `from placer... import ...`, lazy ones too."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("placer"):
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("placer")]
    return out


def test_no_private_names_across_modules():
    bad = []
    for rel, tree in _modules():
        imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and (n.module or "").startswith("placer") for a in n.names}
        bad += [f"{rel}: from {m} import {n}" for m, names in _placer_imports(tree) for n in names
                if n.startswith("_") and not n.startswith("__")]
        bad += [f"{rel}: {n.value.id}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id in imported and n.attr.startswith("_")
                and not n.attr.startswith("__")]
    assert not bad, bad


def test_plan_ir_imports_nothing_of_placer():
    tree = dict(_modules())["plan/ir.py"]
    assert _placer_imports(tree) == []


def test_plan_imports_none_of_its_consumers():
    downstream = ("placer.estimate", "placer.render", "placer.codegen", "placer.cli")
    bad = [f"{rel}: {m}" for rel, tree in _modules() if rel.startswith("plan/")
           for module, names in _placer_imports(tree)
           for m in [module] + [f"{module}.{n}" for n in names]  # `from placer import estimate` too
           if m.startswith(downstream)]
    assert not bad, bad
