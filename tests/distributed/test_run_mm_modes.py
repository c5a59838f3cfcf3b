"""Split modes on module models beside other segments, in lockstep (codegen/runtime/lockstep.py):
the shipped TinyGPT and Hugging Face Llama (tiny config, random init) with their transformer
blocks tensor parallel over two ranks between one-device segments, and a torchvision-layout
ResNet-18 whose classifier is split by channels as the last segment (the stem's channel split,
now in lockstep too, runs in test_hf_models.py) or whose stem is split spatially (bands of H with
halos, the bands gathered whole on each rank); tensor and channel stages under placer's GPipe
loops. What enters a group is sent to each of its
ranks, what leaves it is sent from its first, and its gradient to each. And the tensor block
plan under precision bf16, and the ResNet's channel stem under bf16, whose output crosses in
bfloat16 (exact: float32's tolerance holds).
Each `placer run --check` matches the one-device reference (losses, every parameter, first-step
gradients; rtol 1e-5, atol 4e-5), and each device sends, per step, what its plan says."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.main import main

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

pytestmark = pytest.mark.distributed

MODELS = Path(__file__).resolve().parents[1] / "models"
RUNS = {  # spec under tests/models: what it shows
    "tinygpt_tensor_sandwich": "TinyGPT: embed on cpu, blocks tensor over cpu:1, cpu:2, the head back on cpu",
    "hf_llama_tensor_beside": "Llama: embeddings and rotary on cpu, decoder layers tensor over 2, head on cpu:3",
    "resnet_channel_last": "ResNet-18: fc split by channels over 2 as the last segment, after the model's flatten",
    "resnet_spatial_stem": "ResNet-18: the stem split along H over 2 (halos, SyncBatchNorm), the rest on cpu:2",
    "tinygpt_tensor_gpipe": "TinyGPT under GPipe (2 micro-batches): a tensor stage between one-device stages",
    "tinygpt_channel_head_gpipe": "TinyGPT under GPipe: the LM head split by channels over 2 as the last stage",
}


@pytest.mark.parametrize("name", RUNS)
def test_module_model_split_segment_beside_others_matches_one_device(name, tmp_path):
    spec = MODELS / f"{name}.yaml"
    program, _, metrics, _ = h.checked_run(spec, tmp_path / "run")
    assert "import SplitPoint, pipeline" not in program and "groups=GROUPS" in program
    h.assert_every_gradient_compared(tmp_path / "run")  # the split ones gathered whole
    h.assert_sends_what_the_plan_says(name, spec, metrics)


@pytest.mark.parametrize("name", ["tinygpt_tensor", "hf_llama_tensor"])
def test_tensor_blocks_under_bf16_match_the_bf16_reference(name, tmp_path):
    """precision bf16 on a block plan (one tensor segment): autocast in every block; --check
    compares with a one-device bf16 reference at its stated tolerance, and each device sends
    what the plan says: the row halves' sums in bfloat16, the input gradients in float32."""
    spec, sets = MODELS / f"{name}.yaml", ["training.precision=bf16"]
    run_dir = tmp_path / "run"
    if "hf_tiny" in spec.read_text():
        pytest.importorskip("transformers")
    result = CliRunner().invoke(main, ["run", str(spec), "--check", "--run-dir", str(run_dir), "--set", sets[0]])
    assert result.exit_code == 0, result.output + (run_dir / "run.log").read_text()
    assert "check passed" in result.stdout and "rtol 0.02" in result.stdout
    assert "torch.autocast(device.type, dtype=torch.bfloat16)" in (run_dir / "program.py").read_text()
    h.assert_every_gradient_compared(run_dir)
    h.assert_sends_what_the_plan_says(name, spec, json.loads((run_dir / "metrics.json").read_text()), sets)


def test_a_tensor_group_beside_one_device_segments_runs_bf16_in_lockstep(tmp_path):
    """Lockstep runs precision bf16 (autocast around the whole forward; each leaf crosses in the
    dtype one device holds there: the blocks' residual sums float32) and a tensor group beside
    one-device segments: both at once match the one-device bf16 reference, each device sending
    what the plan says (the blocks' row sums in bfloat16)."""
    name, sets = "tinygpt_tensor_sandwich", ["training.precision=bf16"]
    spec, run_dir = MODELS / f"{name}.yaml", tmp_path / "run"
    result = CliRunner().invoke(main, ["run", str(spec), "--check", "--run-dir", str(run_dir), "--set", sets[0]])
    assert result.exit_code == 0, result.output + (run_dir / "run.log").read_text()
    assert "check passed" in result.stdout and "rtol 0.02" in result.stdout
    program = (run_dir / "program.py").read_text()
    assert "groups=GROUPS" in program and "torch.autocast(device.type, dtype=torch.bfloat16)" in program
    h.assert_sends_what_the_plan_says(name, spec, json.loads((run_dir / "metrics.json").read_text()), sets)


def test_a_resnets_stem_output_crosses_in_bfloat16_and_the_run_is_exact(tmp_path):
    """precision bf16, the ResNet-18 stem split by channels beside the rest: the stem's output is
    bfloat16 under autocast and crosses so (the plan counts 2 bytes an element), so layer1.0's
    skip add sums two bfloat16 tensors as on one device. Nothing else rounds otherwise (each
    rank's channels are whole, their BatchNorm statistics too): every parameter matches the
    one-device bf16 reference at float32's tolerance, not only bf16's."""
    name, sets = "resnet_stem_channel", ["training.precision=bf16"]
    spec = MODELS / f"{name}.yaml"
    program, _, metrics, output = h.checked_run(spec, tmp_path / "run", "--set", sets[0])
    assert "rtol 0.02" in output and "torch.autocast(device.type, dtype=torch.bfloat16)" in program
    (row,) = [line for line in program.splitlines() if line.strip().startswith('"maxpool": (')]  # LAYERS
    assert row.strip() == '"maxpool": (0, "tensor", [([4, 8, 8, 8], "bfloat16")]),'
    h.assert_sends_what_the_plan_says(name, spec, metrics, sets)
