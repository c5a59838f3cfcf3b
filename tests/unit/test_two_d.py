"""2-D segments (`parallel: {mode: tensor, data: D}`): D replicas of consecutive devices, each
split as `tensor` splits; the plan's layouts, collectives and memory, and the program's groups."""
from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from placer import api
from placer.cli.main import main
from placer.plan.ir import Layout, OpKind
from placer.plan.layout import moves

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "mlp_tensor_data.yaml"
GROUP = ("d0", "d1", "d2", "d3")


def test_a_2d_layout_receives_on_each_replicas_first_device_which_copies_its_rows_on():
    into = moves(Layout(("d0",)), Layout(GROUP, None, 2), 800)
    # rows 0..7 stay on d0, rows 8..15 go to d2; then each first device copies its rows to its replica
    assert into == [("d0", "d2", 400), ("d0", "d1", 400), ("d2", "d3", 400)]
    # and it sends from the first devices: their rows, whole on each device of a one-mode tensor group
    assert moves(Layout(GROUP, None, 2), Layout(("d1", "d5"), None), 800) == [
        ("d0", "d1", 400), ("d2", "d1", 400), ("d0", "d5", 400), ("d2", "d5", 400)]
    # rows of a data group meet on the first devices
    assert moves(Layout(GROUP, 0), Layout(GROUP, None, 2), 800) == [
        ("d1", "d0", 200), ("d3", "d2", 200), ("d0", "d1", 400), ("d2", "d3", 400)]


def test_the_plan_splits_within_replicas_and_sums_gradients_across_them():
    report = api.plan(SPEC)
    plan = report.plan
    ops = [op for op in plan.unique_ops() if op.segment == 1 and op.kind == OpKind.ALL_REDUCE]
    pairs = {op.devices for op in ops if "pair" in op.attrs}
    assert pairs == {("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")}  # tensor parallel inside each replica
    assert all(op.bytes == 16 * 32 * 4 // 2 for op in ops if "pair" in op.attrs)  # a replica's 8 rows
    grads = {op.devices: op.bytes for op in ops if op.attrs.get("replicas")}
    # up1/up2 (column halves: 32 of 64 features, with their bias), down1/down2 (row halves: half the
    # weight, the whole bias), in float32, on each device of a position across the two replicas
    half = 4 * 2 * ((32 * 32 + 32) + (32 * 32 + 32))
    assert grads == {("cuda:0", "cuda:2"): half, ("cuda:1", "cuda:3"): half}
    memory = report.estimate.memory
    assert memory["cuda:2"].param_bytes == memory["cuda:3"].param_bytes == half


def test_the_program_makes_a_group_per_replica_and_per_position():
    text = "".join(api.generate(SPEC).split())
    assert "forranksin[[0,1],[2,3]]:#thedatareplicas" in text
    assert "forranksin[[0,2],[1,3]]:#thesameslicesineveryreplica" in text
    assert "all_reduce_slices(seg1,dp1)" in text and "Replicas([0,1,2,3],2)" in text


def test_fsdp2_x_tp_shards_each_replicas_slices_over_the_replicas():
    spec = api.load(SPEC, ["placement.1.parallel.shard=full"])
    report = api.plan(spec)
    ops = [op for op in report.plan.unique_ops() if op.segment == 1]
    gathers = {op.devices for op in ops if op.kind == OpKind.ALL_GATHER}
    assert gathers == {("cuda:0", "cuda:2"), ("cuda:1", "cuda:3")}  # over dp, per tp position
    assert not [op for op in ops if op.attrs.get("replicas") and op.kind == OpKind.ALL_REDUCE]
    half = 4 * 2 * ((32 * 32 + 32) + (32 * 32 + 32))  # what a tp position holds (as above)
    assert report.estimate.memory["cuda:3"].param_bytes == half // 2  # FSDP2: half of it on each replica
    text = "".join(api.generate(spec).split())
    assert 'mesh1=DeviceMesh.from_group([dp1,g1],device.type,mesh=[[0,1],[2,3]],mesh_dim_names=("dp","tp"))' in text
    assert 'tensor_parallelize(stage,mesh1["tp"]' in text and 'fully_shard_segment(stage,mesh1["dp"]' in text


def test_shard_without_replicas_is_refused(tmp_path):
    spec = SPEC.read_text().replace("parallel: {mode: tensor, data: 2}", "parallel: {mode: tensor, shard: full}")
    spec = spec.replace("devices: [cuda:0, cuda:1, cuda:2, cuda:3], parallel", "devices: [cuda:0, cuda:1], parallel")
    path = tmp_path / "spec.yaml"
    path.write_text(spec)
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 1 and "error[P033]" in result.output, result.output


def test_a_batchnorm_in_a_channel_x_data_segment_is_a_warning(tmp_path):
    """Each replica normalises over its own rows: run --check could not match one device."""
    spec = (ROOT / "specs" / "cnn_channel_data.yaml").read_text().replace(
        "    - {name: act1, op: ReLU}\n", "    - {name: bn1, op: BatchNorm2d, args: [16]}\n    - {name: act1, op: ReLU}\n")
    path = tmp_path / "spec.yaml"
    path.write_text(spec)
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 0 and "warning[W006]" in result.output and "2-D segment" in result.output, \
        result.output
    assert "W006" not in CliRunner().invoke(main, ["validate", str(ROOT / "specs" / "cnn_channel_data.yaml")]).output
