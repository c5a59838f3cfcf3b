"""`placer run --check` for every mode the generator writes: the generated program runs on
1 to 4 gloo CPU workers (specs naming GPUs are simulated on this machine), and every step's
loss and every final parameter equal the one-device reference (rtol 1e-5, atol 4e-5).

`pytest -s` prints the measured differences per mode at the end of the module."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from placer import units
from placer.cli.main import main

try:
    from ._harness import assert_every_gradient_compared, assert_sends_what_the_plan_says
except ImportError:  # run as a top-level module
    from _harness import assert_every_gradient_compared, assert_sends_what_the_plan_says

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
RTOL, ATOL = 1e-5, 4e-5

# (spec under specs/, what it shows, workers)
MODES = [
    ("mlp_single_device", "one device", 1),
    ("mlp_layerwise_direct", "layer-wise, direct copy", 2),
    ("mlp_via_host", "layer-wise, every copy via host", 3),
    ("mlp_via_host_segment", "per-segment copy route", 3),
    ("mlp_cpu_gpu_mixed", "CPU and GPU segments in one spec", 2),
    ("mlp_data_allreduce", "data, all-reduce by DDP, 0.01 MB buckets, overlap", 4),
    ("mlp_data_allreduce_no_overlap", "data, bucketed all-reduce after backward", 2),
    ("mlp_data_param_server", "data, parameter server in the group", 3),
    ("mlp_data_param_server_cpu", "data, parameter server outside (Adam on the host)", 3),
    ("mlp_data_broadcast", "data, broadcast sync", 2),
    ("mlp_group_transitions", "split and merge between groups", 3),
    ("mlp_prefetch", "prefetch 4 batches in a thread", 2),
    ("mlp_user_data", "user data module", 2),
    ("tinygpt", "module model in lockstep, no torch.export (its root pos with blocks.0)", 3),
    ("cnn_channel", "channel-split convs (BatchNorm, pool), then a one-device classifier", 2),
    ("mlp_tensor", "tensor parallel Linear pairs (DTensor), then a one-device head", 2),
    ("cnn_spatial", "spatial halo split of a conv stack with a pool, then a one-device head", 2),
    ("mlp_data_shard_optimizer", "data, optimizer state sharded (ZeroRedundancyOptimizer)", 2),
    ("mlp_data_shard_full", "data, fully sharded (FSDP2 fully_shard)", 2),
    ("mlp_data_sync_batchnorm", "data with BatchNorm under sync_batchnorm (CPU version)", 2),
    ("cnn_spatial_dense", "spatial to the end (dilated conv); the bands meet on one device for the loss", 2),
    ("cnn_mixed_modes", "rows, bands, channel, one device, tensor, rows: every layout change", 4),
    ("mlp_pipeline_gpipe", "pipeline, GPipe, 4 stages", 4),
    ("mlp_pipeline_1f1b", "pipeline, 1F1B, 2 stages", 2),
    ("mlp_pipeline_data_stages", "pipeline, 1F1B, 2 stages each data parallel over 2", 4),
    ("mlp_pipeline_gpipe_mixed", "pipeline, GPipe as micro-batch loops: data (2), tensor (2), one device", 5),
    ("mlp_pipeline_tensor_stages", "pipeline x channel/tensor: interleaved 1F1B, every stage split over 2", 4),
    ("mlp_pipeline_interleaved_1f1b", "pipeline, interleaved 1F1B, 2 stages per device", 2),
    ("mlp_pipeline_looped_bfs", "pipeline, looped BFS, 2 stages per device", 2),
    ("mlp_pipeline_interleaved_zero_bubble", "pipeline, interleaved zero bubble", 2),
    ("mlp_pipeline_zbv_zero_bubble", "pipeline, ZBV zero bubble (V layout)", 2),
    ("mlp_pipeline_dualpipev", "pipeline, DualPipeV (V layout)", 2),
]
MEASURED: dict[str, tuple] = {}
# runs whose parameters are split (tensor, channel) or replicated in bands (spatial): run --check
# compares every first-step gradient, gathered whole or recorded once
SPLIT = {"cnn_channel", "mlp_tensor", "cnn_spatial", "cnn_spatial_dense", "cnn_mixed_modes", "mlp_pipeline_gpipe_mixed",
         "mlp_pipeline_tensor_stages", "channel_split", "tensor_parallel", "tensor_data_2d", "spatial_halo",
         "pipeline_tensor_stages"}


@pytest.fixture(scope="module", autouse=True)
def print_measured():
    yield
    if MEASURED:
        print(f"\n--check against the one-device reference, {STEPS} steps (max |diff|):")
        print(f"  {'spec':<32} {'workers':>7} {'loss':>10} {'params':>10}")
        for name, (workers, loss, param) in MEASURED.items():
            print(f"  {name:<32} {workers:>7} {loss:>10.2e} {param:>10.2e}")


def run_check(spec: str, run_dir: Path, *extra: str):
    path = ROOT / spec if "/" in spec else ROOT / "specs" / f"{spec}.yaml"
    result = CliRunner().invoke(main, ["run", str(path), "--check", "--steps",
                                       str(STEPS), "--run-dir", str(run_dir), *extra])
    return result


@pytest.mark.parametrize("spec,what,workers", MODES, ids=[m[0] for m in MODES])
def test_mode_matches_the_one_device_reference(spec, what, workers, tmp_path):
    run_dir = tmp_path / "run"
    result = run_check(spec, run_dir)
    assert result.exit_code == 0, result.output + (run_dir / "run.log").read_text()
    assert "check passed" in result.stdout
    check = json.loads((run_dir / "check.json").read_text())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert check["ok"] and len(check["steps"]) == STEPS and metrics["world_size"] == workers
    # the report's numbers, checked here independently of placer.launch.check
    run_p = torch.load(run_dir / "final_params.pt")
    ref_p = torch.load(run_dir / "reference" / "final_params.pt")
    assert set(run_p) == set(ref_p) and len(ref_p) >= 6
    for name, value in ref_p.items():
        torch.testing.assert_close(run_p[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(torch.tensor(metrics["losses"]), torch.tensor(
        json.loads((run_dir / "reference" / "metrics.json").read_text())["losses"]), rtol=RTOL, atol=ATOL)
    # what the run measured: every device of a placed run sends training traffic
    assert set(metrics["bytes_sent"]) == set(metrics["devices"])
    if workers > 1:
        assert all(metrics["bytes_sent"][d] > 0 for d in metrics["devices"]), metrics["bytes_sent"]
    if spec == "mlp_data_allreduce":  # DDP's buckets carry every gradient once per step
        grad_bytes = sum(v.numel() * 4 for v in ref_p.values())
        assert all(metrics["bytes_by_call"][d]["all_reduce"] == STEPS * grad_bytes for d in metrics["devices"])
    assert_sends_what_the_plan_says(spec, ROOT / "specs" / f"{spec}.yaml", metrics)
    if spec in SPLIT:
        assert_every_gradient_compared(run_dir)
    assert_plottable_and_measured(spec, run_dir, metrics, result.stdout)
    MEASURED[spec] = (workers, check["max_loss_abs_diff"], check["max_param_abs_diff"])


def assert_plottable_and_measured(spec: str, run_dir: Path, metrics: dict, stdout: str) -> None:
    """metrics.csv has a row per step with the optimizer's learning rate, the step's time and
    memory; every device measured its peak memory, printed beside the plan's estimate; DDP's
    overlapped all-reduce shows as comm time."""
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert list(rows[0]) == ["step", "loss", "lr", "grad_norm", "samples_per_s", "step_s", "memory_bytes",
                             "elapsed_s"]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert [float(r["loss"]) for r in rows] == pytest.approx(metrics["losses"])
    lr = yaml.safe_load((ROOT / "specs" / f"{spec}.yaml").read_text())["training"]["optimizer"].get("lr")
    assert all(float(r["lr"]) == lr for r in rows if lr is not None)
    assert all(float(r["step_s"]) > 0 and float(r["samples_per_s"]) > 0 and int(r["memory_bytes"]) > 0 for r in rows)
    assert set(metrics["peak_memory"]) == set(metrics["devices"])
    # the RSS in metrics.json; the CPU allocator's tensor peak printed beside the plan, with their ratio
    assert all(m["peak_bytes"] > 0 and m["measure"] == "peak_rss_above_import" and m["tensor_peak_bytes"] > 0
               for m in metrics["peak_memory"].values())
    planned = json.loads(CliRunner().invoke(main, ["plan", "-q", str(ROOT / "specs" / f"{spec}.yaml"), "--format",
                                                   "json", "--deep"]).stdout)
    for d in planned["devices"]:
        line = next(line for line in stdout.splitlines() if line.startswith(f"{d['device']} "))
        peak = metrics["peak_memory"][d["device"]]["tensor_peak_bytes"]
        assert line.endswith(f"{units.size(peak)} {units.size(d['total_bytes']):>10} "
                             f"{peak / d['total_bytes']:>6.2f}"), (line, d["total_bytes"])
    if spec == "mlp_data_allreduce":  # DDP's all-reduce, overlapped with backward, is measured as comm
        assert all(metrics["time_s"][d]["overlapped"] > 0 and metrics["time_s"][d]["comm"] > 0
                   for d in metrics["devices"]), metrics["time_s"]


def test_a_quiet_run_prints_its_result_only(tmp_path):
    result = CliRunner().invoke(main, ["run", "-q", str(ROOT / "specs" / "mlp_single_device.yaml"), "--steps", "2",
                                       "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    (line,) = result.stdout.splitlines()
    assert line.startswith("trained 2 steps: ") and result.stderr == ""
    assert "step 2/2" in (tmp_path / "run" / "run.log").read_text()  # run.log keeps everything


def test_tensor_pairs_are_the_plans(tmp_path):
    """Pairs across layers DTensor has no rule for (Tanhshrink, Hardshrink, LogSigmoid) and
    Dropout: the program splits the pairs the plan all-reduces, so it sends what the plan says."""
    spec = ROOT / "tests/cases/valid/tensor_between_layers/spec.yaml"
    run_dir = tmp_path / "run"
    result = run_check(str(spec.relative_to(ROOT)), run_dir)
    assert result.exit_code == 0, result.output + (run_dir / "run.log").read_text()
    program = "".join((run_dir / "program.py").read_text().split())
    assert 'tensor_parallelize(stage,g0,[("0","2"),("3","7")]' in program
    metrics = json.loads((run_dir / "metrics.json").read_text())
    planned = json.loads(CliRunner().invoke(main, ["plan", str(spec), "--format", "json"]).stdout)
    for d in planned["devices"]:
        assert metrics["bytes_sent"][d["device"]] / STEPS == d["payload_bytes"], d


def by_name(dcp_dir: Path, tmp_path: Path) -> dict:
    """A checkpoint's step_N/dcp as {name: whole tensor}, read in this one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dcp_dir, tmp_path / "by_name.pt")
    return torch.load(tmp_path / "by_name.pt", weights_only=True)


