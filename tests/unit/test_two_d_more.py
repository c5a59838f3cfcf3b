"""spatial x data (`parallel: {mode: spatial, data: D}`): D replicas of consecutive devices, each
cutting its rows of the batch into bands with halos as `spatial` does; the plan's layouts, halos,
gradient sums and memory, the program's groups and copies, and what is still refused."""
from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from placer import api
from placer.cli.main import main
from placer.plan.ir import Layout, OpKind
from placer.plan.layout import moves

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "cnn_spatial_data.yaml"
GROUP = ("d0", "d1", "d2", "d3")


def test_bands_within_replicas_arrive_through_each_replicas_first_device():
    banded = Layout(GROUP, 2, 2)  # rows across (d0, d1) and (d2, d3), bands of dim 2 within each
    # rows 8..15 go to d2; each first device keeps its first band and sends the second on
    assert moves(Layout(("d0",)), banded, 800) == [("d0", "d2", 400), ("d0", "d1", 200), ("d2", "d3", 200)]
    # and back: each replica's bands meet on its first device, which sends its rows
    assert moves(banded, Layout(("d1",)), 800) == [("d1", "d0", 200), ("d3", "d2", 200),
                                                  ("d0", "d1", 400), ("d2", "d1", 400)]


def test_the_plan_exchanges_halos_within_replicas_and_sums_gradients_over_bands_then_replicas():
    report = api.plan(SPEC)
    one = api.plan(api.load(SPEC, ["placement.1.parallel.data=1", "placement.1.devices=[cuda:2, cuda:3]"]))
    ops = [op for op in report.plan.unique_ops() if op.segment == 1]
    halos = {op.devices: op.bytes for op in ops if op.kind == OpKind.HALO and op.phase == "fwd"}
    one_halo = [op.bytes for op in one.plan.unique_ops() if op.kind == OpKind.HALO and op.phase == "fwd"]
    # each replica exchanges the halos of its half of the batch: half the bytes of one group's
    assert halos == {("cuda:0", "cuda:1"): one_halo[0] // 2, ("cuda:2", "cuda:3"): one_halo[0] // 2}
    sums = sorted(op.devices for op in ops if op.kind == OpKind.ALL_REDUCE and op.tensor == "grads")
    assert sums == [("cuda:0", "cuda:1"), ("cuda:0", "cuda:2"), ("cuda:1", "cuda:3"), ("cuda:2", "cuda:3")]
    # a device keeps a quarter of the batch's activations of the segment: half the rows of a 2-device split
    mem, one_mem = report.estimate.memory, one.estimate.memory
    assert mem["cuda:3"].activation_bytes * 2 == one_mem["cuda:3"].activation_bytes


def test_the_program_bands_each_replica_and_sums_over_its_bands_then_the_replicas():
    text = "".join(api.generate(SPEC).split())
    assert "SpatialSplit(stage,g1,next(rforrin[[0,1],[2,3]]ifrankinr),dim=2,size=16)" in text
    assert "Replicas([0,1,2,3],2,2)" in text
    assert "all_reduce_grads(seg1.parameters(),g1,bucket_mb=25.0)all_reduce_grads(seg1.parameters(),dp1" in text
    # as the first segment, each rank takes its band of its replica's rows of the batch
    first = api.load(SPEC, ["placement=[{layers: conv1..act2, devices: [cuda:0, cuda:1, cuda:2, cuda:3], "
                            "parallel: {mode: spatial, data: 2}}, {layers: flat..head, device: cuda:1}]"])
    text = "".join(api.generate(first).split())
    assert "local_slice(replica_slice(x,[[0,1],[2,3]],rank),next(rforrin[[0,1],[2,3]]ifrankinr),rank,2,)" in text


def _validate(tmp_path, text: str) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return CliRunner().invoke(main, ["validate", str(path)]).output


def test_a_batchnorm_in_a_spatial_x_data_segment_is_a_warning(tmp_path):
    """Each replica normalises over the bands of its own rows: run --check could not match one device."""
    text = SPEC.read_text().replace("    - {name: act2, op: ReLU}\n",
                                    "    - {name: bn2, op: BatchNorm2d, args: [16]}\n    - {name: act2, op: ReLU}\n")
    assert "warning[W006]" in _validate(tmp_path, text)
    assert "W006" not in _validate(tmp_path, SPEC.read_text())


def test_each_replicas_bands_must_take_whole_strides(tmp_path):
    """P029 counts the devices of one replica: 16 rows over 2 bands of stride 2 are fine, over 4 are not."""
    text = SPEC.read_text().replace("input: {shape: [B, 3, 16, 16]}", "input: {shape: [B, 3, 12, 12]}")
    text = text.replace("args: [1024, 10]", "args: [576, 10]")
    assert "P029" not in _validate(tmp_path, text)
    assert "error[P029]" in _validate(tmp_path, text.replace("data: 2}", "data: 1}"))


def test_spatial_x_data_in_a_module_model_runs_in_lockstep(tmp_path):
    """No longer P032: beside a one-device segment, each rank takes its replica's rows (ReplicaRows)."""
    (tmp_path / "net.py").write_text("import torch.nn as nn\n\n\ndef make():\n    return nn.Sequential(\n"
                                     "        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))\n")
    module = """placer: 1
name: m
model: {module: net.py:make, input: {shape: [B, 3, 8, 8]}, target: {shape: [B, 4, 8, 8]}, loss: MSELoss}
devices: [cpu, cpu:1, cpu:2, cpu:3, cpu:4]
placement:
  - {layers: "0", device: cpu}
  - {layers: "1..2", devices: [cpu:1, cpu:2, cpu:3, cpu:4], parallel: {mode: spatial, data: 2}}
training: {batch_size: 4, steps: 1, optimizer: {op: SGD, lr: 0.1}, seed: 0}
"""
    out = _validate(tmp_path, module)
    assert "error" not in out and "warning" not in out, out
    program = "".join(api.generate(api.load(tmp_path / "spec.yaml")).split())
    assert "ReplicaRows(SpatialWhole(seg1),dp1,next(pforpin[[1,3],[2,4]]ifrankinp))" in program


PIPE = ROOT / "specs" / "mlp_pipeline_tensor_data.yaml"


def test_a_2d_stage_runs_under_every_schedule_with_fsdp2_too(tmp_path):
    """placer's loops run a 2-D stage beside others under every schedule (no W005); FSDP2 x TP in a
    pipeline too, its first unit's backward prefetch off (it would gather the previous
    micro-batch's last unit in vain, a gather the plan does not count)."""
    assert "W005" not in _validate(tmp_path, PIPE.read_text())
    one_f = PIPE.read_text().replace("schedule: gpipe", "schedule: 1f1b")
    assert "W005" not in _validate(tmp_path, one_f)
    text = "".join(api.generate(api.load(PIPE, ["pipeline.schedule=1f1b"])).split())
    assert "order={" in text and "relayout_grad(" in text and "pending=sends" in text
    out = _validate(tmp_path, PIPE.read_text().replace("data: 2}", "data: 2, shard: full}"))
    assert "P032" not in out and "error" not in out, out
    text = api.generate(api.load(PIPE, ["placement.0.parallel.shard=full", "pipeline.schedule=1f1b"]))
    assert 'seg0 = fully_shard_segment(stage, mesh0["dp"], device.type)' in text
    assert "no_prefetch_across_micro_batches(seg0)" in text and "order = {" in text


ZERO_PIPE = ["placement.0.parallel.shard=optimizer", "training.optimizer={op: Adam, lr: 0.01}"]


def test_a_2d_stage_with_a_sharded_optimizer_runs_in_a_pipeline_under_every_schedule(tmp_path):
    """ZeRO-1 over a 2-D stage's replicas (ZeroSlices) in a pipeline: no P032 under GPipe, 1F1B
    or zero bubble; the program makes the ZeroSlices optimizer and steps it once, after every
    micro-batch; the plan broadcasts each device's part once a step, whatever the micro-batches."""
    zb = ROOT / "tests" / "cases" / "valid" / "pipeline_zero_bubble_tensor_data" / "spec.yaml"
    cases = [(PIPE, ZERO_PIPE), (PIPE, [*ZERO_PIPE, "pipeline.schedule=1f1b"]),
             (zb, ["placement.3.parallel.shard=optimizer"])]
    for spec, sets in cases:
        text = api.generate(api.load(spec, sets)).split("# Below: placer's runtime")[0]
        k = 0 if spec == PIPE else 3
        assert f"opt{k} = ZeroSlices(seg{k}.parameters(), dp{k}, " in text, spec
        assert text.count(f"opt{k}.step()") == 1 and text.index(f"opt{k}.step()") > text.rindex("backward(")
    one, four = (api.plan(api.load(PIPE, [*ZERO_PIPE, f"pipeline.microbatches={m}"])).plan for m in (2, 4))
    for plan in (one, four):
        parts = [op for op in plan.ops["cuda:0"] if op.kind == OpKind.BROADCAST and op.phase == "step"]
        assert [op.devices for op in parts] == [("cuda:0", "cuda:2")] * 2 and parts[0].microbatch is None
    out = _validate(tmp_path, PIPE.read_text().replace("data: 2}", "data: 2, shard: optimizer}"))
    assert "P032" not in out, out


def test_a_2d_stage_passes_each_micro_batchs_gradient_on_from_its_replicas_first_device():
    """The plan's sends are the program's: the gradient comes to each replica's first device, which
    sends it to the rest of its replica before its backward; a spatial replica's bands meet on its
    first device before it sends the rows on."""
    plan = api.plan(PIPE).plan
    ops = [(op.kind, op.phase, op.src, op.dst, op.microbatch) for op in plan.ops["cuda:0"]
           if op.kind in (OpKind.SEND, OpKind.RECV, OpKind.COMPUTE)]
    i = ops.index((OpKind.RECV, "bwd", ("cuda:4",), ("cuda:0",), 0))
    assert ops[i + 1] == (OpKind.SEND, "bwd", ("cuda:0",), ("cuda:1",), 0)
    assert ops[i + 2][:2] == (OpKind.COMPUTE, "bwd")
    spatial = api.plan(ROOT / "tests" / "cases" / "valid" / "pipeline_gpipe_spatial_data" / "spec.yaml").plan
    sends = [(op.kind, op.phase, op.src, op.dst) for op in spatial.ops["cuda:2"]
             if op.kind in (OpKind.SEND, OpKind.RECV) and op.microbatch == 0 and op.phase == "fwd"]
    assert sends == [(OpKind.RECV, "fwd", ("cuda:3",), ("cuda:2",)), (OpKind.SEND, "fwd", ("cuda:2",), ("cuda:4",))]
