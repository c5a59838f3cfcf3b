"""Golden placement graphs of every spec in specs/ (PLACER_ACCEPT=1 rewrites them), and they render."""
from __future__ import annotations

import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

from placer.cli.plan_cmd import build_and_plan
from placer.render.dot import placement_dot
from placer.render.schedule_chart import schedule_text
from placer.spec.check import load_spec

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "dot"
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
ACCEPT = os.environ.get("PLACER_ACCEPT") == "1"


@lru_cache(maxsize=None)
def planned(path: Path):
    spec = load_spec(str(path))
    graph, plan, est, timeline = build_and_plan(spec)
    return plan, placement_dot(plan, graph, est), timeline


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_placement_dot_matches_golden(path):
    _, src, _ = planned(path)
    golden = GOLDEN / f"{path.stem}.dot"
    if ACCEPT:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(src)
    assert golden.exists(), f"no golden file {golden}; run with PLACER_ACCEPT=1 and review the diff"
    assert src == golden.read_text(), f"{golden} differs; if the change is intended, rerun with PLACER_ACCEPT=1"


def test_no_stale_goldens():
    stale = sorted(p.name for p in GOLDEN.glob("*.dot") if p.stem not in {s.stem for s in SPECS})
    assert not stale, f"golden files without a spec: {stale}"


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz not installed")
def test_every_spec_renders_without_graphviz_warnings():
    for path in SPECS:
        _, src, _ = planned(path)
        proc = subprocess.run(["dot", "-Tsvg", "-o", os.devnull], input=src, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0 and not proc.stderr, (path.name, proc.stderr)


def test_every_pipeline_spec_simulates():
    """Each pipeline spec's schedule runs to completion with at least the textbook bubble of its layout
    or, for zero-bubble schedules, with less idle time than 1F1B would have."""
    seen = set()
    for path in SPECS:
        plan, _, tl = planned(path)
        if not plan.schedule:
            assert tl is None
            continue
        seen.add(plan.schedule)
        assert 0 <= tl.bubble < 1 and tl.makespan > 0
        assert len(tl.per_device) == len({d for s in plan.segments for d in s.devices})
        assert schedule_text(tl).count("\n") == len(tl.groups) + 1  # a row per group, then the key
    assert {"gpipe", "1f1b", "interleaved_1f1b"} <= seen
