"""Lowering passes: what each inserts, where, and that random placements always lower to valid plans."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from placer.diagnostics import PlanError
from placer.estimate.comm import op_moves
from placer.estimate.memory import held_params
from placer.model.graph import LayerInfo, ModelGraph
from placer.plan.ir import TRANSFERS, Op, OpKind
from placer.plan.layout import in_layout
from placer.plan.lower import PASSES, buckets, insert_copies, insert_splits, lower
from placer.plan.place import place, segment_params
from placer.plan.text import format_plan, parse_plan
from placer.spec.check import load_spec

ROOT = Path(__file__).resolve().parents[2]

N_LAYERS, BATCH = 6, 24
HEAD = f"""\
placer: 1
name: lowered
model:
  layers:
    - {{name: fc, op: Linear, args: [8, 8], repeat: {N_LAYERS}}}
  input: {{shape: [B, 8]}}
  target: {{shape: [B, 8]}}
  loss: MSELoss
"""
GRAPH = ModelGraph(layers=tuple(
    LayerInfo(name=f"fc.{i}", op="Linear", params=72, param_bytes=288, buffer_bytes=0, in_shape=(BATCH, 8),
              out_shape=(BATCH, 8), out_bytes=BATCH * 32, in_bytes=BATCH * 32, saved_bytes=BATCH * 32,
              flops=2 * BATCH * 64) for i in range(N_LAYERS)),
    batch_size=BATCH, input_shape=(BATCH, 8), input_dtype="float32")


def spec_from(path, body: str):
    path.write_text(HEAD + textwrap.dedent(body) + f"training: {{batch_size: {BATCH}, steps: 1, "
                    "optimizer: {op: SGD, lr: 0.1}}\n")
    return load_spec(str(path))


def lowered(tmp_path, body: str, passes=PASSES):
    spec = spec_from(tmp_path / "spec.yaml", body)
    return lower(place(spec, GRAPH), spec, GRAPH, passes), spec


def kinds(plan, device) -> list[str]:
    return [f"{o.kind.value} {o.tensor}" for o in plan.ops[device]]


def test_copy_goes_after_the_producer_and_before_the_consumer(tmp_path):
    plan, _ = lowered(tmp_path, """\
        devices: [cuda:0, cuda:1]
        placement:
          - {layers: fc.0..fc.2, device: cuda:0}
          - {layers: fc.3..fc.5, device: cuda:1}
        """)
    assert kinds(plan, "cuda:0") == ["compute fc.0..fc.2", "copy act", "copy grad", "compute fc.0..fc.2",
                                     "step params"]
    assert kinds(plan, "cuda:1") == ["copy act", "compute fc.3..fc.5", "compute fc.3..fc.5", "copy grad",
                                     "step params"]
    fwd = plan.ops["cuda:0"][1]
    assert (fwd.src, fwd.dst, fwd.bytes, fwd.route, fwd.phase) == (("cuda:0",), ("cuda:1",), BATCH * 32, "direct", "fwd")


def test_each_pass_is_verified(tmp_path):
    def drop_a_copy(plan, spec, graph):
        return plan.with_ops({d: [o for o in ops if not (d == "cuda:1" and o.kind == OpKind.COPY)]
                              for d, ops in plan.ops.items()})

    with pytest.raises(PlanError) as e:
        lowered(tmp_path, """\
            devices: [cuda:0, cuda:1]
            placement:
              - {layers: fc.0..fc.2, device: cuda:0}
              - {layers: fc.3..fc.5, device: cuda:1}
            """, passes=(insert_copies, drop_a_copy, insert_splits))
    msg = e.value.diagnostics[0].message
    assert "after drop_a_copy" in msg and "\n>> copy s1 fwd act cuda:0->cuda:1" in msg


def test_data_segment_buckets_follow_bucket_mb(tmp_path):
    plan, spec = lowered(tmp_path, """\
        devices: [cuda:0, cuda:1]
        placement:
          - {layers: fc.0..fc.5, devices: [cuda:0, cuda:1], parallel: {mode: data, bucket_mb: 0.0006}}
        """)
    # 0.0006 MiB = 629 bytes: two 288-byte layers per bucket, filled from the last layer
    seg = plan.segments[0]
    assert buckets(seg, GRAPH, 0.0006) == [(576, ("fc.4", "fc.5")), (576, ("fc.2", "fc.3")), (576, ("fc.0", "fc.1"))]
    ar = [o for o in plan.ops["cuda:0"] if o.kind == OpKind.ALL_REDUCE]
    assert [o.attrs["layers"] for o in ar] == ["fc.4..fc.5", "fc.2..fc.3", "fc.0..fc.1"]
    assert plan.ops["cuda:0"][-2].kind == OpKind.ALL_REDUCE and plan.ops["cuda:0"][-1].kind == OpKind.STEP


def test_fully_sharded_gathers_around_each_layer(tmp_path):
    plan, _ = lowered(tmp_path, """\
        devices: [cuda:0, cuda:1]
        placement:
          - {layers: fc.0..fc.1, devices: [cuda:0, cuda:1], parallel: {mode: data, shard: full}}
          - {layers: fc.2..fc.5, device: cuda:0}
        """)
    assert kinds(plan, "cuda:1") == [
        "all_gather params", "compute fc.0", "all_gather params", "compute fc.1", "merge act",
        "split grad", "all_gather params", "compute fc.1", "reduce_scatter grads",
        "all_gather params", "compute fc.0", "reduce_scatter grads", "step params"]


def test_pipeline_sends_every_microbatch_both_ways(tmp_path):
    plan, _ = lowered(tmp_path, """\
        devices: [cuda:0, cuda:1, cuda:2, cuda:3]
        placement:
          - {layers: fc.0..fc.2, devices: [cuda:0, cuda:1], parallel: data}
          - {layers: fc.3..fc.5, devices: [cuda:2, cuda:3], parallel: data}
        pipeline: {microbatches: 4, schedule: 1f1b}
        """)
    sends = [(o.devices, o.phase, o.microbatch, o.bytes) for o in plan.unique_ops() if o.kind == OpKind.SEND]
    # each replica sends its half of each micro-batch (24 / 4 / 2 = 3 rows of 32 bytes) to its partner
    want = [(pair, phase, mb, 96) for mb in range(4) for pair, phase in
            ((("cuda:0", "cuda:2"), "fwd"), (("cuda:1", "cuda:3"), "fwd"),
             (("cuda:2", "cuda:0"), "bwd"), (("cuda:3", "cuda:1"), "bwd"))]
    assert sorted(sends) == sorted(want)
    # the gradient all-reduce of a stage runs once, after its last backward
    ops = plan.ops["cuda:2"]
    last_bwd = max(i for i, o in enumerate(ops) if o.kind == OpKind.COMPUTE and o.phase == "bwd")
    assert [o.kind for o in ops[last_bwd + 1:]] == [OpKind.SEND, OpKind.ALL_REDUCE, OpKind.STEP]


def test_zero_bubble_halves(tmp_path):
    plan, _ = lowered(tmp_path, """\
        devices: [cuda:0, cuda:1]
        placement:
          - {layers: fc.0, device: cuda:0}
          - {layers: fc.1..fc.2, device: cuda:1}
          - {layers: fc.3, device: cuda:1}
          - {layers: fc.4..fc.5, device: cuda:0}
        pipeline: {microbatches: 4, schedule: zbv_zero_bubble}
        """)
    phases = {o.phase for o in plan.ops["cuda:0"] if o.kind == OpKind.COMPUTE}
    assert phases == {"fwd", "bwd_input", "bwd_weight"}
    # stages 1 and 2 share cuda:1 (the turn of the V): nothing is sent between them
    assert not [o for o in plan.unique_ops() if o.kind == OpKind.SEND and o.segment == 2]


# ---- any placement lowers to a valid plan ---------------------------------------------------------

DEVICES = ["cpu", "cuda:0", "cuda:1", "cuda:2"]


@st.composite
def placements(draw):
    cuts = sorted(draw(st.sets(st.integers(1, N_LAYERS - 1), max_size=3)))
    bounds = list(zip([0] + cuts, cuts + [N_LAYERS]))
    segs = []
    for a, b in bounds:
        layers = f"fc.{a}..fc.{b - 1}"
        route = draw(st.sampled_from(["", ", copies: {route: via_host}"]))
        if draw(st.booleans()):
            segs.append(f"  - {{layers: {layers}, device: {draw(st.sampled_from(DEVICES))}{route}}}")
            continue
        group = draw(st.lists(st.sampled_from(DEVICES), min_size=2, max_size=3, unique=True))
        modes = ["data", "channel"] + (["tensor"] if (b - a) % 2 == 0 else [])
        mode = draw(st.sampled_from(modes))
        opts = ""
        if mode == "data":
            sync = draw(st.sampled_from(["allreduce", "broadcast", "parameter_server"]))
            opts = f", sync: {sync}, bucket_mb: {draw(st.sampled_from([0.0003, 0.001, 25]))}"
            if sync == "parameter_server":
                opts += f", server: {draw(st.sampled_from(DEVICES))}"
            elif sync == "allreduce":
                opts += f", shard: {draw(st.sampled_from(['none', 'optimizer', 'full']))}"
        segs.append(f"  - {{layers: {layers}, devices: [{', '.join(group)}], parallel: {{mode: {mode}{opts}}}{route}}}")
    return f"devices: [{', '.join(DEVICES)}]\nplacement:\n" + "\n".join(segs) + "\n"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(placements())
def test_random_placements_lower_to_valid_plans(tmp_path, body):
    plan, spec = lowered(tmp_path, body)  # every pass verified
    assert parse_plan(format_plan(plan)) == plan
    unique = plan.unique_ops()
    for prev, cur in zip(plan.segments, plan.segments[1:]):
        xfers = [o for o in unique if o.kind in TRANSFERS and o.segment == cur.index]
        if in_layout(prev) == in_layout(cur):
            assert not xfers
            continue
        # exactly one transfer each way, of the boundary activation
        assert sorted(o.phase for o in xfers) == ["bwd", "fwd"]
        assert all(o.bytes == BATCH * 32 for o in xfers)
        if len(prev.devices) == len(cur.devices) == 1:
            assert {o.kind for o in xfers} == {OpKind.COPY}
    for op in unique:
        if op.kind in TRANSFERS and not op.attrs.get("reduce"):
            # every destination gets at most its part, and all of it when it held none of the tensor
            n = len(op.dst)
            for j, t in enumerate(op.dst):
                part = round(op.bytes * (j + 1) / n) - round(op.bytes * j / n) if op.dst_dim is not None else op.bytes
                got = sum(n for a, b, n in _direct(op) if b == t)
                assert got <= part and (t in op.src or got == part)
    for seg in plan.segments:
        held = sum(held_params(seg, GRAPH, d)[0] for d in seg.devices)
        total = segment_params(seg, GRAPH)[0]
        if seg.mode == "channel" or seg.options.get("shard") == "full":
            assert held == total  # split, not copied
        elif seg.mode != "tensor":
            assert held == total * len(seg.devices)


def _direct(op: Op):
    return op_moves(op.with_(route="direct"))


def test_the_plan_gathers_a_channel_split_where_the_program_does():
    """The plan's rule for which layers run on a channel slice is the program's ChannelSplit's."""
    import torch.nn as nn

    from placer.codegen.runtime import channel
    from placer.modes.channel import role as channel_role
    from placer.spec.torch_names import NN_MODULES

    def role(cls) -> str:
        return channel_role(cls.__name__)

    layers = [getattr(nn, n) for n in sorted(NN_MODULES)]  # every layer a spec may name
    runs_on_slice = {c for c in layers if issubclass(c, channel.CHANNEL_WISE_LAYERS + channel.ELEMENTWISE_LAYERS)
                     or issubclass(c, nn.modules.batchnorm._BatchNorm)}
    assert {c for c in layers if role(c) == "follows"} == runs_on_slice
    assert {c for c in layers if role(c) == "split"} == set(channel.CHANNEL_SPLIT_LAYERS)


