"""Every examples/*/ walk-through: its spec validates, and the outputs committed beside it (plan.txt,
placement.dot, placement.svg, schedule.svg) are what `placer plan` produces now.

When one of these fails after an intended change, run scripts/render_examples.sh and review the diff.
The SVG is checked against the committed dot source through its text (labels), not its bytes, so a
different graphviz version does not fail the test; the dot source itself is compared exactly.
"""
from __future__ import annotations

import html
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.main import main
from placer.cli.plan_cmd import build_and_plan, table
from placer.render.dot import placement_dot
from placer.render.schedule_chart import schedule_svg
from placer.spec.check import load_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.parent for p in (ROOT / "examples").glob("*/spec.yaml"))
IDS = [p.name for p in EXAMPLES]
RERUN = "stale; run scripts/render_examples.sh and review the diff"


@lru_cache(maxsize=None)
def planned(folder: Path):
    """(dot source, plan table, schedule SVG or None) as `placer plan` makes them now."""
    graph, plan, est, timeline = build_and_plan(load_spec(str(folder / "spec.yaml")))
    chart = schedule_svg(timeline) if timeline is not None else None
    return placement_dot(plan, graph, est), table(plan, graph, est, timeline) + "\n", chart


def test_there_are_examples():
    assert len(EXAMPLES) >= 4, EXAMPLES
    assert any((f / "schedule.svg").exists() for f in EXAMPLES), "no pipeline example"


def test_every_example_validates_on_the_command_line():
    specs = [str(f / "spec.yaml") for f in EXAMPLES]
    result = CliRunner().invoke(main, ["validate", *specs])
    assert result.exit_code == 0, result.output
    assert result.output.count(": ok") == len(specs), result.output


@pytest.mark.parametrize("folder", EXAMPLES, ids=IDS)
def test_committed_placement_dot_and_plan_table_are_current(folder):
    src, text, _ = planned(folder)
    assert (folder / "placement.dot").read_text() == src, f"{folder.name}/placement.dot is {RERUN}"
    assert (folder / "plan.txt").read_text() == text, f"{folder.name}/plan.txt is {RERUN}"


@pytest.mark.parametrize("folder", EXAMPLES, ids=IDS)
def test_committed_schedule_chart_is_current(folder):
    _, _, chart = planned(folder)
    path = folder / "schedule.svg"
    if chart is None:
        assert not path.exists(), f"{folder.name} has no pipeline but a schedule.svg; {RERUN}"
    else:
        assert path.exists() and path.read_text() == chart, f"{folder.name}/schedule.svg is {RERUN}"


def _dot_label_lines(src: str) -> Counter:
    """Every line of every label in DOT source (graphviz draws one SVG <text> per line)."""
    lines = Counter()
    for label in re.findall(r'label="((?:[^"\\]|\\.)*)"', src):
        for line in label.split("\\n"):
            line = line.replace('\\"', '"').replace("\\\\", "\\")
            if line.strip():
                lines[line.strip()] += 1
    for cells in re.findall(r"label=<(<TABLE.*?</TABLE>)>", src):  # HTML-like labels: one <text> per run
        for text in re.findall(r">([^<]+)<", cells):
            if html.unescape(text).strip():
                lines[html.unescape(text).strip()] += 1
    return lines


def _svg_texts(svg: str) -> Counter:
    return Counter(html.unescape(t).strip() for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg))


@pytest.mark.parametrize("folder", EXAMPLES, ids=IDS)
def test_committed_placement_svg_shows_the_committed_dot(folder):
    svg = (folder / "placement.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg, f"{folder.name}/placement.svg is no SVG"
    expected = _dot_label_lines((folder / "placement.dot").read_text())
    assert len(expected) > 5
    assert _svg_texts(svg) == expected, f"{folder.name}/placement.svg is {RERUN}"


def test_label_comparison_notices_a_changed_label():
    """The SVG check is not vacuous: a label the dot source changed makes it differ."""
    folder = EXAMPLES[0]
    svg = (folder / "placement.svg").read_text()
    src = (folder / "placement.dot").read_text()
    first_node = re.search(r'label="([^"\\]+)', src.split("input [", 1)[1]).group(1)
    assert _svg_texts(svg) != _dot_label_lines(src.replace(f'label="{first_node}', 'label="renamed', 1))


def test_readme_plan_excerpt_is_current():
    """The trimmed `placer plan` table in README.md's "What a plan looks like" is the example's plan.txt,
    with rows left out (`...`) but none changed."""
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"```\n\$ placer plan examples/(\w+)/spec\.yaml[^\n]*\n(.*?)```", readme, re.S)
    assert m, "README.md shows no `placer plan examples/...` table"
    committed = (ROOT / "examples" / m.group(1) / "plan.txt").read_text().splitlines()
    shown = [line for line in m.group(2).splitlines() if line.strip() not in ("", "...")]
    assert len(shown) > 5
    missing = [line for line in shown if line not in committed]
    assert not missing, f"README.md's plan table differs from examples/{m.group(1)}/plan.txt: {missing}"