def test_checkpoints_keep_the_newest(tmp_path):
    """training.checkpoint {every: 2, keep: 2}: after 6 steps, step_2 is gone, step_6 holds every rank."""
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(main, ["run", str(ROOT / "specs" / "mlp_checkpoint.yaml"), "--run-dir",
                                       str(run_dir), "--steps", "6"])
    assert result.exit_code == 0, result.output
    kept = sorted(p.name for p in (run_dir / "ckpt").iterdir())
    assert kept == ["step_4", "step_6"]
    # each step directory complete (its marker written last), every file renamed into place
    assert sorted(p.name for p in (run_dir / "ckpt" / "step_6").iterdir()) == ["COMPLETE", "dcp", "rank0.pt", "rank1.pt"]
    assert not list(run_dir.rglob("*.tmp-*"))
    state = torch.load(run_dir / "ckpt" / "step_6" / "rank1.pt", weights_only=True)  # plain values only
    assert state["step"] == 6 and len(state["losses"]) == 6 and state["modules"] == []
    assert state["optimizers"][0]["kind"] == "SGD" and state["optimizers"][0]["param_groups"][0]["momentum"] == 0.9
    # the tensors by the model's names (layer-wise: rank 1 wrote fc3..head), the final values
    final, saved = torch.load(run_dir / "final_params.pt"), by_name(run_dir / "ckpt" / "step_6" / "dcp", tmp_path)
    for name in final:
        torch.testing.assert_close(saved[f"model.{name}"], final[name], rtol=0, atol=0)
    assert saved["optim.fc3.weight.momentum_buffer"].shape == final["fc3.weight"].shape  # SGD momentum buffers


