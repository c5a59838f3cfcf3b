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


def closest(name: str, candidates) -> str | None:
    """The candidate `name` most likely meant: same name in another case, else the closest spelling."""
    cands = [str(c) for c in candidates]
    folded = {c.lower(): c for c in cands}
    if str(name).lower() in folded:
        return folded[str(name).lower()]
    close = difflib.get_close_matches(str(name).lower(), list(folded), n=1, cutoff=0.6)
    return folded[close[0]] if close else None


def did_you_mean(name: str, candidates) -> str | None:
    """`"did you mean 'x'?"` for the closest candidate, or None."""
    best = closest(name, candidates)
    return f"did you mean {best!r}?" if best is not None else None


def name_hint(kind: str, name: str, candidates, limit: int = 8) -> str:
    """Hint naming the closest valid name; lists the valid names when they are few."""
    cands = list(candidates)
    dym = did_you_mean(name, cands)
    if len(cands) > limit:  # a long alphabetical list says nothing: lead with the guess
        shown = ", ".join(str(c) for c in cands[:limit])
        return dym or f"{kind} are {shown}, ... ({len(cands)} in all)"
    return f"{kind} are {', '.join(str(c) for c in cands)}" + (f" ({dym})" if dym else "")


def format_report(diagnostics: list[Diagnostic], fmt: str = "text", max_shown: int | None = None) -> str:
    """Render diagnostics as text (best first, then a count), json or github."""
    if fmt == "json":
        return json.dumps([d.as_dict() for d in diagnostics], indent=2)
    if fmt == "github":
        return "\n".join(d.format_github() for d in diagnostics)
    shown = diagnostics if max_shown is None else diagnostics[:max_shown]
    lines = [d.format() for d in shown]
    rest = diagnostics[len(shown):]
    counts = [(sum(d.severity == sev for d in rest), sev) for sev in ("error", "warning")]
    more = [f"{n} more {sev}{'s' if n != 1 else ''}" for n, sev in counts if n]
    if more:
        lines.append(", ".join(more))
    return "\n".join(lines)
