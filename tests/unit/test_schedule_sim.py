"""Pipeline schedule simulation: action orders, dependencies and bubble fractions."""
from __future__ import annotations

import pytest

from placer.diagnostics import PlanError
from placer.estimate.schedule import simulate, simulate_plan, stage_layout, textbook_bubble
from placer.model.graph import LayerInfo, ModelGraph
from placer.plan.ir import PlacedSegment, Plan
from placer.plan.schedules import action_orders

SINGLE = [(2, 1), (2, 4), (3, 2), (4, 4), (4, 8), (4, 1), (8, 16), (5, 7)]


def loop(p, v):
    return [s % p for s in range(p * v)]


def vee(p):
    return list(range(p)) + list(reversed(range(p)))


def check_timeline(tl, n_stages):
    """Every action once, lanes gap-free over [0, makespan], no overlap, inputs computed before use."""
    end = {}
    for lane in tl.slots:
        assert lane[0].start == 0 and lane[-1].end == pytest.approx(tl.makespan)
        for a, b in zip(lane, lane[1:]):
            assert b.start == pytest.approx(a.end)
        for s in lane:
            assert s.end >= s.start
            if s.kind != "idle":
                key = (s.kind, s.stage, s.microbatch)
                assert key not in end
                end[key] = s
    m = tl.microbatches
    for st in range(n_stages):
        for i in range(m):
            f = end[("F", st, i)]
            if st:
                assert f.start >= end[("F", st - 1, i)].end - 1e-9
            back = end.get(("B", st, i)) or end[("I", st, i)]
            assert back.start >= f.end - 1e-9
            if st < n_stages - 1:
                nxt = end.get(("B", st + 1, i)) or end[("I", st + 1, i)]
                assert back.start >= nxt.end - 1e-9
            if back.kind == "I":
                assert end[("W", st, i)].start >= back.end - 1e-9
    assert len(end) == sum(3 if k[0] == "I" else 2 for k in end if k[0] in "BI")  # nothing extra


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", SINGLE)
def test_single_stage_schedules_match_textbook(schedule, p, m):
    if schedule == "1f1b" and m < p:
        pytest.skip("torch's 1F1B needs at least as many micro-batches as stages")
    for bwd in (1.0, 2.0, 3.5):  # the formula holds for any B/F ratio when all stages are equal
        tl = simulate(schedule, list(range(p)), m, fwd=1.0, bwd=bwd)
        assert tl.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert tl.textbook == pytest.approx(textbook_bubble(p, m))
        assert tl.makespan == pytest.approx((m + p - 1) * (1.0 + bwd))
        check_timeline(tl, p)


def test_1f1b_order_is_warmup_then_alternate_then_cooldown():
    orders = action_orders("1f1b", 4, 4, 6)
    assert [str(a) for a in orders[0]] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4", "0B1", "0F5", "0B2",
                                           "0B3", "0B4", "0B5"]
    assert [str(a) for a in orders[3]][:4] == ["3F0", "3B0", "3F1", "3B1"]
    assert [str(a) for a in action_orders("gpipe", 2, 2, 2)[1]] == ["1F0", "1F1", "1B0", "1B1"]


def test_1f1b_holds_fewer_microbatches_in_flight_than_gpipe():
    """Same bubble, but 1F1B's first stage keeps at most p activations alive; GPipe keeps m."""
    def peak_in_flight(tl):
        live = peak = 0
        for s in sorted(tl.slots[0], key=lambda s: s.start):
            live += {"F": 1, "B": -1}.get(s.kind, 0)
            peak = max(peak, live)
        return peak
    assert peak_in_flight(simulate("gpipe", [0, 1, 2, 3], 8)) == 8
    assert peak_in_flight(simulate("1f1b", [0, 1, 2, 3], 8)) == 4


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 2, 4), (4, 3, 8), (2, 2, 2), (3, 2, 6)])
def test_interleaved_bubble_shrinks_with_stages_per_device(p, v, m):
    tl = simulate("interleaved_1f1b", loop(p, v), m)
    check_timeline(tl, p * v)
    assert tl.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert tl.textbook == pytest.approx(textbook_bubble(p, m, v))
    assert tl.bubble < simulate("1f1b", list(range(p)), m).bubble


@pytest.mark.parametrize("schedule", ["looped_bfs", "interleaved_zero_bubble"])
@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (3, 3, 6)])
def test_other_looped_schedules_respect_dependencies(schedule, p, v, m):
    tl = simulate(schedule, loop(p, v), m)
    check_timeline(tl, p * v)
    assert tl.bubble < simulate("1f1b", list(range(p)), m).bubble