def test_spatial_bands_of_w_then_h(tmp_path):
    """dim -1 (W of NCHW, counted from the end), then dim 2 (H) on the same devices: the bands
    change dim through one device, and a strided conv and an AvgPool follow."""
    run_dir = tmp_path / "run"
    result = run_check("tests/cases/valid/spatial_dim_w_int/spec.yaml", run_dir)
    assert result.exit_code == 0, result.output + (run_dir / "run.log").read_text()
    check = json.loads((run_dir / "check.json").read_text())
    assert check["ok"] and check["max_param_abs_diff"] <= ATOL
    assert "SpatialSplit(stage, g0, [0, 1], dim=3, size=16)" in (run_dir / "program.py").read_text()


def test_checkpoints_of_sharded_segments_hold_each_ranks_piece(tmp_path):
    """A tensor-parallel segment's checkpoint holds each rank's slice of a split weight (DCP's
    chunks, by the model's name): put together, the final whole weight. A ZeRO optimizer's state
    is each rank's own shard in its rank file, plain tensors (tests/distributed/test_resume.py
    resumes from both, bit for bit)."""
    import torch.distributed.checkpoint as dcp

    for name in ("mlp_tensor", "mlp_data_shard_optimizer"):
        spec = tmp_path / f"{name}.yaml"
        spec.write_text((ROOT / "specs" / f"{name}.yaml").read_text().replace(
            "  seed: 0", "  seed: 0\n  checkpoint: {dir: ckpt, every: 2, keep: 1}"))
        run_dir = tmp_path / name
        result = CliRunner().invoke(main, ["run", str(spec), "--run-dir", str(run_dir), "--steps", "2"])
        assert result.exit_code == 0, result.output
        states = [torch.load(run_dir / "ckpt" / "step_2" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
        final = torch.load(run_dir / "final_params.pt")
        assert all(s["step"] == 2 and s["optimizers"][0]["param_groups"] for s in states)
        if name == "mlp_tensor":  # up1 is split by output features: one chunk per rank
            folder = run_dir / "ckpt" / "step_2" / "dcp"
            chunks = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata["model.up1.weight"].chunks
            assert [list(c.offsets) for c in chunks] == [[0, 0], [final["up1.weight"].shape[0] // 2, 0]]
            torch.testing.assert_close(by_name(folder, tmp_path)["model.up1.weight"], final["up1.weight"], rtol=0, atol=0)
        else:
            assert all(s["optimizers"][0]["state"] for s in states)  # each rank's shard of the state


EXAMPLES = sorted(p.parent.name for p in (ROOT / "examples").glob("*/spec.yaml"))


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_example_runs_and_matches_one_device(example, tmp_path):
    """Each examples/ walk-through does what its README promises: `placer run spec.yaml --check`."""
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(main, ["run", str(ROOT / "examples" / example / "spec.yaml"), "--check", "--steps", "2",
                                       "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output + (run_dir / "run.log").read_text()
    check = json.loads((run_dir / "check.json").read_text())
    assert check["ok"] and len(check["steps"]) == 2
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert_sends_what_the_plan_says(example, ROOT / "examples" / example / "spec.yaml", metrics)
    if example in SPLIT:
        assert_every_gradient_compared(run_dir)
    if example == "training_options":
        assert_every_option_takes_effect(run_dir)


def assert_every_option_takes_effect(run_dir: Path) -> None:
    """examples/training_options: each option is on in the program and does something. The clip
    bites at every step (the one-device norm above the spec's 0.2, and the run's the same); the
    cosine schedule lowers the learning rate after the first step; bf16, two micro-steps and the
    two recomputed segments are in the program, and the check compared at bf16's tolerance."""
    spec = yaml.safe_load((ROOT / "examples" / "training_options" / "spec.yaml").read_text())["training"]
    rows = [json.loads(line) for line in (run_dir / "progress.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (run_dir / "reference" / "progress.jsonl").read_text().splitlines()]
    got, want = ([r["grad_norm"] for r in rr if "grad_norm" in r] for rr in (rows, ref))
    assert len(got) == len(want) == 2 and all(n > 1.2 * spec["clip_grad_norm"] for n in want), want
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=0)
    lrs = [float(r["lr"]) for r in csv.DictReader((run_dir / "metrics.csv").open())]
    assert lrs[0] == spec["optimizer"]["lr"] and lrs[1] < lrs[0], lrs
    program = (run_dir / "program.py").read_text()
    assert program.count("torch.autocast(device.type, dtype=torch.bfloat16)") >= 4
    assert f"for micro in range({spec['accumulate']}):" in program
    assert "".join(program.split()).count("torch.utils.checkpoint.checkpoint(seg") == 2  # (formatted over lines)
    assert json.loads((run_dir / "check.json").read_text())["rtol"] == 2e-2


def test_a_spatial_last_stage_gathers_every_micro_batch_as_the_plan_says(tmp_path):
    """GPipe as placer's micro-batch loops with a spatially split last stage: each micro-batch's
    bands meet on the stage's first device for the loss; the plan has those gathers (one per
    micro-batch, and the gradients back), so the run sends exactly what the plan says."""
    spec = ROOT / "tests/cases/valid/pipeline_spatial_last/spec.yaml"
    run_dir = tmp_path / "run"
    result = run_check(str(spec.relative_to(ROOT)), run_dir)
    assert result.exit_code == 0, result.output + (run_dir / "run.log").read_text()
    assert json.loads((run_dir / "check.json").read_text())["ok"]
    assert_sends_what_the_plan_says("pipeline_spatial_last", spec,
                                    json.loads((run_dir / "metrics.json").read_text()))
