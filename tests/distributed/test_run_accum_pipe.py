"""training.accumulate with a pipeline, run for real (gloo, CPU workers): each of the 2 micro-steps
is a whole pipeline step over its micro-batches, the gradients add up in .grad and every data
group syncs once per optimizer step, in each pipeline path the program has:

- torch's 1F1B schedule over data-parallel stages (`schedule.step` per micro-step);
- placer's GPipe loops over a data stage, a tensor stage and a one-device head;
- placer's 1F1B loops (the schedule's order) over the same stages;
- a Hugging Face Llama in lockstep under 1F1B, two replica pipelines: rotary cos / sin are not
  cut by rows, so they cross once per micro-batch of every micro-step (twice the bytes).

Each `placer run --check` matches the one-device reference that takes the same micro-steps
(rtol 1e-5, atol 4e-5), and each device sends per step what its plan says: a sync in every
micro-step, or rotary counted once per micro-batch of the whole step, would differ."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.main import main

try:
    from .test_run_lockstep_data import spec_for
    from .test_run_modes import assert_sends_what_the_plan_says
except ImportError:  # run as a top-level module
    from test_run_lockstep_data import spec_for
    from test_run_modes import assert_sends_what_the_plan_says

pytestmark = pytest.mark.distributed

SPECS = Path(__file__).resolve().parents[2] / "specs"
RUNS = {  # name: (spec, --set overrides)
    "torch_1f1b_data_stages": (SPECS / "mlp_pipeline_data_stages.yaml", []),
    "gpipe_loops_tensor_stage": (SPECS / "mlp_pipeline_gpipe_mixed.yaml", []),
    "1f1b_loops_tensor_stage": (SPECS / "mlp_pipeline_gpipe_mixed.yaml", ["pipeline.schedule=1f1b"]),
    "lockstep_llama_1f1b": (None, []),
}


@pytest.mark.parametrize("name", RUNS)
def test_accumulate_in_a_pipeline_matches_one_device_and_sends_the_plans_bytes(name, tmp_path):
    spec, sets = RUNS[name]
    if spec is None:
        pytest.importorskip("transformers")
        spec = spec_for("llama-1f1b", tmp_path)
    sets = [*sets, "training.accumulate=2"]
    run = tmp_path / "run"
    result = CliRunner().invoke(main, ["run", str(spec), "--check", "--steps", "2", "--run-dir", str(run),
                                       *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 0, result.output + ((run / "run.log").read_text() if (run / "run.log").exists() else "")
    assert "check passed" in result.stdout
    program = (run / "program.py").read_text()
    assert "for micro in range(2):" in program and "ACCUMULATE = 2" in program
    assert_sends_what_the_plan_says(name, spec, json.loads((run / "metrics.json").read_text()), sets)


ZERO = ["placement.1.parallel={mode: tensor, data: 2, shard: optimizer}", "training.optimizer={op: Adam, lr: 0.01}",
        "training.clip_grad_norm=0.05", "training.lr_schedule={op: StepLR, kwargs: {step_size: 1, gamma: 0.5}}"]


def test_tensor_x_data_with_a_sharded_optimizer_matches_one_device_and_sends_the_plans_bytes(tmp_path):
    """ZeRO-1 over the replicas of a 2-D tensor segment (runtime ZeroSlices): each device keeps
    Adam's state for 1/2 of its slices, steps them (after the global-norm clip, at the scheduled
    lr) and broadcasts them to the device at its position in the other replica."""
    spec, run = SPECS / "mlp_tensor_data.yaml", tmp_path / "run"
    result = CliRunner().invoke(main, ["run", str(spec), "--check", "--steps", "3", "--run-dir", str(run),
                                       *[a for s in ZERO for a in ("--set", s)]])
    assert result.exit_code == 0, result.output + ((run / "run.log").read_text() if (run / "run.log").exists() else "")
    assert "check passed" in result.stdout
    program = (run / "program.py").read_text()
    assert "opt1 = ZeroSlices(seg1.parameters(), dp1, torch.optim.Adam, lr=0.01)" in program
    assert_sends_what_the_plan_says("tensor_zero", spec, json.loads((run / "metrics.json").read_text()), ZERO)
