"""Split modes on module models in lockstep under every schedule (codegen/loops.py): the shipped
TinyGPT with a tensor stage under 1F1B (both ranks of the group walk the same actions, so their
all-reduces match), and under interleaved 1F1B with a tensor stage and a channel head on the same
two ranks (each rank holds two stages: each micro-batch's forward runs in a thread that waits for
the schedule's action of its next stage). Each `placer run --check` matches the one-device
reference (losses, every parameter, first-step gradients; rtol 1e-5, atol 4e-5), and each device
sends, per step, what its plan says."""
from __future__ import annotations

import pytest

try:
    from .test_run_mm_modes import MODELS, run_checked
    from .test_run_modes import assert_sends_what_the_plan_says
except ImportError:  # run as a top-level module
    from test_run_mm_modes import MODELS, run_checked
    from test_run_modes import assert_sends_what_the_plan_says

pytestmark = pytest.mark.distributed

RUNS = {  # spec under tests/models: what its program must run
    "tinygpt_tensor_1f1b": "crossing.backward_own(loss, crossed)",
    "tinygpt_split_interleaved": "crossing.forward_stage(stage, mb, model, xs[mb].to(device))",
}


@pytest.mark.parametrize("name", RUNS)
def test_split_stages_of_a_module_model_under_schedules_match_one_device(name, tmp_path):
    spec = MODELS / f"{name}.yaml"
    metrics = run_checked(spec, tmp_path / "run")
    program = (tmp_path / "run" / "program.py").read_text()
    assert "groups=GROUPS" in program and "order = " in program and RUNS[name] in program
    assert_sends_what_the_plan_says(name, spec, metrics)