@pytest.mark.parametrize("schedule", ["zbv_zero_bubble", "dualpipev"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6)])
def test_v_schedules_from_torch_respect_dependencies(schedule, p, m):
    tl = simulate(schedule, vee(p), m)
    check_timeline(tl, 2 * p)
    assert tl.bubble < simulate("interleaved_1f1b", loop(p, 2), m).bubble


def test_zero_bubble_split_backward_into_input_and_weight():
    tl = simulate("interleaved_zero_bubble", loop(2, 2), 4, fwd=1.0, bwd=2.0, wgt=0.5)
    kinds = {s.kind: s.end - s.start for lane in tl.slots for s in lane if s.kind != "idle"}
    assert kinds == {"F": 1.0, "I": 1.5, "W": 0.5}


def test_uneven_stages_make_a_larger_bubble():
    even = simulate("1f1b", [0, 1, 2, 3], 8)
    slow = simulate("1f1b", [0, 1, 2, 3], 8, fwd=[1, 1, 3, 1])
    assert slow.bubble > even.bubble + 0.1
    check_timeline(slow, 4)
    # the slowest stage sets the pace: it is busy m * (f + b) and never waits in the steady state
    assert sum(s.end - s.start for s in slow.slots[2] if s.kind != "idle") == pytest.approx(8 * 9)


def test_transfer_time_delays_crossings():
    base = simulate("gpipe", [0, 1], 2)
    slow = simulate("gpipe", [0, 1], 2, transfer=0.5)
    assert slow.makespan == pytest.approx(base.makespan + 2 * 0.5)
    assert slow.slots[1][1].start == pytest.approx(1.5)  # stage 1's F0 waits for the copy


def test_per_device_timelines_share_their_group():
    tl = simulate("1f1b", [0, 1], 2, groups=[("cuda:0", "cuda:1"), ("cuda:2",)])
    per = tl.per_device
    assert list(per) == ["cuda:0", "cuda:1", "cuda:2"] and per["cuda:0"] is per["cuda:1"]
    assert [(s.start, s.end, s.kind, s.stage, s.microbatch) for s in per["cuda:2"]] == [
        (0, 1, "idle", None, None), (1, 2, "F", 1, 0), (2, 4, "B", 1, 0), (4, 5, "F", 1, 1), (5, 7, "B", 1, 1),
        (7, 9, "idle", None, None)]


@pytest.mark.parametrize("schedule,groups", [("1f1b", [0, 1, 0, 1]), ("interleaved_1f1b", [0, 1]),
                                             ("interleaved_1f1b", [0, 0, 1, 1]), ("zbv_zero_bubble", [0, 1, 0, 1]),
                                             ("nope", [0, 1])])
def test_layouts_a_schedule_cannot_run_are_plan_errors(schedule, groups):
    with pytest.raises(PlanError) as e:
        simulate(schedule, groups, 4)
    assert e.value.diagnostics[0].code == "R010"


def test_wrong_number_of_stage_times():
    with pytest.raises(PlanError, match="3 forward times for 2 stages"):
        simulate("gpipe", [0, 1], 2, fwd=[1, 2, 3])


def _pipeline_plan(schedule="1f1b", modes=("none", "data", "none")):
    devs = [("cpu",), ("cuda:0", "cuda:1"), ("cuda:2",)]
    segs = tuple(PlacedSegment(index=i, name=f"s{i}", layers=(f"l{i}",), devices=d, mode=mode, stage=i)
                 for i, (d, mode) in enumerate(zip(devs, modes)))
    return Plan(name="p", devices=("cpu", "cuda:0", "cuda:1", "cuda:2"), segments=segs, microbatches=4,
                schedule=schedule, batch_size=16)


def test_simulate_plan_takes_stage_times_from_flops():
    graph = ModelGraph(layers=tuple(LayerInfo(name=f"l{i}", op="Linear", params=1, param_bytes=4, buffer_bytes=0,
                                              in_shape=None, out_shape=None, flops=f)
                                    for i, f in enumerate([400, 800, 400])),
                       batch_size=16, input_shape=(16, 4), input_dtype="float32")
    plan = _pipeline_plan()
    assert stage_layout(plan) == ([0, 1, 2], [("cpu",), ("cuda:0", "cuda:1"), ("cuda:2",)])
    tl = simulate_plan(plan, graph)
    # the data stage splits its 800 FLOPs over 2 devices: every stage does 100 per micro-batch
    assert tl.unit == "flop" and tl.makespan == pytest.approx((4 + 2) * 300)
    assert tl.bubble == pytest.approx(textbook_bubble(3, 4))
    assert simulate_plan(plan).unit == "unit"
    assert simulate_plan(plan, fwd=[1, 2, 1], bwd=[2, 4, 2]).unit == "s"
    assert simulate_plan(Plan(name="x", devices=("cpu",), segments=())) is None
