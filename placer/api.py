"""The Python API: `placer.load`, `placer.plan`, `placer.generate`, `placer.suggest`, for scripts and notebooks.

The same stages as the CLI, returning values and raising `SpecError` / `PlanError` (with the
same diagnostics the CLI prints). torch is imported on first use, not by `import placer`.
"""
from __future__ import annotations

import json
import os

from placer.diagnostics import PlanError


def load(path: str, overrides=()):
    """The validated Spec of a spec file (`overrides`: `KEY=VALUE` strings, as `--set` takes).
    Raises SpecError listing every error."""
    from placer.spec.check import load_spec

    return load_spec(os.fspath(path), overrides)


def _spec(spec_or_path, overrides=()):
    from placer.spec.types import Spec

    return spec_or_path if isinstance(spec_or_path, Spec) else load(spec_or_path, overrides)


class PlanReport:
    """A planned spec: `.table()` (what `placer plan` prints), `.to_json()` (docs/plan-json.md),
    `.dot()` / `.svg()` (the placement graph); in Jupyter it displays as that graph."""

    def __init__(self, spec, graph, plan, estimate, timeline):
        self.spec, self.graph, self.plan, self.estimate, self.timeline = spec, graph, plan, estimate, timeline

    def table(self) -> str:
        from placer.cli.plan_cmd import table

        return table(self.plan, self.graph, self.estimate, self.timeline)

    def as_dict(self) -> dict:
        from placer.cli.plan_cmd import to_json

        return to_json(self.plan, self.graph, self.estimate, self.timeline)

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def dot(self) -> str:
        from placer.render.dot import placement_dot

        return placement_dot(self.plan, self.graph, self.estimate)

    def svg(self) -> str:
        """The placement graph as SVG text; PlanError (R004) when graphviz's `dot` is missing or fails."""
        from placer.render.dot import render

        return render(self.dot(), "svg").decode()

    def _repr_svg_(self):
        try:
            return self.svg()
        except PlanError:
            return None  # Jupyter then shows __repr__

    def __repr__(self) -> str:
        return self.table().splitlines()[0]


def _resolved(spec):
    """`placement: auto` resolved by the search (on this machine's cpu profile)."""
    from placer.search import resolve

    return resolve(spec)[0]


def suggest(spec_or_path, hardware: str = "cpu", overrides=()):
    """Search for the placement of a Spec (or a spec file) whose placement is `auto` or missing
    (a written one is searched for anew): the fastest predicted plan that fits every stated
    memory. Returns a `placer.search.Suggestion`: `.text` (the spec to write, with its comment
    header), `.spec` (it, loaded), `.best` and `.kept` (candidates, fastest first). Raises
    PlanError A001 when no placement fits. A module model is built: this RUNS THE MODEL CODE."""
    import dataclasses

    from placer.deps import require_torch

    require_torch("placer.suggest()")
    from placer.search import suggest as search

    spec = _spec(spec_or_path, overrides)
    if not spec.auto:
        spec = dataclasses.replace(spec, placement=(), pipeline=None, auto=True)
    return search(spec, hardware)


def plan(spec_or_path, overrides=()) -> PlanReport:
    """Plan a Spec (or a spec file): memory, communication and FLOPs per device. For a
    `model.module` spec this builds the model on the meta device, so it RUNS THE MODEL CODE."""
    from placer.deps import require_torch

    require_torch("placer.plan()")
    from placer.cli.plan_cmd import build_and_plan

    spec = _resolved(_spec(spec_or_path, overrides))
    graph, lowered, estimate, timeline = build_and_plan(spec)
    return PlanReport(spec, graph, lowered, estimate, timeline)


def generate(spec_or_path, output=None, overrides=()) -> str:
    """The standalone torch program of a Spec (or a spec file), as source text; also written to
    `output` when given."""
    from placer.deps import require_torch

    require_torch("placer.generate()")
    from placer.codegen.program import generate as generate_program

    spec = _resolved(_spec(spec_or_path, overrides))
    where = os.path.dirname(os.path.abspath(output)) if output else None  # it finds the spec's files from there
    text = generate_program(spec, filename=os.path.basename(output) if output else "program.py", out_dir=where).text
    if output:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
    return text
