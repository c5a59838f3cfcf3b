"""precision bf16 on module models in lockstep: each tensor crossing a boundary leaves in the dtype
one device holds there under autocast (placer.model.trace.autocast_dtypes, on fake CPU tensors),
the receiver allocates that dtype and the plan counts its bytes; a split group whose input crosses
in bfloat16 counts its input gradient's all-reduce in bfloat16. And W002/W006 see the BatchNorms
inside a placed block (a ResNet BasicBlock), not only a layer that is one."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from placer.codegen.program import generate
from placer.model.build import build_graph, deep_check
from placer.plan.ir import OpKind
from placer.plan.lower import lower
from placer.plan.place import place
from placer.spec.check import load_spec

MODELS = Path(__file__).resolve().parents[1] / "models"


def lowered(spec):
    graph = build_graph(spec)
    return graph, lower(place(spec, graph), spec, graph)


def with_precision(path: Path, precision: str):
    spec = load_spec(str(path))
    return dataclasses.replace(spec, training=dataclasses.replace(spec.training, precision=precision))


def forward_copies(plan) -> dict:
    return {(op.attrs["of"], op.dst[0]): op.bytes for op in plan.unique_ops()
            if op.kind == OpKind.COPY and op.phase == "fwd"}


def test_a_resnet_stem_output_crosses_in_bfloat16_and_the_plan_counts_two_bytes(tmp_path):
    """The stem (conv1, bn1, relu, maxpool) under autocast makes bfloat16; it crosses so into
    layer1.0's skip add (one device adds two bfloat16 tensors there), forward and its gradient
    back, and the program's LAYERS, which its receiver allocates from, say bfloat16."""
    path = MODELS / "resnet_stem_channel.yaml"
    g32, p32 = lowered(with_precision(path, "fp32"))
    spec = with_precision(path, "bf16")
    g16, p16 = lowered(spec)
    assert g32.layer("maxpool").out_leaves[0][1] == "float32"
    assert g16.layer("maxpool").out_leaves[0][1:] == ("bfloat16", True)
    elements = 4 * 8 * 8 * 8  # batch 4, 8 channels, 8 x 8 after the stem's two strides
    assert forward_copies(p32) == {("maxpool", "cpu:2"): 4 * elements}
    assert forward_copies(p16) == {("maxpool", "cpu:2"): 2 * elements}
    back = [op.bytes for op in p16.unique_ops() if op.kind == OpKind.COPY and op.phase == "bwd"]
    assert back and all(b == 2 * elements for b in back)
    text = generate(spec, out_dir=str(tmp_path)).text
    assert '"maxpool": (0, "tensor", [([4, 8, 8, 8], "bfloat16")]),' in text


def test_a_residual_sum_crosses_in_float32_as_one_device_holds_it():
    """TinyGPT's blocks return x + attn(x): float32 plus bfloat16 is float32 under autocast, so
    what crosses out of the tensor group keeps 4 bytes an element."""
    spec = with_precision(MODELS / "tinygpt_tensor_sandwich.yaml", "bf16")
    graph, plan = lowered(spec)
    last = plan.segments[1].layers[-1]
    assert graph.layer(last).out_leaves[0][1] == "float32"
    (shape, _, _), = graph.layer(last).out_leaves
    copies = forward_copies(plan)
    assert copies[(last, "cpu")] == 4 * shape[0] * shape[1] * shape[2]


def test_a_channel_group_fed_bfloat16_reduces_its_input_gradient_in_bfloat16():
    """stem_split_v's classifier (fc, by channels over cpu and cpu:1) receives avgpool's bfloat16
    output: the all-reduce of its input gradient moves bfloat16 too, the bytes of the crossing."""
    spec = load_spec(str(MODELS / "stem_split_v.yaml"))  # precision: bf16, 2 micro-batches of 2 rows
    _, plan = lowered(spec)
    ops = [op for op in plan.unique_ops() if op.segment == 3 and op.microbatch in (0, None)]
    (reduce,) = [op for op in ops if op.kind == OpKind.ALL_REDUCE and op.phase == "bwd"]
    crossing = {op.bytes for op in ops if op.kind == OpKind.RECV and op.attrs.get("of") == "avgpool"}
    assert reduce.bytes == 2 * 16 * 2 and crossing == {reduce.bytes}


def resnet_by_blocks(tmp_path: Path, middle: str) -> Path:
    """A ResNet-18 whose data segment holds layer1's two BasicBlocks only (BatchNorms inside)."""
    text = f"""placer: 1
name: resnet_blocks
model:
  module: {MODELS / "resnet_tv.py"}:ResNet18
  input: {{shape: [B, 3, 16, 16]}}
  target: {{shape: [B], dtype: int64, high: 10}}
  loss: CrossEntropyLoss
devices: [cpu, cpu:1, cpu:2]
placement:
  - {{name: stem, layers: [conv1, bn1, relu, maxpool], device: cpu}}
  - {{name: blocks, layers: [layer1.*], devices: [cpu:1, cpu:2], parallel: {middle}}}
  - {{name: rest, layers: [layer2.*, layer3.*, layer4.*, avgpool, fc], device: cpu}}
training: {{batch_size: 8, steps: 1, optimizer: {{op: SGD, lr: 0.05}}}}
"""
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def warnings_of(path: Path) -> list:
    return [d for d in deep_check(load_spec(str(path))) if d.code in ("W002", "W006")]


def test_w006_names_a_block_whose_batchnorms_see_part_of_the_batch(tmp_path):
    (w,) = warnings_of(resnet_by_blocks(tmp_path, "{mode: data}"))
    assert w.code == "W006" and w.severity == "warning"
    assert "layer 'layer1.0' holds a BatchNorm in data segment 'blocks'" in w.message
    assert w.loc.line == 11  # the segment's `layers: [layer1.*]`, which placed the block


def test_sync_batchnorm_on_blocks_holding_batchnorms_is_no_w002(tmp_path):
    assert warnings_of(resnet_by_blocks(tmp_path, "{mode: data, sync_batchnorm: true}")) == []


def test_w002_still_fires_where_no_placed_block_holds_a_batchnorm(tmp_path):
    path = resnet_by_blocks(tmp_path, "{mode: data, sync_batchnorm: true}")
    path.write_text(path.read_text().replace("[layer1.*]", "[avgpool]").replace(
        "[layer2.*, layer3.*, layer4.*, avgpool, fc]", "[fc]").replace(
        "[conv1, bn1, relu, maxpool]", "[conv1, bn1, relu, maxpool, layer1.*, layer2.*, layer3.*, layer4.*]"))
    (w,) = warnings_of(path)
    assert w.code == "W002" and "segment 'blocks': sync_batchnorm is set but it has no BatchNorm" in w.message
