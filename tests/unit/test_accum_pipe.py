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
