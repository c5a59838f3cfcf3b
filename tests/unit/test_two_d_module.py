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


PIPELINED = ROOT / "tests" / "models" / "stem_split_data_1f1b.yaml"


def _pipelined(tmp_path, schedule: str, head: bool = False) -> Path:
    """stem_split_data.yaml as a pipeline under `schedule`: the 2-D spatial stem a stage, the rest
    on cpu:4 (`head`: the stem on cpu:4 too, the classifier a 2-D channel stage after it)."""
    text = SPEC.read_text().replace("relu3, avgpool], device: cpu:4}", "relu3, avgpool, fc], device: cpu:4}")
    text = text.replace("  - {name: head, layers: fc, devices: [cpu, cpu:1, cpu:2, cpu:3], parallel: {mode: channel, "
                        "data: 2}}\n", "")
    if head:
        text = text.replace("layers: [conv1, bn1, relu, maxpool]\n    devices: [cpu, cpu:1, cpu:2, cpu:3]\n"
                            "    parallel: {mode: spatial, dim: H, data: 2}\n", "layers: [conv1, bn1, relu, maxpool, "
                            "conv2, relu2, conv3, relu3, avgpool]\n    device: cpu:4\n")
        text = text.replace("  - {name: body, layers: [conv2, relu2, conv3, relu3, avgpool, fc], device: cpu:4}\n",
                            "  - {name: head, layers: fc, devices: [cpu, cpu:1, cpu:2, cpu:3], parallel: "
                            "{mode: channel, data: 2}}\n")
    spec = tmp_path / f"{schedule}{'_head' * head}.yaml"
    spec.write_text(text + f"pipeline: {{microbatches: 2, schedule: {schedule}}}\n")
    (tmp_path / "stem_net.py").write_text((SPEC.parent / "stem_net.py").read_text())
    return spec


def test_2d_chain_groups_in_pipelines_are_validated_and_generated(tmp_path):
    """Lockstep's micro-batch loops run a 2-D chain group as a stage (ReplicaRows cuts each
    micro-batch's rows): neither plain validate (W007) nor the built model's check (P086) refuses
    a spatial or channel x data stage under GPipe or 1F1B, and the program runs it in the schedule's loop."""
    for schedule in ("gpipe", "1f1b"):
        for head in (False, True):
            spec = _pipelined(tmp_path, schedule, head)
            r = CliRunner().invoke(main, ["validate", str(spec)])
            assert r.exit_code == 0 and "W007" not in r.output, r.output
            r = CliRunner().invoke(main, ["validate", "--deep", str(spec)])
            assert r.exit_code == 0 and "P086" not in r.output, r.output
            flat = "".join(api.generate(api.load(spec)).split())
            inner = "seg1" if head else "SpatialWhole(seg0)"
            assert f"ReplicaRows({inner},dp{int(head)},next(pforpin[[0,2],[1,3]]ifrankinp))" in flat, schedule
            assert ("crossing.backward_own(loss,crossed)" in flat) == (schedule == "1f1b"), schedule


def test_a_micro_batch_must_cut_into_the_replicas_rows(tmp_path):
    """ReplicaRows cuts each micro-batch's rows over the D replicas: P042 unless D divides them."""
    spec = _pipelined(tmp_path, "gpipe")
    r = CliRunner().invoke(main, ["validate", str(spec), "--set", "training.batch_size=2"])
    assert r.exit_code == 1 and "error[P042]: micro-batch of 1 is not divisible by the 2 devices" in r.output, r.output


def test_a_pipelined_2d_group_gathers_each_micro_batch_and_sums_gradients_once():
    """Per micro-batch, each replica gathers its rows' bands and each place the replicas' rows
    (1/m of the step's bytes each, m times: what the one-stage plan moves in a step); the
    gradients are summed once a step, after the last micro-batch's backward."""
    plan, whole = api.plan(PIPELINED).plan, api.plan(SPEC).plan
    m, out = plan.microbatches, 4 * 8 * 8 * 8 * 4  # maxpool's output, float32, the whole batch of 4
    assert m == 2
    gathers = [(op.phase, op.devices, op.dim, op.bytes) for op in plan.unique_ops()
               if op.segment == 0 and op.kind == OpKind.ALL_GATHER]
    assert sorted(gathers) == sorted([("fwd", r, 2, out // 2 // m) for r in REPLICAS for _ in range(m)] +
                                     [("fwd", p, 0, out // m) for p in PLACES for _ in range(m)])
    sums = sorted((op.devices, op.bytes) for op in plan.unique_ops() if op.kind == OpKind.ALL_REDUCE
                  and op.tensor == "grads")
    assert sums == sorted((op.devices, op.bytes) for op in whole.unique_ops() if op.kind == OpKind.ALL_REDUCE
                          and op.tensor == "grads" and op.segment == 0)
    assert [g for g, _ in sums] == sorted(REPLICAS + PLACES)


def test_a_pipelined_2d_group_keeps_half_a_1d_groups_activations_on_each_rank(tmp_path):
    """Each of the four ranks runs its replica's half of each micro-batch's rows (the band of
    them its place holds): it keeps half of what a rank of a two-rank spatial stage keeps."""
    one_d = PIPELINED.read_text().replace("devices: [cpu, cpu:1, cpu:2, cpu:3, cpu:4]", "devices: [cpu, cpu:1, cpu:4]")
    one_d = one_d.replace("devices: [cpu, cpu:1, cpu:2, cpu:3]\n", "devices: [cpu, cpu:1]\n").replace(
        "dim: H, data: 2}", "dim: H}")
    (tmp_path / "one_d.yaml").write_text(one_d)
    (tmp_path / "stem_net.py").write_text((SPEC.parent / "stem_net.py").read_text())
    acts = {d["device"]: d["activation_bytes"] for d in api.plan(PIPELINED).as_dict()["devices"]}
    ref = {d["device"]: d["activation_bytes"] for d in api.plan(tmp_path / "one_d.yaml").as_dict()["devices"]}
    assert acts["cpu"] == acts["cpu:3"] == ref["cpu"] // 2 > 0 and acts["cpu:4"] == ref["cpu:4"]
