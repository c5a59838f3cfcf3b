"""channel and spatial x data on a module model, in lockstep beside one-device segments
(tests/models/stem_split_data.yaml): every rank of a 2-D group takes the whole input, cuts its
replica's rows (runtime bands.py ReplicaRows), runs its replica's split, and the outputs are
gathered by bands in each replica, then by rows over the ranks at each place; the plan counts
those gathers, the program makes them, and a BatchNorm there is warned about (W006)."""
from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from placer import api
from placer.cli.main import main
from placer.plan.ir import OpKind

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "tests" / "models" / "stem_split_data.yaml"
REPLICAS = [("cpu", "cpu:1"), ("cpu:2", "cpu:3")]
PLACES = [("cpu", "cpu:2"), ("cpu:1", "cpu:3")]


def _gathers(plan, segment):
    return sorted((op.phase, op.devices, op.dim, op.bytes) for op in plan.unique_ops()
                  if op.segment == segment and op.kind == OpKind.ALL_GATHER)


def test_the_plan_gathers_bands_in_each_replica_then_rows_over_each_place():
    plan = api.plan(SPEC).plan
    out = 4 * 8 * 8 * 8 * 4  # maxpool's output, float32, the whole batch of 4
    # the stem: each replica gathers its half of the rows' bands (dim 2), then each place the two
    # halves (dim 0); conv1's input (the batch) takes no gradient, so nothing goes back
    assert _gathers(plan, 0) == sorted([("fwd", r, 2, out // 2) for r in REPLICAS] +
                                       [("fwd", p, 0, out) for p in PLACES])
    # the head: each replica gathers the channels of its rows, then each place the rows; backward,
    # the input gradient's rows are gathered over each place (each replica's summed over its ranks)
    assert _gathers(plan, 2) == sorted([("fwd", r, 1, 4 * 10 * 4 // 2) for r in REPLICAS] +
                                       [("fwd", p, 0, 4 * 10 * 4) for p in PLACES] +
                                       [("bwd", p, 0, 4 * 16 * 4) for p in PLACES])
    # the gradients: the stem's over each replica's bands, then over each place; the head's over each place
    sums = {(op.segment, op.devices) for op in plan.unique_ops() if op.kind == OpKind.ALL_REDUCE and op.tensor == "grads"}
    assert sums == {(0, g) for g in REPLICAS + PLACES} | {(2, p) for p in PLACES}
    # what enters a group crosses whole to each of its ranks: the body's output to the head's four
    copies = {op.dst for op in plan.unique_ops() if op.kind == OpKind.COPY and op.phase == "fwd" and op.segment == 2}
    assert copies == {("cpu",), ("cpu:1",), ("cpu:2",), ("cpu:3",)}


def test_the_program_runs_each_chain_on_its_replicas_rows_and_sums_over_the_replicas():
    program = api.generate(api.load(SPEC))
    flat = "".join(program.split())
    assert "ReplicaRows(SpatialWhole(seg0),dp0,next(pforpin[[0,2],[1,3]]ifrankinp))" in flat
    assert "ReplicaRows(seg2,dp2,next(pforpin[[0,2],[1,3]]ifrankinp))" in flat
    assert "SpatialSplit(stage,g0,next(rforrin[[0,1],[2,3]]ifrankinr)" in flat  # bands within the replica
    assert "all_reduce_grads(seg0.parameters(),dp0" in flat and "all_reduce_slices(seg2,dp2)" in flat
    assert "classReplicaRows(nn.Module)" in flat and "groups=GROUPS" in flat


def test_a_batchnorm_in_a_2d_group_of_a_module_model_is_warned_about(tmp_path):
    """Each replica normalises over its own rows, as on inline layers: W006 once the model is built."""
    r = CliRunner().invoke(main, ["validate", "--deep", str(SPEC), "--set", "model.kwargs.norm=true"])
    assert r.exit_code == 0 and "warning[W006]: layer 'bn1' is a BatchNorm in 2-D segment 'stem'" in r.output, r.output
    r = CliRunner().invoke(main, ["validate", "--deep", str(SPEC)])
    assert r.exit_code == 0 and "W006" not in r.output, r.output


def test_a_2d_chain_group_in_a_pipeline_is_refused(tmp_path):
    """Lockstep runs a 2-D chain group beside one-device segments without a pipeline only: plain
    validate warns (W007), the built model's check refuses it (P086)."""
    text = SPEC.read_text().replace("relu3, avgpool], device: cpu:4}", "relu3, avgpool, fc], device: cpu:4}")
    text = text.replace("  - {name: head, layers: fc, devices: [cpu, cpu:1, cpu:2, cpu:3], parallel: {mode: channel, "
                        "data: 2}}\n", "") + "pipeline: {microbatches: 2, schedule: gpipe}\n"
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    (tmp_path / "stem_net.py").write_text((SPEC.parent / "stem_net.py").read_text())
    r = CliRunner().invoke(main, ["validate", str(spec)])
    assert r.exit_code == 0 and "warning[W007]: segment 'stem'" in r.output, r.output
    r = CliRunner().invoke(main, ["validate", "--deep", str(spec)])
    assert r.exit_code == 1 and "error[P086]" in r.output and "with data replicas in a pipeline" in r.output, r.output