def test_tensor_pairs_are_one_rule_for_plan_memory_and_program():
    """modes.tensor.pairs decides the plan's all-reduces, the memory each device holds and the
    pairs the program splits: the segment of issue 10 pairs (up1, down1) and (up2, down2)."""
    from placer.codegen.program import generate
    from placer.estimate.memory import held_params
    from placer.model.build import build_graph
    from placer.modes import tensor
    from placer.plan.lower import lower
    from placer.plan.place import place
    from placer.spec import check, load

    spec, _ = check.validate_document(load.load_file(str(ROOT / "tests/cases/valid/tensor_between_layers/spec.yaml")))
    graph = build_graph(spec)
    plan = lower(place(spec, graph), spec, graph)
    assert tensor.planned_pairs(plan, 0) == [("up1", "down1"), ("up2", "down2")]
    text = "".join(generate(spec).text.split())  # the formatter may break the call over lines
    assert 'tensor_parallelize(stage,g0,[("0","2"),("3","7")],device.type' in text
    # each device holds half of every paired weight, and the row halves' whole biases
    whole = sum(graph.layer(n).params for n in plan.segments[0].layers)
    halves = [held_params(plan.segments[0], graph, d)[0] for d in ("cpu:0", "cpu:1")]
    assert sum(halves) == whole + 12 + 12  # the two row biases (12 each) are on both
