"""`placer run --check` with the training options on: `clip_grad_norm` (with a max norm small
enough that it clips every step) and `lr_schedule`, in every kind of placement whose
parameters live in a different way (layer-wise segments, DDP replicas, ZeRO, FSDP shards,
tensor-parallel DTensors, channel slices, a torch pipeline schedule). The run and the
one-device reference agree on every loss and parameter, and on the global gradient norm of
every step: counting a replica twice or a shard once would change it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from placer.cli.main import main

try:
    from ._harness import assert_sends_what_the_plan_says
except ImportError:  # run as a top-level module
    from _harness import assert_sends_what_the_plan_says

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
CLIP = 0.01
OPTIONS = ["--set", f"training.clip_grad_norm={CLIP}",
           "--set", "training.lr_schedule={op: LinearLR, kwargs: {start_factor: 0.25, total_iters: 4}}"]
SGD = ["--set", "training.optimizer={op: SGD, lr: 0.5}"]  # Adam would hide a wrong clip factor

# (spec under specs/, how its parameters live)
PLACEMENTS = [
    ("mlp_layerwise_direct", "layer-wise: each parameter on one rank"),
    ("mlp_data_allreduce_no_overlap", "data: a replica on each rank, gradients all-reduced"),
    ("mlp_data_shard_optimizer", "ZeRO-1: DDP replicas, optimizer state sharded"),
    ("mlp_data_shard_full", "FSDP2: every parameter a Shard(0) DTensor"),
    ("mlp_tensor", "tensor: column / row Linear pairs (DTensor), a replicated bias, a one-device head"),
    ("cnn_channel", "channel: slices of every conv, whole layers after, a one-device head"),
    ("mlp_pipeline_1f1b", "pipeline: torch's 1F1B schedule over two stages"),
]


def norms(run: Path) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in (run / "progress.jsonl").read_text().splitlines()
            if "grad_norm" in line]


def run_check(spec: Path, run_dir: Path, *extra: str):
    result = CliRunner().invoke(main, ["run", str(spec), "--check", "--steps", str(STEPS), "--run-dir", str(run_dir),
                                       *extra])
    assert result.exit_code == 0, result.output + ((run_dir / "run.log").read_text()
                                                   if (run_dir / "run.log").exists() else "")
    assert json.loads((run_dir / "check.json").read_text())["ok"]
    return result


@pytest.mark.parametrize("spec,what", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_clipping_and_schedule_match_one_device(spec, what, tmp_path):
    run = tmp_path / "run"
    run_check(ROOT / "specs" / f"{spec}.yaml", run, *OPTIONS, *SGD)
    got, want = norms(run), norms(run / "reference")
    assert len(got) == len(want) == STEPS
    assert all(n > 10 * CLIP for n in want), want  # the clip bites at every step
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)


@pytest.mark.parametrize("how", [(), ("--set", "pipeline={microbatches: 2, schedule: 1f1b}")],
                         ids=["layerwise", "1f1b"])
def test_clipping_counts_a_tied_parameter_once(how, tmp_path):
    """GPT-2's tied wte / lm_head, a copy in each of two segments: it counts once in the norm."""
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    run_check(ROOT / "tests/cases/valid/hf_gpt2_tied/spec.yaml", run, *OPTIONS, *how)
    torch.testing.assert_close(torch.tensor(norms(run)), torch.tensor(norms(run / "reference")), rtol=1e-5, atol=0)


def test_the_plan_sends_what_the_run_sends_with_clipping(tmp_path):
    """The norm's all-reduce (4 bytes from every device) is in the plan, and the run sends it."""
    spec = tmp_path / "spec.yaml"
    text = (ROOT / "specs" / "mlp_layerwise_direct.yaml").read_text()
    spec.write_text(text.replace("training:\n", f"training:\n  clip_grad_norm: {CLIP}\n", 1))
    run = tmp_path / "run"
    run_check(spec, run)
    assert_sends_what_the_plan_says("clip", spec, json.loads((run / "metrics.json").read_text()))


def test_resume_restores_the_schedule(tmp_path):
    """A run resumed from its step-2 checkpoint ends bit for bit as the uninterrupted run: the
    checkpoint holds each scheduler's state (LinearLR's factor depends on its step count)."""
    try:
        from .test_resume import assert_same_run, interrupted_copy, placer_run
    except ImportError:  # run as a top-level module
        from test_resume import assert_same_run, interrupted_copy, placer_run

    spec, args = "specs/mlp_layerwise_direct.yaml", ["--steps", "5", "--set", "training.checkpoint.every=2", *OPTIONS]
    whole = tmp_path / "whole"
    r = placer_run(spec, *args, "--run-dir", str(whole))
    assert r.returncode == 0, r.stderr
    run = interrupted_copy(whole, tmp_path / "run", keep_upto=2)
    r = placer_run(spec, *args, "--resume", str(run))
    assert r.returncode == 0, r.stderr
    assert "resumed from the checkpoint at step 2 of 5" in r.stdout
    assert_same_run(whole, run)
    saved = torch.load(whole / "ckpt" / "step_2" / "rank0.pt", weights_only=True)
    assert [s["last_epoch"] for s in saved["schedulers"]] == [2]


