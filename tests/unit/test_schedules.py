"""The schedule table (placer.plan.schedules) is the one list of schedules: the schema's enum,
the program's runtime piece and torch agree with it, and every order comes from torch's
generators complete and in micro-batch order."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import placer
from placer.diagnostics import PlanError
from placer.plan.schedules import SCHEDULES, action_orders

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((Path(placer.__file__).parent / "schemas" / "placer-spec.schema.json").read_text("utf-8"))


def _shapes(s):
    """(p, n, m) this schedule accepts, a small grid."""
    for p in range(1, 5):
        for n in (p, 2 * p, 3 * p):
            for m in range(1, 11):
                if s.stage_groups(p, n) is not None and not s.microbatch_problem(m, n, p):
                    yield p, n, m


def test_schema_enum_is_the_table():
    enum = SCHEMA["$defs"]["pipeline"]["properties"]["schedule"]["enum"]
    assert enum == list(SCHEDULES)


def test_spec_docs_table_is_the_table():
    """docs/spec.md's schedule table: same names in order, layouts and micro-batch rules."""
    rows = re.findall(r"^\| `(\w+)`[^|]*\| ([^|]+) \|[^|]*\| ([^|]+) \|$", (REPO / "docs" / "spec.md").read_text("utf-8"),
                      re.MULTILINE)
    layout = {"1": "single", "the same number, at least 2": "loop", "exactly 2": "v"}
    rule = {"any": None, "at least the number of stages": "at_least_stages"}
    assert [(name, layout[per], rule.get(m, "multiple_of_rounds" if "multiple of the rounds" in m else m))
            for name, per, m in rows] == [(s.name, s.layout, s.microbatches) for s in SCHEDULES.values()]


def test_runtime_piece_maps_the_table_to_torch():
    from torch.distributed.pipelining import schedules as ts

    from placer.codegen.runtime import pipeline as rt

    assert {k: c.__name__ for k, c in rt.PIPELINE_SCHEDULES.items()} == \
        {k: s.torch_class for k, s in SCHEDULES.items()}
    assert all(getattr(ts, s.torch_class) is rt.PIPELINE_SCHEDULES[k] for k, s in SCHEDULES.items())
    assert set(rt.ONE_STAGE_PER_RANK) == {k for k, s in SCHEDULES.items() if s.layout == "single"}
    assert set(rt.V_SHAPED) == {k for k, s in SCHEDULES.items() if s.layout == "v"}
    for k, s in SCHEDULES.items():
        for p, n, _ in _shapes(s):
            assert [rt.pipeline_stage_owner(k, i, p) for i in range(n)] == s.stage_groups(p, n)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_order_is_complete_and_single_stage_ones_in_microbatch_order(name):
    s = SCHEDULES[name]
    for p, n, m in _shapes(s):
        orders = action_orders(name, p, n, m)  # R011 unless each action runs once, on its group
        if s.layout == "single":  # as torch's single-stage loops take them
            for o in orders:
                for k in ("F", "B"):
                    assert [a.microbatch for a in o if a.kind == k] == list(range(m))


def test_1f1b_last_rank_alternates_from_microbatch_0(monkeypatch):
    """torch 2.13's 1F1B picture numbers the last rank's forwards from 1; its loop runs 0 first."""
    assert [str(a) for a in action_orders("1f1b", 3, 3, 4)[2]] == \
        ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"]
    from placer.plan import schedules

    monkeypatch.setattr(schedules, "_in_microbatch_order", lambda order: order)
    with pytest.raises(PlanError, match="runs 2F4 on group 2") as e:  # the picture as torch draws it
        action_orders("1f1b", 3, 3, 4)
    assert e.value.diagnostics[0].code == "R011"


@pytest.mark.parametrize("name,p,n,m,what", [
    ("1f1b", 4, 4, 2, "microbatches (2) >= stages (4)"),
    ("dualpipev", 2, 4, 3, "microbatches (3) >= stages (4)"),
    ("interleaved_1f1b", 4, 8, 9, "multiple of the rounds (2"),
    ("interleaved_1f1b", 2, 2, 4, "cannot run 2 stages on 2 device groups"),
    ("zbv_zero_bubble", 2, 6, 4, "cannot run 6 stages"),
    ("nope", 2, 2, 2, "unknown pipeline schedule"),
])
def test_orders_torch_would_refuse_are_plan_errors(name, p, n, m, what):
    with pytest.raises(PlanError, match=r".*" + what.replace("(", r"\(").replace(")", r"\)")) as e:
        action_orders(name, p, n, m)
    assert e.value.diagnostics[0].code == "R010"
