"""Diagnostics: what every stage raises, and how the CLI prints it.

Every problem a user can cause becomes a `Diagnostic` with a stable code,
a location in the spec, a message (values, then context) and a hint (what
to change). Stages raise `SpecError` / `PlanError` carrying one or more
diagnostics; only the CLI formats them.
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Loc:
    """A position in a spec file (1-based line and column)."""

    file: str = "<spec>"
    line: int = 0
    col: int = 0

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}" if self.line else self.file


@dataclass(frozen=True)
class Diagnostic:
    code: str
    """Stable code, e.g. `P012`; listed in docs/errors.md."""
    message: str
    loc: Loc = field(default_factory=Loc)
    hint: str | None = None
    severity: str = "error"

    def format(self) -> str:
        text = f"{self.loc}: {self.severity}[{self.code}]: {self.message}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text

    def as_dict(self) -> dict:
        return {
            "file": self.loc.file,
            "line": self.loc.line,
            "col": self.loc.col,
            "severity": self.severity,
            "code": self.code,
            "message": self.message,
            "hint": self.hint,
        }

    def format_github(self) -> str:
        # GitHub workflow command: ::error file=F,line=L,col=C,title=T::message
        def esc(s: str) -> str:
            return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")

        body = self.message + (f" (hint: {self.hint})" if self.hint else "")
        return (
            f"::{self.severity} file={esc(self.loc.file)},line={self.loc.line},"
            f"col={self.loc.col},title=placer {self.code}::{esc(body)}"
        )


class PlacerError(Exception):
    """Base of errors a user can cause; carries diagnostics, best first."""

    def __init__(self, diagnostics: "Diagnostic | list[Diagnostic]"):
        if isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics = list(diagnostics)
        super().__init__(self.diagnostics[0].format() if self.diagnostics else "")


class SpecError(PlacerError):
    """The spec is invalid (load, schema or semantic checks)."""


class PlanError(PlacerError):
    """A plan could not be built or broke an invariant."""


class RunError(PlacerError):
    """A generated program failed or did not match its reference."""


def did_you_mean(name: str, candidates, n: int = 1) -> str | None:
    """`"did you mean 'x'?"` for the closest candidate, or None."""
    close = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=n, cutoff=0.6)
    if not close:
        return None
    return "did you mean " + " or ".join(repr(c) for c in close) + "?"


def name_hint(kind: str, name: str, candidates, limit: int = 8) -> str:
    """Hint listing valid names (a few) and the closest one."""
    cands = list(candidates)
    shown = ", ".join(str(c) for c in cands[:limit]) + (", ..." if len(cands) > limit else "")
    dym = did_you_mean(name, cands)
    return f"{kind} are {shown}" + (f" ({dym})" if dym else "")


def format_report(diagnostics: list[Diagnostic], fmt: str = "text", max_shown: int | None = None) -> str:
    """Render diagnostics as text (best first, then a count), json or github."""
    if fmt == "json":
        return json.dumps([d.as_dict() for d in diagnostics], indent=2)
    if fmt == "github":
        return "\n".join(d.format_github() for d in diagnostics)
    shown = diagnostics if max_shown is None else diagnostics[:max_shown]
    lines = [d.format() for d in shown]
    rest = len(diagnostics) - len(shown)
    if rest > 0:
        lines.append(f"{rest} more error{'s' if rest != 1 else ''}")
    return "\n".join(lines)
