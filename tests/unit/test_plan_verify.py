"""verify: every broken invariant is caught, and the error shows the whole plan with the bad op marked."""
from __future__ import annotations

import pytest

from placer.diagnostics import PlanError
from placer.plan.ir import Plan
from placer.plan.text import parse_plan
from placer.plan.verify import verify

GROUPS = """\
plan groups batch=16 microbatches=1
devices [cpu,cuda:0,cuda:1]
segment 0 embed @cpu layers=[fc1,act1]
segment 1 middle [cuda:0,cuda:1] mode=data layers=[fc2,act2] sync=allreduce
segment 2 classifier @cpu layers=[head]

device cpu
  compute s0 fwd fc1..act1
  split s1 fwd act cpu->[cuda:0,cuda:1] bytes=4096 route=direct dst_dim=0
  merge s2 fwd act [cuda:0,cuda:1]->cpu bytes=2048 route=direct src_dim=0
  compute s2 fwd head
  compute s2 bwd head
  split s2 bwd grad cpu->[cuda:0,cuda:1] bytes=2048 route=direct dst_dim=0
  merge s1 bwd grad [cuda:0,cuda:1]->cpu bytes=4096 route=direct src_dim=0
  compute s0 bwd fc1..act1
  step s0 step params
  step s2 step params

device cuda:0
  split s1 fwd act cpu->[cuda:0,cuda:1] bytes=4096 route=direct dst_dim=0
  compute s1 fwd fc2..act2
  merge s2 fwd act [cuda:0,cuda:1]->cpu bytes=2048 route=direct src_dim=0
  split s2 bwd grad cpu->[cuda:0,cuda:1] bytes=2048 route=direct dst_dim=0
  compute s1 bwd fc2..act2
  all_reduce s1 bwd grads [cuda:0,cuda:1] bytes=16640 bucket=0 layers=fc2
  merge s1 bwd grad [cuda:0,cuda:1]->cpu bytes=4096 route=direct src_dim=0
  step s1 step params

device cuda:1
  split s1 fwd act cpu->[cuda:0,cuda:1] bytes=4096 route=direct dst_dim=0
  compute s1 fwd fc2
  compute s1 fwd act2
  merge s2 fwd act [cuda:0,cuda:1]->cpu bytes=2048 route=direct src_dim=0
  split s2 bwd grad cpu->[cuda:0,cuda:1] bytes=2048 route=direct dst_dim=0
  compute s1 bwd act2
  compute s1 bwd fc2
  all_reduce s1 bwd grads [cuda:0,cuda:1] bytes=16640 bucket=0 layers=fc2
  merge s1 bwd grad [cuda:0,cuda:1]->cpu bytes=4096 route=direct src_dim=0
  step s1 step params
"""

PIPE = """\
plan pipe batch=16 microbatches=2 schedule=1f1b
devices [cuda:0,cuda:1]
segment 0 s0 @cuda:0 stage=0 layers=[fc1,act]
segment 1 s1 @cuda:1 stage=1 layers=[fc2]

device cuda:0
  compute s0 fwd fc1..act mb=0
  send s1 fwd act cuda:0->cuda:1 mb=0 bytes=512 route=direct
  compute s0 fwd fc1..act mb=1
  send s1 fwd act cuda:0->cuda:1 mb=1 bytes=512 route=direct
  recv s1 bwd grad cuda:1->cuda:0 mb=0 bytes=512 route=direct
  compute s0 bwd fc1..act mb=0
  recv s1 bwd grad cuda:1->cuda:0 mb=1 bytes=512 route=direct
  compute s0 bwd fc1..act mb=1
  step s0 step params

device cuda:1
  recv s1 fwd act cuda:0->cuda:1 mb=0 bytes=512 route=direct
  compute s1 fwd fc2 mb=0
  recv s1 fwd act cuda:0->cuda:1 mb=1 bytes=512 route=direct
  compute s1 bwd fc2 mb=0
  send s1 bwd grad cuda:1->cuda:0 mb=0 bytes=512 route=direct
  compute s1 fwd fc2 mb=1
  compute s1 bwd fc2 mb=1
  send s1 bwd grad cuda:1->cuda:0 mb=1 bytes=512 route=direct
  step s1 step params
"""


def edit(text: str, old: str, new: str, count: int = 1) -> Plan:
    assert text.count(old) >= count, old
    return parse_plan(text.replace(old, new, count))


def failure(plan: Plan, **kw) -> tuple[str, str, list[str]]:
    with pytest.raises(PlanError) as e:
        verify(plan, **kw)
    d = e.value.diagnostics[0]
    return d.code, d.message, [line for line in d.message.splitlines() if line.startswith(">>")]


def test_good_plans_pass():
    for text in (GROUPS, PIPE):
        plan = parse_plan(text)
        assert verify(plan) is plan


def test_error_prints_the_whole_plan_with_the_bad_op_marked():
    plan = edit(GROUPS, "  compute s0 fwd fc1..act1\n", "  compute s0 fwd fc1..act1 @cuda:0\n")
    code, msg, marked = failure(plan)
    assert code == "V001"
    assert marked == [">> compute s0 fwd fc1..act1 @cuda:0"]
    assert "step s1 step params" in msg and "device cuda:1" in msg  # the whole plan, not just the op


def test_shared_op_missing_from_a_member():
    plan = edit(GROUPS, "  all_reduce s1 bwd grads [cuda:0,cuda:1] bytes=16640 bucket=0 layers=fc2\n", "")
    code, msg, marked = failure(plan)
    assert code == "V002" and "missing from the list of cuda:0" in msg
    assert marked[0].startswith(">> all_reduce")


