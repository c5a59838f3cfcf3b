"""training.accumulate with a pipeline (P095 retired): each micro-step is a whole pipeline step
over `pipeline.microbatches` micro-batches of its rows, in every pipeline path the program has
(torch's schedules, placer's GPipe and schedule-order loops, lockstep); gradients add up in .grad
and are synced and stepped once, after the last. The plan keeps one micro-batch of one
micro-step's activations and sends the same rows in all."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from placer import api
from placer.spec import load
from placer.spec.check import validate_document

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"
ACC = ["training.accumulate=2"]


def test_accumulate_with_a_pipeline_validates():
    doc = load.load_text((SPECS / "mlp_pipeline_1f1b.yaml").read_text().replace(
        "training:\n", "training:\n  accumulate: 2\n", 1), "<spec>")
    assert not [d for d in validate_document(doc)[1] if d.severity == "error"]


def _step(program: str) -> str:
    """The body of the training loop."""
    return program.split("for step in range(first, args.steps):", 1)[1].split("batch_losses.settle()", 1)[0]


# (spec, overrides, the pipeline step's line, the sync after it)
PATHS = {
    "torch_1f1b_data": ("mlp_pipeline_data_stages", [], "loss = pipeline_step(", "all_reduce_grads(seg0"),
    "gpipe_loops": ("mlp_pipeline_gpipe_mixed", [], "xs, ys, saved = x.chunk(4)", "all_reduce_grads(seg0"),
    "1f1b_loops": ("mlp_pipeline_gpipe_mixed", ["pipeline.schedule=1f1b"], "for action in order:",
                   "all_reduce_grads(seg0"),
}


@pytest.mark.parametrize("name", PATHS)
def test_each_micro_step_runs_the_whole_pipeline_then_one_sync(name):
    spec, sets, pipeline_line, sync = PATHS[name]
    step = _step(api.generate(str(SPECS / f"{spec}.yaml"), overrides=[*sets, *ACC]))
    loop = step.index("for micro in range(2):")
    assert "micro_x, micro_y, micro_losses = x.chunk(2), y.chunk(2), []" in step
    assert step.count(pipeline_line) == 1 and step.index(pipeline_line) > loop
    # the gradient sync and the steps come once, after the micro-steps, outside their loop
    indent = lambda line: len(line) - len(line.lstrip())  # noqa: E731
    lines = step.splitlines()
    at = next(i for i, line in enumerate(lines) if "for micro in range(2):" in line)
    synced = next(i for i, line in enumerate(lines) if sync in line)
    end = next(i for i, line in enumerate(lines) if line.strip().startswith("loss = ") and "micro_losses" in line)
    assert at < end < synced and indent(lines[end]) == indent(lines[at])
    assert "gradient_sync(" not in step  # no DDP in a pipeline's stages: nothing syncs in backward


def test_a_micro_batch_is_of_a_micro_steps_rows():
    """torch's stages get the shapes of one micro-batch of one micro-step."""
    one = api.generate(str(SPECS / "mlp_pipeline_data_stages.yaml"))
    two = api.generate(str(SPECS / "mlp_pipeline_data_stages.yaml"), overrides=ACC)
    shapes = [re.search(r"STAGE_SHAPES = \{\s*0: \(\(\((\d+),", p).group(1) for p in (one, two)]
    assert shapes == ["2", "1"]  # 16 rows / 4 micro-batches / 2 replicas, then / 2 micro-steps


def test_the_plan_keeps_one_micro_steps_micro_batch_and_sends_the_same_rows():
    spec = str(SPECS / "mlp_pipeline_data_stages.yaml")
    one, two = api.plan(spec), api.plan(spec, ACC)
    assert two.plan.accumulate == 2
    for d in one.plan.devices:
        a1, a2 = one.estimate.per_device[d].activation_bytes, two.estimate.per_device[d].activation_bytes
        assert a1 > 0 and a2 == a1 // 2
        assert sum(o.bytes for o in two.plan.ops[d]) == sum(o.bytes for o in one.plan.ops[d])


# tensor x data with shard: optimizer (ZeRO-1 over each position's group: runtime ZeroSlices)
TENSOR_DATA = str(SPECS / "mlp_tensor_data.yaml")
ADAM = ["training.optimizer={op: Adam, lr: 0.01}"]
ZERO = ["placement.1.parallel={mode: tensor, data: 2, shard: optimizer}"]


def test_a_2d_segments_sharded_optimizer_keeps_1_over_d_of_the_state_and_broadcasts_each_part():
    from placer.plan.ir import OpKind

    plain, zero = api.plan(TENSOR_DATA, ADAM), api.plan(TENSOR_DATA, [*ADAM, *ZERO])
    for d in ("cuda:2", "cuda:3"):  # the mlp segment's only (the others hold one-device segments too)
        assert zero.estimate.per_device[d].optimizer_bytes * 2 == plain.estimate.per_device[d].optimizer_bytes > 0
    ops = [o for o in zero.plan.unique_ops() if o.kind == OpKind.BROADCAST]
    sums = {o.devices: o.bytes for o in zero.plan.unique_ops() if o.kind == OpKind.ALL_REDUCE and o.tensor == "grads"}
    assert set(sums) == {("cuda:0", "cuda:2"), ("cuda:1", "cuda:3")}  # each position's gradients, then its parts
    for group, nbytes in sums.items():
        parts = [o for o in ops if o.devices == group]
        assert sorted(o.attrs["root"] for o in parts) == sorted(group)
        assert sum(o.bytes for o in parts) == nbytes
    assert not [o for o in api.plan(TENSOR_DATA, ADAM).plan.unique_ops() if o.kind == OpKind.BROADCAST]


def test_a_2d_segments_sharded_optimizer_is_zero_slices_over_its_position():
    program = api.generate(TENSOR_DATA, overrides=[*ADAM, *ZERO])
    assert "opt1 = ZeroSlices(seg1.parameters(), dp1, torch.optim.Adam, lr=0.01)" in program
    assert "class ZeroSlices(torch.optim.Optimizer):" in program
    assert "ZeroSlices" not in api.generate(TENSOR_DATA, overrides=ADAM)
