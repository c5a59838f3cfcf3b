"""place: segments resolved with their options, and each device's compute ops in execution order."""
from __future__ import annotations

import textwrap

import pytest

from placer.model.graph import LayerInfo, ModelGraph
from placer.plan.ir import OpKind
from placer.plan.layout import in_layout
from placer.plan.place import place
from placer.spec.check import load_spec

SPEC = """\
placer: 1
name: placed
model:
  layers:
    - {name: fc, op: Linear, args: [8, 8], repeat: 4}
  input: {shape: [B, 8]}
  target: {shape: [B, 8]}
  loss: MSELoss
"""


def spec_of(tmp_path, body: str):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC + textwrap.dedent(body) + "training: {batch_size: 16, steps: 1, optimizer: {op: SGD, lr: 0.1}}\n")
    return load_spec(str(path))


def graph(names=("fc.0", "fc.1", "fc.2", "fc.3"), params=72) -> ModelGraph:
    """A hand-made graph: no torch needed, every number chosen."""
    return ModelGraph(layers=tuple(
        LayerInfo(name=n, op="Linear", params=params, param_bytes=4 * params, buffer_bytes=0, in_shape=(16, 8),
                  out_shape=(16, 8), out_bytes=512, in_bytes=512, saved_bytes=512, flops=2048) for n in names),
        batch_size=16, input_shape=(16, 8), input_dtype="float32")


def listing(plan, device) -> list[str]:
    return [f"{o.kind.value} s{o.segment} {o.phase} {o.tensor}" + (f" mb{o.microbatch}" if o.microbatch is not None
                                                                 else "") for o in plan.ops[device]]


def test_segments_resolved_with_defaults_and_routes(tmp_path):
    spec = spec_of(tmp_path, """\
        devices: [cpu, cuda:0, cuda:1]
        placement:
          - {name: a, layers: fc.0, device: cpu}
          - {name: b, layers: fc.1..fc.2, devices: [cuda:0, cuda:1], parallel: {mode: data, bucket_mb: 1},
             copies: {route: via_host}}
          - {name: c, layers: fc.3, devices: [cuda:0, cuda:1], parallel: {mode: data, sync: parameter_server,
             server: cpu}}
        copies: {route: direct}
        """)
    plan = place(spec, graph())
    a, b, c = plan.segments
    assert (a.layers, a.devices, a.mode, a.options, a.route, a.stage) == (("fc.0",), ("cpu",), "none", {}, "direct", None)
    assert b.layers == ("fc.1", "fc.2") and b.route == "via_host"
    assert b.options == {"sync": "allreduce", "bucket_mb": 1.0, "overlap": True, "shard": "none",
                         "sync_batchnorm": False}
    assert c.options["server"] == "cpu" and c.server == "cpu" and b.server is None
    # forward in model order, backward in reverse, then the steps; the server steps segment c
    assert listing(plan, "cpu") == ["compute s0 fwd fc.0", "compute s0 bwd fc.0", "step s0 step params",
                                    "step s2 step params"]
    assert listing(plan, "cuda:1") == ["compute s1 fwd fc.1..fc.2", "compute s2 fwd fc.3", "compute s2 bwd fc.3",
                                       "compute s1 bwd fc.1..fc.2", "step s1 step params"]


def test_layouts_follow_the_modes(tmp_path):
    spec = spec_of(tmp_path, """\
        devices: [cuda:0, cuda:1]
        placement:
          - {layers: fc.0..fc.1, devices: [cuda:0, cuda:1], parallel: channel}
          - {layers: fc.2..fc.3, devices: [cuda:0, cuda:1], parallel: tensor}
        """)
    ch, tp = place(spec, graph()).segments
    assert ch.options == {"axis": 1}  # the channel dim of a Linear output (16, 8)
    # both groups take and give whole tensors on every device: slices stay inside the group
    assert in_layout(ch).dim is None and in_layout(tp).dim is None


def test_broadcast_sync_steps_on_the_first_device_only(tmp_path):
    spec = spec_of(tmp_path, """\
        devices: [cuda:0, cuda:1]
        placement:
          - {layers: fc.0..fc.3, devices: [cuda:0, cuda:1], parallel: {mode: data, sync: broadcast}}
        """)
    plan = place(spec, graph())
    assert [o.kind for o in plan.ops["cuda:0"]][-1] == OpKind.STEP
    assert OpKind.STEP not in [o.kind for o in plan.ops["cuda:1"]]


def test_segments_without_parameters_get_no_step(tmp_path):
    spec = spec_of(tmp_path, """\
        devices: [cuda:0, cuda:1]
        placement:
          - {layers: fc.0..fc.1, device: cuda:0}
          - {layers: fc.2..fc.3, device: cuda:1}
        """)
    plan = place(spec, graph(params=0))
    assert not any(o.kind == OpKind.STEP for ops in plan.ops.values() for o in ops)


@pytest.mark.parametrize("schedule, cuda0", [
    ("gpipe", "F0 F1 F2 F3 B0 B1 B2 B3"),
    ("1f1b", "F0 F1 B0 F2 B1 F3 B2 B3"),  # p - stage = 2 forwards before the first backward
])
def test_pipeline_compute_follows_the_schedule(tmp_path, schedule, cuda0):
    spec = spec_of(tmp_path, f"""\
        devices: [cuda:0, cuda:1]
        placement:
          - {{layers: fc.0..fc.1, device: cuda:0}}
          - {{layers: fc.2..fc.3, device: cuda:1}}
        pipeline: {{microbatches: 4, schedule: {schedule}}}
        """)
    plan = place(spec, graph())
    assert [s.stage for s in plan.segments] == [0, 1]
    assert (plan.microbatches, plan.schedule) == (4, schedule)
    got = " ".join(f"{'F' if o.phase == 'fwd' else 'B'}{o.microbatch}" for o in plan.ops["cuda:0"]
                   if o.kind == OpKind.COMPUTE)
    assert got == cuda0


def test_interleaved_stages_share_devices(tmp_path):
    spec = spec_of(tmp_path, """\
        devices: [cuda:0, cuda:1]
        placement:
          - {layers: fc.0, device: cuda:0}
          - {layers: fc.1, device: cuda:1}
          - {layers: fc.2, device: cuda:0}
          - {layers: fc.3, device: cuda:1}
        pipeline: {microbatches: 4, schedule: interleaved_1f1b}
        """)
    plan = place(spec, graph())
    got = [f"{o.segment}{'F' if o.phase == 'fwd' else 'B'}{o.microbatch}" for o in plan.ops["cuda:0"]
           if o.kind == OpKind.COMPUTE]
    # torch's ScheduleInterleaved1F1B, rank 0 of 2, 2 stages each, 4 micro-batches
    assert got == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3".split()
