"""Split modes on module models in lockstep in pipelines under every schedule, and under
precision bf16 (codegen/loops.py, runtime/lockstep.py): the shipped TinyGPT with a tensor stage
under 1F1B (both ranks of the group walk the same actions, so their all-reduces match), and under
interleaved 1F1B with a tensor stage and a channel head on the same two ranks (each rank holds two
stages: each micro-batch's forward runs in a thread that waits for the schedule's action of its
next stage); a ResNet-style stem (stem_net.py) split spatially as a GPipe stage, and with a
channel classifier on the same ranks under a V schedule with bf16; the stem split spatially and
the classifier by channels, each over two data replicas (2-D groups), also both under `shard:
full` (FSDP2 over each slice position), and the 2-D stem as the first stage of 1F1B; a spatial
segment as a module model's only one. Each `placer run --check` matches the one-device reference
(losses, every parameter, first-step gradients; rtol 1e-5, atol 4e-5, bf16's stated tolerance
under bf16), and each device sends, per step, what its plan says."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from placer.cli.main import main

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

pytestmark = pytest.mark.distributed

MODELS = h.ROOT / "tests" / "models"

RUNS = {  # spec under tests/models: what its program must run
    "tinygpt_tensor_1f1b": ("order = ", "crossing.backward_own(loss, crossed)"),
    "tinygpt_split_interleaved": ("order = ", "crossing.forward_stage(stage, mb, model, xs[mb].to(device))"),
    "stem_spatial_gpipe": ("GPipe in lockstep", "SpatialWhole(seg0)"),
    # 2-D chain groups: each rank takes its replica's rows, the replicas' outputs gathered by rows
    "stem_split_data": ("ReplicaRows(SpatialWhole(seg0), dp0,", "all_reduce_slices(seg2, dp2)"),
    # a 2-D group as a 1F1B stage: each micro-batch's rows cut over the replicas
    "stem_split_data_1f1b": ("ReplicaRows(SpatialWhole(seg0), dp0,", "crossing.backward_own(loss, crossed)"),
    # ... under shard: full: FSDP2 shards each split over its position, the model's forward calls it
    "stem_split_data_fsdp": ("seg0 = fully_shard_segment(seg0, dp0, device.type)",
                             "seg2 = fully_shard_segment(seg2, dp2, device.type)"),
}


@pytest.mark.parametrize("name", RUNS)
def test_split_stages_of_a_module_model_in_pipelines_match_one_device(name, tmp_path):
    spec = MODELS / f"{name}.yaml"
    program, _, metrics, _ = h.checked_run(spec, tmp_path / "run", min_params=7)
    assert "groups=GROUPS" in program and all(line in program for line in RUNS[name])
    h.assert_sends_what_the_plan_says(name, spec, metrics)


def test_spatial_and_channel_groups_under_a_v_schedule_run_bf16(tmp_path):
    """A spatial stem and a channel classifier on the same two ranks under zero-bubble V, precision
    bf16: autocast in each micro-batch's forward thread, bfloat16 bands and logits halves gathered
    as bfloat16; --check against the one-device bf16 reference at its stated tolerance, and each
    device sends what the plan says."""
    spec, run_dir = MODELS / "stem_split_v.yaml", tmp_path / "run"
    result = CliRunner().invoke(main, ["run", str(spec), "--check", "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output + (run_dir / "run.log").read_text()
    assert "check passed" in result.stdout and "rtol 0.02" in result.stdout
    program = (run_dir / "program.py").read_text()
    assert "crossing.forward_stage(stage, mb, forward, xs[mb].to(device))" in program
    assert "SpatialWhole(seg0)" in program and "ChannelSplit" in program
    h.assert_sends_what_the_plan_says("stem_split_v", spec, json.loads((run_dir / "metrics.json").read_text()))


def test_a_spatial_segment_alone_runs_the_models_glue_around_it(tmp_path):
    """glue_net.py's layers all in one spatial segment: both ranks run the model's own forward, the
    split inside it, so the glue after the last layer (a mean over H and W) runs on the gathered
    output; --check matches the one-device reference and each device sends what the plan says."""
    spec = MODELS / "glue_spatial_alone.yaml"
    program, _, metrics, _ = h.checked_run(spec, tmp_path / "run", min_params=4)
    assert "run_as_chain(model, [\"conv1\", \"relu1\", \"conv2\", \"relu2\"], SpatialWhole(seg0))" in program
    h.assert_sends_what_the_plan_says("glue_spatial_alone", spec, metrics)
