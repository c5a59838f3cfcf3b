"""Channel, tensor and spatial stages beside stages of other modes or sizes, under every schedule,
as placer's own micro-batch loops (placer/codegen/loops.py) in the schedule's order:

- 1F1B: one device, a tensor pair, one device; a data pair, a tensor pair, one device (5 ranks);
  a spatial last stage whose bands meet for the loss, under precision bf16;
- interleaved 1F1B: one device, then a pair holding a channel stage and the tensor last stage;
- looped BFS: spatial pairs and one device, alternating;
- ZBV zero bubble: a V whose turn is two channel stages on one pair.

A split stage's ranks run its order together (the group's collectives match); its boundary copies
are GPipe's (`relayout`), their send halves posted and waited on at the end of the step. Each run
matches the one-device reference under `run --check` (rtol 1e-5, atol 4e-5; bf16 at its stated
tolerance), runs the plan's order, and every device sends per step what its plan says."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "cases" / "valid"
RUNS = {  # name: (spec, --set overrides, the order rank 1 runs, what its program calls)
    "1f1b-tensor-middle": (CASES / "pipeline_1f1b_tensor_middle/spec.yaml", (),
                           "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3", ["relayout(h, Replicate([1, 2]), Replicate([3])"]),
    "1f1b-data-tensor-one": (ROOT / "specs/mlp_pipeline_gpipe_mixed.yaml", ("pipeline.schedule=1f1b",),
                             "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
                             ["relayout(h, Shard(0, [0, 1]), Replicate([2, 3])", "tensor_parallelize("]),
    "1f1b-spatial-last-bf16": (CASES / "pipeline_1f1b_spatial_last_bf16/spec.yaml", (),
                               "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3",
                               ["out = relayout(h, Shard(2, [1, 2]), Replicate([1])", "SpatialSplit("]),
    "interleaved-channel-tensor": (CASES / "pipeline_interleaved_channel_tensor/spec.yaml", (),
                                   "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
                                   ["ChannelSplit(", "tensor_parallelize("]),
    "looped-bfs-spatial": (CASES / "pipeline_looped_spatial/spec.yaml", (),
                           "0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0 0B3 0B2 0B1 0B0",
                           ["relayout(h, Shard(2, [0, 1]), Replicate([2])"]),
    "zbv-channel-turn": (CASES / "pipeline_zbv_channel_turn/spec.yaml", (),
                         "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 "
                         "1W2 2W3 1W3", ["turn[mb] = a.grad", "ChannelSplit("]),
}


@pytest.mark.parametrize("name", RUNS)
def test_split_stages_beside_others_match_one_device_under_every_schedule(name, tmp_path):
    spec, sets, order, calls = RUNS[name]
    bf16 = "bf16" in name  # (run --check states and applies its looser tolerance)
    program, _, metrics, output = h.checked_run(spec, tmp_path / "run", *(a for s in sets for a in ("--set", s)),
                                        rtol=2e-2 if bf16 else 1e-5, atol=2e-3 if bf16 else 4e-5, min_params=6)
    assert "W005" not in output
    flat = re.sub(r",([\])])", r"\1", "".join(program.split()))  # the formatter's line breaks undone
    assert "make_pipeline_schedule" not in program and "for action in order:" in program
    assert "for mb in range" not in program  # not GPipe's loops
    got = re.search(r"order = \{[^}]*?\b1: \"([^\"]*)\"", program)
    assert got and got.group(1) == order, got
    for call in calls:
        assert "".join(call.split()) in flat, call
    h.assert_sends_what_the_plan_says(name, spec, metrics, sets)
