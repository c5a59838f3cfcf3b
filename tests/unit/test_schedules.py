"""The schedule table (placer.plan.schedules) is the one list of schedules: the schema's enum,
the program's runtime piece and torch agree with it, and every order comes from torch's
generators complete and in micro-batch order."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

import placer
from placer.diagnostics import PlanError
from placer.plan.schedules import SCHEDULES, action_orders

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


def test_runtime_piece_maps_the_table_to_torch():
    from placer.codegen.runtime import pipeline as rt
    from torch.distributed.pipelining import schedules as ts

    assert {k: c.__name__ for k, c in rt.PIPELINE_SCHEDULES.items()} == \
        {k: s.torch_class for k, s in SCHEDULES.items()}
    assert all(getattr(ts, s.torch_class) is rt.PIPELINE_SCHEDULES[k] for k, s in SCHEDULES.items())
    assert set(rt.ONE_STAGE_PER_RANK) == {k for k, s in SCHEDULES.items() if s.layout == "single"}
    assert set(rt.V_SHAPED) == {k for k, s in SCHEDULES.items() if s.layout == "v"}
    for k, s in SCHEDULES.items():
        for p, n, _ in _shapes(s):
            assert [rt.pipeline_stage_owner(k, i, p) for i in range(n)] == s.stage_groups(p, n)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_order_runs_each_action_once_on_its_group(name):
    s = SCHEDULES[name]
    for p, n, m in _shapes(s):
        orders = action_orders(name, p, n, m)
        groups = s.stage_groups(p, n)
        seen = Counter((a.stage, a.microbatch, a.kind) for o in orders for a in o)
        assert set(seen.values()) == {1} and {(st, i) for st, i, _ in seen} == \
            {(st, i) for st in range(n) for i in range(m)}, (name, p, n, m)
        for st in range(n):  # a forward, and a full backward or an input and a weight backward
            for i in range(m):
                assert {k for t, j, k in seen if (t, j) == (st, i)} in ({"F", "B"}, {"F", "I", "W"}), (name, st, i)
        assert all(groups[a.stage] == g for g, o in enumerate(orders) for a in o)
        if s.layout == "single":  # torch's single-stage loops take micro-batches in order
            for o in orders:
                for k in ("F", "B"):
                    assert [a.microbatch for a in o if a.kind == k] == list(range(m))


def test_1f1b_last_rank_alternates_from_microbatch_0():
    """torch 2.13's 1F1B picture numbers the last rank's forwards from 1; its loop runs 0 first."""
    assert [str(a) for a in action_orders("1f1b", 3, 3, 4)[2]] == \
        ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"]


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
