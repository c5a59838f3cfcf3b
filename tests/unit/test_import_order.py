"""placer's stages import downwards only (issue 30 item 4): a walk of every import in the package,
function-level ones included, fails on an import from a later stage into an earlier one that is
not among the known ones below, and on any of those that has gone (so the list only shrinks).

The stage order (docs/architecture.md): the shared base (diagnostics, units, deps, device) <
spec < model < plan < modes < estimate, render, codegen < search, launch < cli, api < the
package's own __init__ and __main__. Stages of one rank may import each other, and modules of
one stage too: cycles there (codegen's train, loops and train_options) are not checked yet."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "placer"
RANK = {"diagnostics": 0, "units": 0, "deps": 0, "device": 0, "schemas": 0, "spec": 1, "model": 2, "plan": 3,
        "modes": 4, "estimate": 5, "render": 5, "codegen": 5, "search": 6, "launch": 6, "cli": 7, "api": 7,
        "__init__": 8, "__main__": 8}

# (importing module, imported module): the backward imports that remain to be taken out
KNOWN_BACKWARD = {
    ("placer.model.build", "placer.codegen.runtime.cut"),  # the deep checks' cut: belongs after codegen
    ("placer.model.build", "placer.codegen.runtime.seed"),
    ("placer.model.build", "placer.modes"),
    ("placer.model.build", "placer.modes.tensor"),
    ("placer.model.build", "placer.plan"),
    ("placer.model.build", "placer.plan.ir"),
    ("placer.plan.crossings", "placer.modes"),  # plan and modes import each other
    ("placer.plan.layout", "placer.modes"),
    ("placer.plan.lower", "placer.modes"),
    ("placer.plan.place", "placer.modes"),
    ("placer.spec.check", "placer.modes"),  # each mode's own checks of a segment
    ("placer.spec.check", "placer.plan.schedules"),
}


def stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def imports(path: Path) -> set[str]:
    """The placer modules a file imports, at any depth in it (`from placer import units` is
    placer.units; a relative import is resolved against the file's package)."""
    here = module_of(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            found |= {f"placer.{a.name}" if base == "placer" and is_module(a.name) else base for a in node.names}
    # (`from placer import __version__` reads the package's own attribute: every placer.x import
    # runs placer/__init__ first anyway, so an edge to the bare package says nothing)
    return {m for m in found if m.startswith("placer.")}


def backward_imports() -> set[tuple[str, str]]:
    edges = set()
    for path in PACKAGE.rglob("*.py"):
        if "templates" in path.parts:  # the generated program's text, not placer's code
            continue
        mine = module_of(path)
        for other in imports(path):
            if RANK[stage(other)] > RANK[stage(mine)]:
                edges.add((mine, other))
    return edges


def test_every_stage_is_ranked():
    stages = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
              if (p.suffix == ".py" or (p.is_dir() and p.name != "__pycache__"))}
    assert stages <= set(RANK), f"rank these in test_import_order.RANK and docs/architecture.md: {stages - set(RANK)}"


def test_no_new_import_runs_backwards():
    new = backward_imports() - KNOWN_BACKWARD
    assert not new, "imports from a later stage into an earlier one: " + ", ".join(f"{a} -> {b}" for a, b in sorted(new))


def test_the_known_backward_imports_are_still_there():
    gone = KNOWN_BACKWARD - backward_imports()
    assert not gone, "taken out (good): drop them from KNOWN_BACKWARD: " + ", ".join(f"{a} -> {b}" for a, b in sorted(gone))