# (spec under specs/, how its gradients are summed over a group)
ACCUMULATING = [
    ("mlp_group_transitions", "DDP: no_sync in all micro-steps but the last"),
    ("mlp_data_shard_full", "FSDP2: gradient sync off but in the last; parameters gathered every micro-step"),
    ("mlp_data_sync_batchnorm", "all-reduce after the micro-steps; BatchNorm statistics in every micro-step"),
    ("mlp_tensor", "tensor pairs: activations all-reduced in every micro-step"),
]


@pytest.mark.parametrize("spec,what", ACCUMULATING, ids=[a[0] for a in ACCUMULATING])
def test_accumulation_matches_one_device_and_sends_what_the_plan_says(spec, what, tmp_path):
    """accumulate: 2 against a reference that takes the same micro-steps; gradients are summed
    over the group once per step, so the run sends exactly the plan's bytes (a sync in every
    micro-step would send more)."""
    path, run = tmp_path / "spec.yaml", tmp_path / "run"
    path.write_text((ROOT / "specs" / f"{spec}.yaml").read_text().replace("training:\n", "training:\n  accumulate: 2\n", 1)
                    .replace("models/", str(ROOT / "specs" / "models") + "/"))
    run_check(path, run)
    assert_sends_what_the_plan_says(spec, path, json.loads((run / "metrics.json").read_text()))


@pytest.mark.parametrize("spec,sets", [
    ("mlp_group_transitions", ["placement.1.recompute=true", "placement.2.recompute=true"]),  # DDP, one device
    ("mlp_pipeline_1f1b", ["placement.0.recompute=true"]),  # a stage under torch's 1F1B schedule
    ("mlp_tensor", ["placement.0.recompute=true"]),  # the pair all-reduces run again in backward
    ("cnn_channel", ["placement.0.recompute=true"]),  # the channel all-gathers too
    ("cnn_spatial", ["placement.0.recompute=true"]),  # and the halo exchanges
], ids=["ddp_and_one_device", "1f1b_stage", "tensor", "channel", "spatial"])
def test_recomputed_segments_match_one_device(spec, sets, tmp_path):
    run = tmp_path / "run"
    run_check(ROOT / "specs" / f"{spec}.yaml", run, *[a for s in sets for a in ("--set", s)])
    program = (run / "program.py").read_text()
    calls, wrapped = program.count("torch.utils.checkpoint.checkpoint("), program.count("= Recomputed(seg")
    assert (wrapped, calls) == ((len(sets), 1) if "pipeline" in spec else (0, len(sets)))
    assert_sends_what_the_plan_says(spec, ROOT / "specs" / f"{spec}.yaml", json.loads((run / "metrics.json").read_text()),
                                    sets)


ONE_DEVICE_MIDDLE = ["placement.1.parallel=none", "placement.1.devices=[cuda:2]"]


@pytest.mark.parametrize("spec, sets", [
    ("mlp_layerwise_direct", []), ("mlp_group_transitions", []), ("mlp_data_shard_full", []),
    ("mlp_pipeline_1f1b", []),  # torch's schedule: the stage modules and the loss wrapped in autocast
    ("mlp_pipeline_gpipe_mixed", ONE_DEVICE_MIDDLE),  # stages of data degrees 2, 1, 1: placer's micro-batch loops
    ("mlp_tensor", []), ("cnn_channel", []), ("cnn_spatial", []),  # collectives in bfloat16 where autocast makes it
    ("cnn_mixed_modes", []),
], ids=["layerwise", "group_transitions", "fsdp", "1f1b", "gpipe_loops", "tensor", "channel", "spatial", "mixed"])
def test_bf16_matches_a_bf16_reference_under_the_tolerance_it_states(spec, sets, tmp_path):
    """precision bf16: autocast in every segment's forward and the loss, on one device too; the
    check states its looser tolerance. The same reference in float32 differs by more than the
    float32 tolerance, so autocast did take effect."""
    import subprocess
    import sys

    run = tmp_path / "run"
    sets = [*sets, "training.precision=bf16"]
    result = run_check(ROOT / "specs" / f"{spec}.yaml", run, *[a for s in sets for a in ("--set", s)])
    assert "check: the run against the one-device reference (rtol 0.02, atol 0.002)" in result.output
    assert_sends_what_the_plan_says(spec, ROOT / "specs" / f"{spec}.yaml", json.loads((run / "metrics.json").read_text()),
                                    sets)
    program = (run / "program.py").read_text()
    assert program.count('PRECISION = "bf16"') == 1
    fp32 = run / "program_fp32.py"
    fp32.write_text(program.replace('PRECISION = "bf16"', 'PRECISION = "fp32"'))
    subprocess.run([sys.executable, str(fp32), "--reference", "--simulate", "--steps", str(STEPS), "--out",
                    str(tmp_path / "fp32")], check=True, capture_output=True, timeout=300)
    bf16_losses = json.loads((run / "reference" / "metrics.json").read_text())["losses"]
    fp32_losses = json.loads((tmp_path / "fp32" / "metrics.json").read_text())["losses"]
    bf16_params = torch.load(run / "reference" / "final_params.pt", weights_only=True)
    fp32_params = torch.load(tmp_path / "fp32" / "final_params.pt", weights_only=True)
    assert any(abs(a - b) > 4e-5 + 1e-5 * abs(b) for a, b in zip(bf16_losses, fp32_losses)) or any(
        not torch.allclose(bf16_params[n], fp32_params[n], rtol=1e-5, atol=4e-5) for n in fp32_params)  # float32's
