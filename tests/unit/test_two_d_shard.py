"""`shard` on channel x data and spatial x data: ZeRO-1 (`shard: optimizer`) over the replicas as
tensor x data runs it (runtime ZeroSlices over each position's group), and FSDP2 (`shard: full`)
over each position's replicas: channel x data's slices, spatial x data's whole weights."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from placer import api
from placer.cli.main import main
from placer.plan.ir import OpKind

ROOT = Path(__file__).resolve().parents[2]
CHANNEL, SPATIAL = ROOT / "specs" / "cnn_channel_data.yaml", ROOT / "specs" / "cnn_spatial_data.yaml"
# (spec, its 2-D segment's index, float32 bytes of the parameters each device of it holds:
# channel, half of conv1's and conv2's output channels; spatial, conv2 whole on every band)
CASES = [(CHANNEL, 0, 4 * ((16 * 3 * 9 + 16) + (16 * 16 * 9 + 16)) // 2),
         (SPATIAL, 1, 4 * (16 * 8 * 9 + 16))]
IDS = ["channel", "spatial"]


def _zero(k: int) -> list[str]:
    return [f"placement.{k}.parallel.shard=optimizer"]


@pytest.mark.parametrize("spec,k,held", CASES, ids=IDS)
def test_zero1_keeps_half_the_state_and_each_position_broadcasts_the_half_it_stepped(spec, k, held):
    plain, zero = api.plan(spec), api.plan(api.load(spec, _zero(k)))
    for d in ("cuda:2", "cuda:3"):  # devices of the 2-D segment alone
        assert plain.estimate.memory[d].param_bytes == held
        assert zero.estimate.memory[d].optimizer_bytes * 2 == plain.estimate.memory[d].optimizer_bytes == held
    parts = [o for o in zero.plan.unique_ops() if o.kind == OpKind.BROADCAST]
    for group in (("cuda:0", "cuda:2"), ("cuda:1", "cuda:3")):  # the devices holding the same slices
        mine = [o for o in parts if o.devices == group]
        assert [o.attrs["root"] for o in mine] == list(group) and all(o.phase == "step" for o in mine)
        assert [o.bytes for o in mine] == [held // 2] * 2
    assert len(parts) == 4 and not [o for o in plain.plan.unique_ops() if o.kind == OpKind.BROADCAST]
    # the gradients are still summed over the replicas before the step, as without the shard
    sums = sorted(o.devices for o in zero.plan.unique_ops() if o.kind == OpKind.ALL_REDUCE and o.tensor == "grads")
    assert sums == sorted(o.devices for o in plain.plan.unique_ops()
                          if o.kind == OpKind.ALL_REDUCE and o.tensor == "grads")


@pytest.mark.parametrize("spec,k,held", CASES, ids=IDS)
def test_zero1_is_zero_slices_over_each_position_stepped_after_the_sums(spec, k, held):
    text = api.generate(api.load(spec, [*_zero(k), "training.checkpoint.every=2"]))
    body = text.split("# Below: placer's runtime")[0]
    assert f"opt{k} = ZeroSlices(seg{k}.parameters(), dp{k}, torch.optim.SGD, lr=0.01, momentum=0.9)" in body
    assert "class ZeroSlices(torch.optim.Optimizer):" in text
    assert body.index(f"opt{k}.step()") > body.index(f", dp{k}")  # summed over the replicas first
    # checkpointed as tensor x data's: each rank saves its part's optimizer state with its slices
    saved = next(line for line in body.splitlines() if "optimizers = [o for o in (" in line)
    assert f"opt{k}" in saved and "save_checkpoint(args.out, step, rank, modules, optimizers" in body
    assert "ZeroSlices" not in api.generate(spec)


def test_fsdp_over_channel_replicas_gathers_and_reduce_scatters_each_slice_per_layer():
    """`shard: full` on channel x data: FSDP2 over each position's replicas, a unit per layer; the
    devices hold 1/2 of their slices' parameters, gradients and optimizer state."""
    plain, full = api.plan(CHANNEL), api.plan(api.load(CHANNEL, ["placement.0.parallel.shard=full"]))
    slices = {"conv1": 4 * (16 * 3 * 9 + 16) // 2, "conv2": 4 * (16 * 16 * 9 + 16) // 2}  # a device's half
    for d in ("cuda:0", "cuda:2", "cuda:3"):  # (cuda:1 also holds the classifier)
        was, now = plain.estimate.memory[d], full.estimate.memory[d]
        assert now.param_bytes * 2 == now.grad_bytes * 2 == now.optimizer_bytes * 2 == was.param_bytes == sum(
            slices.values())
    ops = [o for o in full.plan.unique_ops() if o.segment == 0 and o.tensor in ("params", "grads") and o.kind != OpKind.STEP]
    for group in (("cuda:0", "cuda:2"), ("cuda:1", "cuda:3")):  # the devices holding the same slices
        mine = sorted((o.kind.name, o.phase, o.attrs["layer"], o.bytes) for o in ops if o.devices == group)
        assert mine == sorted((kind, phase, layer, b) for layer, b in slices.items() for kind, phase in (
            ("ALL_GATHER", "fwd"), ("ALL_GATHER", "bwd"), ("REDUCE_SCATTER", "bwd")))
    assert len(ops) == 12  # no all-reduce of the gradients over the replicas after backward
    text = api.generate(api.load(CHANNEL, ["placement.0.parallel.shard=full", "training.clip_grad_norm=1"]))
    body = text.split("# Below: placer's runtime")[0]
    assert body.index("seg0 = ChannelSplit(") < body.index("seg0 = fully_shard_segment(seg0, dp0, device.type)") \
        < body.index("opt0 = make_optimizer(seg0.parameters())")
    assert "all_reduce_slices" not in body and "whole = whole_params(named_params(full0, model))" in body
    # the norm counts each rank's shards of its slices, and a layer run whole once a replica
    assert "norm_params += seg0.sliced_parameters() + (list(seg0.parameters()) if rank in (0, 2) else [])" in body


def test_fsdp_over_spatial_replicas_shards_the_whole_weights_and_the_bands_sum_their_shards():
    """`shard: full` on spatial x data: FSDP2 over each position (conv2, whole on every band), then
    each replica's bands sum their half of its gradients; no all-reduce over the replicas."""
    full = api.plan(api.load(SPATIAL, ["placement.1.parallel.shard=full"]))
    conv2 = 4 * (16 * 8 * 9 + 16)
    for d in ("cuda:2", "cuda:3"):
        m = full.estimate.memory[d]
        assert m.param_bytes * 2 == m.grad_bytes * 2 == m.optimizer_bytes * 2 == conv2
    ops = [o for o in full.plan.unique_ops() if o.segment == 1 and o.tensor in ("params", "grads")
           and o.kind != OpKind.STEP]
    assert sorted((o.kind.name, o.phase, o.devices, o.bytes) for o in ops) == sorted(
        [(k, p, g, conv2) for g in (("cuda:0", "cuda:2"), ("cuda:1", "cuda:3"))
         for k, p in (("ALL_GATHER", "fwd"), ("ALL_GATHER", "bwd"), ("REDUCE_SCATTER", "bwd"))]
        + [("ALL_REDUCE", "bwd", g, conv2 // 2) for g in (("cuda:0", "cuda:1"), ("cuda:2", "cuda:3"))])
    body = api.generate(api.load(SPATIAL, ["placement.1.parallel.shard=full"])).split("# Below: placer's runtime")[0]
    assert body.index("seg1 = SpatialSplit(") < body.index("seg1 = fully_shard_segment(seg1, dp1, device.type)")
    assert "all_reduce_grads(seg1.parameters(), g1, bucket_mb=25.0)" in body and "dp1, bucket_mb" not in body


@pytest.mark.parametrize("spec,k", [(CHANNEL, 0), (SPATIAL, 1)], ids=IDS)
def test_every_shard_validates_over_replicas_and_none_without(spec, k, tmp_path):
    path = tmp_path / "spec.yaml"
    text = spec.read_text()
    for shard in ("optimizer", "full"):
        path.write_text(text.replace("data: 2}", f"data: 2, shard: {shard}}}"))
        assert CliRunner().invoke(main, ["validate", str(path)]).exit_code == 0
    path.write_text(text.replace("data: 2}", "shard: full}"))  # no replicas to shard over
    assert "error[P033]" in CliRunner().invoke(main, ["validate", str(path)]).output


def _module_spec(tmp_path, mode: str, shard: str, out: int = 4) -> Path:
    """A module model (Conv, ReLU, Conv to `out` channels) whose ReLU and last Conv are a 2-D
    `mode` x data group beside a one-device segment: run in lockstep (ReplicaRows)."""
    (tmp_path / "net.py").write_text("import torch.nn as nn\n\n\ndef make():\n    return nn.Sequential(\n"
                                     f"        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, {out}, 3, padding=1))\n")
    (tmp_path / "spec.yaml").write_text(f"""placer: 1
name: m
model: {{module: net.py:make, input: {{shape: [B, 3, 8, 8]}}, target: {{shape: [B, {out}, 8, 8]}}, loss: MSELoss}}
devices: [cpu, cpu:1, cpu:2, cpu:3, cpu:4]
placement:
  - {{layers: "0", device: cpu}}
  - {{layers: "1..2", devices: [cpu:1, cpu:2, cpu:3, cpu:4], parallel: {{mode: {mode}, data: 2, shard: {shard}}}}}
training: {{batch_size: 4, steps: 1, optimizer: {{op: SGD, lr: 0.1, kwargs: {{momentum: 0.9}}}}, seed: 0}}
""")
    return tmp_path / "spec.yaml"


@pytest.mark.parametrize("mode", ["channel", "spatial"])
def test_zero1_on_a_module_models_2d_segment_in_lockstep(mode, tmp_path):
    """A module model's chain run in lockstep (ReplicaRows) takes ZeroSlices the same way."""
    _module_spec(tmp_path, mode, "optimizer")
    spec = api.load(tmp_path / "spec.yaml")
    text = api.generate(spec)
    assert "opt1 = ZeroSlices(seg1.parameters(), dp1, torch.optim.SGD" in text and "ReplicaRows(" in text
    # conv 4 -> 4, 3x3: channel halves it on each device, spatial keeps it whole; each position broadcasts halves
    held = 4 * (4 * 4 * 9 + 4) // (2 if mode == "channel" else 1)
    parts = [o for o in api.plan(spec).plan.unique_ops() if o.kind == OpKind.BROADCAST]
    assert sorted((o.devices, o.bytes) for o in parts) == sorted(
        [(("cpu:1", "cpu:3"), held // 2)] * 2 + [(("cpu:2", "cpu:4"), held // 2)] * 2)


@pytest.mark.parametrize("mode", ["channel", "spatial"])
def test_fsdp_on_a_module_models_2d_segment_shards_its_split_as_padded_dim0_shards(mode, tmp_path):
    """`shard: full` on a module model's chain in lockstep: FSDP2 shards the split (ChannelSplit's
    slices, or the whole Convs SpatialSplit runs) over each position, as on an inline model, and
    the model's forward calls it (run_as_chain). The last Conv has 5 output channels: FSDP2 pads
    each parameter's dim 0 to a multiple of the 2 replicas, and the plan counts the padded shards."""
    path = _module_spec(tmp_path, mode, "full", out=5)
    assert CliRunner().invoke(main, ["validate", "--deep", str(path)]).exit_code == 0
    spec = api.load(path)
    body = api.generate(spec).split("# Below: placer's runtime")[0]
    split = "ChannelSplit(" if mode == "channel" else "SpatialSplit("
    assert body.index(f"seg1 = {split}") < body.index("seg1 = fully_shard_segment(seg1, dp1, device.type)") \
        < body.index("ReplicaRows(") < body.index("opt1 = make_optimizer(seg1.parameters())")
    assert "fully_shard_layers" not in body and "all_reduce_slices" not in body
    ops = [o for o in api.plan(spec).plan.unique_ops() if o.tensor in ("params", "grads") and o.kind != OpKind.STEP]
    # a position's rows of the Conv (weight 4 x 3 x 3 and a bias per row), padded to even: channel's
    # slices are 3 and 2 rows (3 padded to 4), spatial's weights are whole, 5 rows (padded to 6)
    rows = {("cpu:1", "cpu:3"): 4, ("cpu:2", "cpu:4"): 2} if mode == "channel" else \
        {("cpu:1", "cpu:3"): 6, ("cpu:2", "cpu:4"): 6}
    fsdp = [(kind, phase, g, 4 * n * (4 * 9 + 1)) for g, n in rows.items()
            for kind, phase in (("ALL_GATHER", "fwd"), ("ALL_GATHER", "bwd"), ("REDUCE_SCATTER", "bwd"))]
    # spatial: then each replica's bands sum their shard's gradients, torch.chunk's rows: 3, then 2
    sums = [] if mode == "channel" else [("ALL_REDUCE", "bwd", ("cpu:1", "cpu:2"), 4 * 3 * 37),
                                         ("ALL_REDUCE", "bwd", ("cpu:3", "cpu:4"), 4 * 2 * 37)]
    assert sorted((o.kind.name, o.phase, o.devices, o.bytes) for o in ops) == sorted(fsdp + sums)
