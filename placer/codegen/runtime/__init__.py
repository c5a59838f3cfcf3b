"""Hand-written communication pieces that generated programs contain.

Each ``<piece>.py`` in this folder is pasted, as text, into a generated program. The rules
that make that work (checked by tests/distributed/test_runtime_source.py):

- a piece imports only the standard library and torch, one import per line at the top;
- a piece may use another piece's names through ``from .<other> import name``: that line
  says "paste <other> first" and is dropped when pasting;
- top-level names are unique across pieces, so any set of pieces can share one file.

``source(["transfer", "ddp_sum"])`` returns the text to paste: the pieces' imports, then
the pieces (dependencies first). The files also import normally, as
``placer.codegen.runtime.<piece>``.
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).parent
PIECES = sorted(p.stem for p in HERE.glob("*.py") if p.stem != "__init__")

_REL = re.compile(r"^from \.(\w+) import ")
_IMPORT = re.compile(r"^(import |from [\w.]+ import )")


def piece_text(name: str) -> str:
    """The source text of one piece, as stored."""
    if name not in PIECES:
        raise KeyError(f"no runtime piece {name!r}; pieces are {', '.join(PIECES)}")
    return (HERE / f"{name}.py").read_text()


def dependencies(name: str) -> list[str]:
    """The pieces that `name` imports from (its `from .<other> import` lines)."""
    return [m.group(1) for line in piece_text(name).splitlines() if (m := _REL.match(line))]


def resolve(names) -> list[str]:
    """names plus everything they depend on, each once, every dependency before its user."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise ValueError(f"runtime pieces import each other: {' -> '.join(path + (name,))}")
        if name in order:
            return
        for dep in dependencies(name):
            visit(dep, path + (name,))
        order.append(name)

    for name in names:
        visit(name, ())
    return order


def assemble(names) -> tuple[list[str], str]:
    """(import lines, body) for the pieces `names` and their dependencies. The body is each
    piece verbatim minus its import lines, pieces separated by two blank lines."""
    imports: list[str] = []
    bodies: list[str] = []
    for name in resolve(names):
        kept = []
        for line in piece_text(name).splitlines():
            if _REL.match(line):
                continue
            if _IMPORT.match(line):
                if line not in imports:
                    imports.append(line)
                continue
            kept.append(line)
        # collapse the blank lines the removed imports leave behind
        body = re.sub(r"\n{3,}", "\n\n\n", "\n".join(kept).strip("\n"))
        bodies.append(body)
    return imports, "\n\n\n".join(bodies) + "\n"


def source(names) -> str:
    """Paste-ready text: the imports, a blank line pair, then the pieces."""
    imports, body = assemble(names)
    return "\n".join(imports) + "\n\n\n" + body
