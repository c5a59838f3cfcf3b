"""Placer's own loops in a schedule's order (placer/codegen/loops.py) run what the plan and its
schedule chart say: each rank's `order` in the program is its device's compute ops in the plan,
which the chart's timeline draws; 1F1B's order is not GPipe's (the loops interleave backwards)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from placer.cli.plan_cmd import build_and_plan
from placer.codegen.program import generate
from placer.codegen.segments import rank_order
from placer.plan.ir import OpKind
from placer.spec.check import load_spec

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "models"


def gpt2_1f1b(tmp_path: Path) -> Path:
    """HF GPT-2 over 3 ranks, tied ends, 1F1B in lockstep."""
    text = (MODELS / "hf_gpt2_layerwise.yaml").read_text().replace("hf_tiny.py", str(MODELS / "hf_tiny.py"))
    head, tail = text.split("devices:")
    path = tmp_path / "spec.yaml"
    path.write_text(head + """devices: [cpu, cpu:1, cpu:2]
placement:
  - {name: front, layers: [transformer.wte..transformer.h.0], device: cpu}
  - {name: middle, layers: transformer.h.1, device: cpu:1}
  - {name: back, layers: [transformer.ln_f, lm_head], device: cpu:2}
pipeline: {microbatches: 4, schedule: 1f1b}
training:""" + tail.split("training:")[1])
    return path


def program_order(text: str) -> dict[int, list[str]]:
    m = re.search(r"order = (\{.*?\})\.get\(rank", text, re.S)
    assert m, "the program has no `order`"
    return {r: s.split() for r, s in ast.literal_eval(m.group(1)).items()}


UNEVEN = ROOT / "examples" / "uneven_1f1b" / "spec.yaml"
KIND = {"fwd": "F", "bwd": "B", "bwd_input": "I", "bwd_weight": "W"}


def uneven(tmp_path: Path, schedule: str) -> Path:
    """Four stages on a one-device group and a data-parallel pair: round-robin, or in a V."""
    text = UNEVEN.read_text()
    head, tail = text.split("placement:")
    one, two = "device: cpu", "devices: [cpu:1, cpu:2], parallel: data"
    groups = [one, two, two, one] if schedule == "zbv_zero_bubble" else [one, two, one, two]
    path = tmp_path / "spec.yaml"
    path.write_text(head.replace(", cpu:3]", "]") + "placement:\n" + "".join(
        f"  - {{layers: {sel}, {g}}}\n" for sel, g in zip(("inp..block.0", "block.1", "block.2", "block.3..head"),
                                                         groups))
        + f"pipeline: {{microbatches: 4, schedule: {schedule}}}\ntraining:" + tail.split("training:")[1])
    return path


@pytest.mark.parametrize("which", ["uneven", "gpt2", "interleaved_1f1b", "zbv_zero_bubble"])
def test_each_rank_runs_its_plan_and_chart_order(which, tmp_path):
    path = {"uneven": UNEVEN, "gpt2": None}.get(which) or (
        gpt2_1f1b(tmp_path) if which == "gpt2" else uneven(tmp_path, which))
    spec = load_spec(str(path))
    order = program_order(generate(spec).text)
    _, plan, est, timeline = build_and_plan(spec)
    honest = [n for n in est.notes if "each I runs the whole backward" in n]  # the plan says what the loops do
    assert len(honest) == (which == "zbv_zero_bubble")
    devices = rank_order(spec.devices)
    for d in plan.devices:
        planned = [f"{o.segment}{KIND[o.phase]}{o.microbatch}" for o in plan.ops[d] if o.kind == OpKind.COMPUTE]
        assert order[devices.index(d)] == planned, d
    first = devices.index(plan.segments[0].devices[0])
    drawn = [f"{s.stage}{s.kind}{s.microbatch}" for s in sorted(timeline.slots[0], key=lambda s: s.start)
             if s.kind != "idle"]
    assert drawn == order[first]
    if which in ("uneven", "gpt2"):  # 1F1B, not all forwards first
        assert order[first] == ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"]
    else:  # the first group holds two stages, and the program runs both
        assert {a[0] for a in order[first]} == ({"0", "2"} if which == "interleaved_1f1b" else {"0", "3"})
