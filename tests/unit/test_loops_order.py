"""Placer's own 1F1B loops (placer/codegen/loops.py) run what the plan and its schedule chart say:
each rank's `order` in the program is its device's compute ops in the plan, which the chart's
timeline draws; and 1F1B's order is not GPipe's (the loops interleave backwards)."""
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


@pytest.mark.parametrize("which", ["uneven", "gpt2"])
def test_each_rank_runs_its_plan_and_chart_order(which, tmp_path):
    path = ROOT / "examples" / "uneven_1f1b" / "spec.yaml" if which == "uneven" else gpt2_1f1b(tmp_path)
    spec = load_spec(str(path))
    order = program_order(generate(spec).text)
    _, plan, _, timeline = build_and_plan(spec)
    devices = rank_order(spec.devices)
    kind = {"fwd": "F", "bwd": "B"}
    for d in plan.devices:
        planned = [f"{kind[o.phase]}{o.microbatch}" for o in plan.ops[d] if o.kind == OpKind.COMPUTE]
        assert order[devices.index(d)] == planned, d
    first = devices.index(plan.segments[0].devices[0])
    assert order[first] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]  # 1F1B, not all forwards first
    drawn = [f"{s.kind}{s.microbatch}" for s in sorted(timeline.slots[0], key=lambda s: s.start)
             if s.kind in ("F", "B")]
    assert drawn == order[first]