def test_devices_reaching_shared_ops_in_different_orders():
    swapped = GROUPS.replace(
        "  all_reduce s1 bwd grads [cuda:0,cuda:1] bytes=16640 bucket=0 layers=fc2\n"
        "  merge s1 bwd grad [cuda:0,cuda:1]->cpu bytes=4096 route=direct src_dim=0\n  step s1 step params\n\n"
        "device cuda:1",
        "  merge s1 bwd grad [cuda:0,cuda:1]->cpu bytes=4096 route=direct src_dim=0\n"
        "  all_reduce s1 bwd grads [cuda:0,cuda:1] bytes=16640 bucket=0 layers=fc2\n  step s1 step params\n\n"
        "device cuda:1")
    code, msg, marked = failure(parse_plan(swapped))
    assert code == "V002" and "different orders (deadlock)" in msg
    assert len(marked) >= 2


def test_compute_outside_its_segment_group():
    plan = edit(GROUPS, "  step s0 step params\n", "  step s1 step params\n")
    code, msg, marked = failure(plan)
    assert code == "V003" and "cpu is not in segment 'middle'" in msg
    assert marked == [">> step s1 step params"]


def test_transfer_between_the_wrong_segments():
    plan = parse_plan(GROUPS.replace("split s1 fwd act cpu->", "split s1 fwd act cuda:0->"))
    code, msg, _ = failure(plan)
    assert code in ("V001", "V003")


@pytest.mark.parametrize("old, new, why", [
    ("  compute s1 fwd act2\n", "", "computes fwd of segment 'middle' over ['fc2'], not once over ['fc2', 'act2']"),
    ("  compute s1 bwd act2\n  compute s1 bwd fc2\n", "  compute s1 bwd fc2\n  compute s1 bwd act2\n",
     "computes bwd of segment 'middle' over ['act2', 'fc2']"),
    ("  compute s1 fwd fc2\n", "  compute s1 fwd fc2\n  compute s1 fwd fc2\n", "over ['fc2', 'fc2', 'act2']"),
    ("  compute s1 fwd fc2\n", "  compute s1 fwd fc9\n", "names layers 'fc9' not in its segment"),
])
def test_every_layer_computed_once_per_phase(old, new, why):
    code, msg, _ = failure(edit(GROUPS, old, new))
    assert code == "V004" and why in msg


def test_boundary_needs_exactly_one_transfer():
    dropped = GROUPS.replace("  merge s1 bwd grad [cuda:0,cuda:1]->cpu bytes=4096 route=direct src_dim=0\n", "")
    code, msg, _ = failure(parse_plan(dropped))
    assert code == "V006" and "bwd boundary 'embed' -> 'middle'" in msg
    verify(parse_plan(dropped), complete=False)  # between passes a missing transfer is allowed ...
    doubled = GROUPS.replace("  merge s2 fwd act [cuda:0,cuda:1]->cpu bytes=2048 route=direct src_dim=0\n",
                             "  merge s2 fwd act [cuda:0,cuda:1]->cpu bytes=2048 route=direct src_dim=0\n" * 2)
    code, msg, marked = failure(parse_plan(doubled), complete=False)  # ... a second one never
    assert code == "V006" and "more than one transfer" in msg and len(marked) == 2


def test_send_without_recv():
    plan = edit(PIPE, "  recv s1 fwd act cuda:0->cuda:1 mb=1 bytes=512 route=direct\n", "")
    code, msg, marked = failure(plan)
    assert code == "V005" and "micro-batch 1 cuda:0 -> cuda:1 (512 bytes) has no matching recv" in msg
    assert marked == [">> send s1 fwd act cuda:0->cuda:1 mb=1 bytes=512 route=direct"]


def test_recv_with_other_bytes_does_not_match():
    plan = edit(PIPE, "  recv s1 fwd act cuda:0->cuda:1 mb=1 bytes=512", "  recv s1 fwd act cuda:0->cuda:1 mb=1 bytes=256")
    assert failure(plan)[0] == "V005"


def test_receiving_in_another_order_than_sending():
    swapped = PIPE.replace(
        "  recv s1 fwd act cuda:0->cuda:1 mb=0 bytes=512 route=direct\n  compute s1 fwd fc2 mb=0\n"
        "  recv s1 fwd act cuda:0->cuda:1 mb=1 bytes=512 route=direct\n",
        "  recv s1 fwd act cuda:0->cuda:1 mb=1 bytes=512 route=direct\n"
        "  recv s1 fwd act cuda:0->cuda:1 mb=0 bytes=512 route=direct\n  compute s1 fwd fc2 mb=0\n")
    code, msg, marked = failure(parse_plan(swapped))
    assert code == "V005" and "another order" in msg and len(marked) == 2


def test_pipeline_boundary_without_sends():
    plan = parse_plan("\n".join(l for l in PIPE.splitlines() if " fwd act " not in l) + "\n")
    code, msg, _ = failure(plan)
    assert code == "V006" and "micro-batch 0 is never sent (fwd)" in msg


def test_pipeline_boundary_may_not_copy():
    plan = parse_plan(PIPE.replace("  send s1 fwd act cuda:0->cuda:1 mb=0 bytes=512 route=direct\n",
                                   "  copy s1 fwd act cuda:0->cuda:1 bytes=512 route=direct\n")
                      .replace("  recv s1 fwd act cuda:0->cuda:1 mb=0 bytes=512 route=direct\n",
                               "  copy s1 fwd act cuda:0->cuda:1 bytes=512 route=direct\n"))
    code, msg, _ = failure(plan)
    assert code == "V006" and "uses a copy, not sends" in msg
