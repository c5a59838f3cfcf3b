"""2-D stages in a pipeline under `placer run --check`: a tensor x data stage (also with ZeRO-1 or
FSDP2 over its replicas) and a spatial x data stage beside one-device stages, under placer's GPipe loops and its loops in 1F1B's and interleaved
zero bubble's order, train exactly as one device does
(rtol 1e-5, atol 4e-5), and every device sends what the plan says: each micro-batch's rows leave
through each replica's first rank (a spatial replica's bands gathered there first), and its
gradient comes back to it, which passes it on to the rest of its replica."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from placer.cli.main import main

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

pytestmark = pytest.mark.distributed

ROOT, STEPS = h.ROOT, 3


GPIPE = "# GPipe: every micro-batch forward, then every one backward"
ORDER = "order = {"  # placer's loops in the schedule's order


@pytest.mark.parametrize("spec,sets,call,loops", [
    ("specs/mlp_pipeline_tensor_data.yaml", [], "all_reduce_slices(seg0, dp0)", GPIPE),
    ("tests/cases/valid/pipeline_gpipe_spatial_data/spec.yaml", ["pipeline.schedule=1f1b"],
     "all_reduce_grads(seg0.parameters(), dp0", ORDER),
    # two 2-D stages a rank, the last one's loss on each replica's rows, B split into I and W
    ("tests/cases/valid/pipeline_zero_bubble_tensor_data/spec.yaml", [], "all_reduce_slices(seg3, dp3)", ORDER),
    # ZeRO-1 over the replicas (ZeroSlices: Adam's state 1/2 a device), stepped once after 1F1B's micro-batches
    ("specs/mlp_pipeline_tensor_data.yaml", ["pipeline.schedule=1f1b", "placement.0.parallel.shard=optimizer",
                                             "training.optimizer={op: Adam, lr: 0.01}"],
     "opt0 = ZeroSlices(seg0.parameters(), dp0, torch.optim.Adam", ORDER),
    # FSDP2 x TP: each unit gathered and its gradients reduce-scattered around each micro-batch's use
    # (GPipe's loops; no gather of the previous micro-batch's last unit, as the plan counts)
    ("tests/cases/valid/tensor_fsdp_in_pipeline/spec.yaml", [], "no_prefetch_across_micro_batches(seg0)", GPIPE),
], ids=["tensor_data_gpipe", "spatial_data_1f1b", "tensor_data_zero_bubble", "tensor_data_zero1_1f1b",
        "tensor_fsdp_gpipe"])
def test_a_2d_stage_in_a_pipeline_matches_one_device_and_sends_what_the_plan_says(spec, sets, call, loops, tmp_path):
    sets = [a for s in sets for a in ("--set", s)]
    program, _, metrics, _ = h.checked_run(ROOT / spec, tmp_path / "run", "--steps", str(STEPS), *sets, min_params=1)
    assert metrics["world_size"] == 5 and len(metrics["losses"]) == STEPS
    assert call in program and loops in program
    planned = CliRunner().invoke(main, ["plan", str(ROOT / spec), "--format", "json", *sets])
    assert planned.exit_code == 0, planned.output
    for d in json.loads(planned.stdout)["devices"]:
        assert metrics["bytes_sent"][d["device"]] == d["payload_bytes"] * STEPS, d
