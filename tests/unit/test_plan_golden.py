"""Golden files: the plan text, JSON and placement graph of every spec in specs/.

Refresh after an intended change with `PLACER_ACCEPT=1 python -m pytest tests/unit/test_plan_golden.py`
and review the diff of tests/golden/plan/.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")

from placer.cli.plan_cmd import build_and_plan, to_json  # noqa: E402
from placer.plan.text import format_plan, parse_plan  # noqa: E402
from placer.render.dot import placement_dot  # noqa: E402
from placer.spec.check import load_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "plan"
SPECS = sorted((REPO / "specs").glob("*.yaml"))
ACCEPT = os.environ.get("PLACER_ACCEPT") == "1"


def check_golden(path: Path, actual: str) -> None:
    if ACCEPT:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual)
        return
    assert path.exists(), f"no golden file {path.relative_to(REPO)}: run with PLACER_ACCEPT=1 and review it"
    expected = path.read_text()
    assert actual == expected, f"{path.relative_to(REPO)} differs: run with PLACER_ACCEPT=1 if intended"


@pytest.mark.parametrize("spec_path", SPECS, ids=[p.stem for p in SPECS])
def test_plan_matches_golden(spec_path):
    spec = load_spec(str(spec_path))
    graph, plan, est, timeline = build_and_plan(spec)
    text = format_plan(plan)
    assert parse_plan(text) == plan
    check_golden(GOLDEN / f"{spec_path.stem}.txt", text)
    check_golden(GOLDEN / f"{spec_path.stem}.json", json.dumps(to_json(plan, graph, est, timeline), indent=2) + "\n")
    check_golden(GOLDEN / f"{spec_path.stem}.dot", placement_dot(plan, graph, est))


def test_no_stale_golden_files():
    stems = {p.stem for p in SPECS}
    stale = sorted(p.name for p in GOLDEN.glob("*") if p.stem not in stems)
    assert not stale, f"golden files for specs that no longer exist: {stale}"
