"""Restarts and `placer run --resume`: a run killed or interrupted continues from its newest
complete checkpoint and ends bit for bit where a run never interrupted ends (every loss,
every final parameter, torch.equal). Short runs of the shipped specs and of a tiny 2-rank
spec; every wait is bounded and only processes a test started are signalled."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h
import torch

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
CKPT = ["--set", "training.checkpoint.every=2"]


def placer_run(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = h.placer_run_popen(*args, cwd=cwd or ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_same_run(a: Path, b: Path) -> None:
    """Every step's loss and every final parameter equal, bit for bit."""
    la = json.loads((a / "metrics.json").read_text())["losses"]
    lb = json.loads((b / "metrics.json").read_text())["losses"]
    assert la == lb
    pa, pb = torch.load(a / "final_params.pt"), torch.load(b / "final_params.pt")
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def interrupted_copy(run: Path, to: Path, keep_upto: int) -> Path:
    """`run` as a run stopped after step `keep_upto`: later checkpoints and the results gone."""
    shutil.copytree(run, to)
    for step_dir in (to / "ckpt").iterdir():
        if int(step_dir.name.split("_")[1]) > keep_upto:
            shutil.rmtree(step_dir)
    for name in ("metrics.json", "final_params.pt"):
        (to / name).unlink()
    return to


# ---------------------------------------------------------------------------- --resume

MODES = {  # the shipped spec of each mode, 6 steps, a checkpoint every 2 (FSDP2's: the restart test's;
    # layer-wise copies: gpipe_loops'; a split mode's slices: tensor's and spatial's)
    "data_overlap": "specs/mlp_data_allreduce.yaml",  # 4 ranks: DDP's bucket layout changes the sums' order
    "zero": "specs/mlp_data_shard_optimizer.yaml",
    "1f1b": "specs/mlp_pipeline_1f1b.yaml",
    "param_server": "specs/mlp_data_param_server_cpu.yaml",
    "gpipe_loops": "specs/mlp_pipeline_gpipe_mixed.yaml",
    "tensor": "specs/mlp_tensor.yaml",
    "spatial": "specs/cnn_spatial.yaml",
    "lockstep": "specs/tinygpt.yaml",
    "zero_slices": "tests/models/tinygpt_tensor_data.yaml",
    "slice_server": "specs/cnn_channel_data.yaml",
    "spatial_server": "specs/cnn_spatial_data.yaml",
}
SETS = {  # TinyGPT's blocks tensor x data with ZeRO-1 over the replicas (runtime ZeroSlices): each
    # device's momentum for its 1/2 of its slices; its uninterrupted run is --check'ed too
    "zero_slices": ["--set", "placement.0.parallel.shard=optimizer",
                    "--set", "training.optimizer={op: SGD, lr: 0.1, kwargs: {momentum: 0.9}}"],
    # channel x data with a parameter server in the group (runtime SliceServer): the server's copies
    # of every position's slices and their momentum come back from the checkpoint
    "slice_server": ["--set", "placement.0.parallel.sync=parameter_server", "--set", "placement.0.parallel.server=cuda:1",
                     "--set", "training.optimizer={op: SGD, lr: 0.1, kwargs: {momentum: 0.9}}"],
    # spatial x data on a server outside the group (a fifth device): its whole layers and their
    # momentum come back from its own checkpoint (SGD with momentum: the spec's)
    "spatial_server": ["--set", "devices=[cuda:0, cuda:1, cuda:2, cuda:3, cuda:4]", "--set", "placement.2.device=cuda:4",
                       "--set", "placement.1.parallel.sync=parameter_server", "--set",
                       "placement.1.parallel.server=cuda:4"],
}
CHECKED = {"zero_slices", "slice_server"}


@pytest.fixture(scope="module")
def whole_runs(tmp_path_factory):
    """One uninterrupted run per mode, made when first asked for."""
    made: dict[str, Path] = {}

    def get(mode: str) -> Path:
        if mode not in made:
            run = tmp_path_factory.mktemp(mode) / "whole"
            check = ["--check"] if mode in CHECKED else []
            r = placer_run(MODES[mode], "--steps", "6", *CKPT, *SETS.get(mode, ()), *check, "--run-dir", str(run))
            assert r.returncode == 0, r.stderr
            assert not check or "check passed" in r.stdout
            made[mode] = run
        return made[mode]
    return get


@pytest.mark.parametrize("mode", list(MODES))
def test_resume_is_bit_identical(mode, whole_runs, tmp_path):
    whole = whole_runs(mode)
    assert sorted(p.name for p in (whole / "ckpt").iterdir()) == ["step_2", "step_4", "step_6"]
    run = interrupted_copy(whole, tmp_path / "run", keep_upto=2 if mode == "data_overlap" else 4)
    r = placer_run(MODES[mode], "--steps", "6", *CKPT, *SETS.get(mode, ()), "--resume", str(run))
    assert r.returncode == 0, r.stderr
    assert mode != "zero_slices" or "ZeroSlices(seg0.parameters(), dp0, torch.optim.SGD" in (run / "program.py").read_text()
    first = 2 if mode == "data_overlap" else 4
    assert f"resumed from the checkpoint at step {first} of 6" in r.stdout
    assert f"trained steps {first + 1}..6 of 6" in r.stdout
    assert_same_run(whole, run)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["resumed_from"] == first and metrics["steps_trained"] == 6 - first
    log = (run / "run.log").read_text()
    assert log.count("run dir") == 2 and "resuming the run in" in log  # appended to, not replaced
    steps = [json.loads(line).get("step") for line in (run / "progress.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, None] + list(range(first + 1, 7))


def test_a_damaged_or_incomplete_checkpoint_is_passed_over(whole_runs, tmp_path):
    whole = whole_runs("zero")
    run = interrupted_copy(whole, tmp_path / "run", keep_upto=6)
    (run / "ckpt" / "step_6" / "COMPLETE").unlink()  # killed while saving step 6
    damaged = run / "ckpt" / "step_4" / "rank1.pt"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])  # a truncated file
    r = placer_run(MODES["zero"], "--steps", "6", *CKPT, "--resume", str(run))
    assert r.returncode == 0, r.stderr
    assert "resumed from the checkpoint at step 2 of 6" in r.stdout
    assert any("rank 1: the checkpoint at step 4 is not usable (rank1.pt is" in p.read_text()
               for p in (run / "logs").glob("*.log"))
    assert_same_run(whole, run)


@pytest.mark.parametrize("damage", ["bit", "block"])
def test_a_checkpoint_file_damaged_in_place_is_detected_and_the_one_before_used(damage, whole_runs, tmp_path):
    """Same size, still loadable: a low bit flipped, or 4 KiB inverted, in the middle of rank 1's
    file. Without its digest the run trained on from the damaged state (issue 32)."""
    whole = whole_runs("zero")
    run = interrupted_copy(whole, tmp_path / "run", keep_upto=4)
    damaged = run / "ckpt" / "step_4" / "rank1.pt"
    data = bytearray(damaged.read_bytes())
    middle = len(data) // 2
    if damage == "bit":
        data[middle] ^= 1
    else:
        data[middle - 2048:middle + 2048] = bytes(b ^ 0xFF for b in data[middle - 2048:middle + 2048])
    damaged.write_bytes(bytes(data))
    r = placer_run(MODES["zero"], "--steps", "6", *CKPT, "--resume", str(run))
    assert r.returncode == 0, r.stderr
    assert (f"the checkpoint at step 4 is not usable: {run / 'ckpt' / 'step_4'}/rank1.pt is damaged: its sha256 "
            "is not the one COMPLETE records; resuming from the checkpoint at step 2 instead") in r.stderr
    assert "resumed from the checkpoint at step 2 of 6" in r.stdout
    assert_same_run(whole, run)


def test_a_resume_that_changes_the_computation_is_refused_unless_asked(whole_runs, tmp_path):
    """The spec as trained (after --set) is what a resume is held to: another batch size is R033
    naming it, before any worker starts; --resume-anyway goes on with it, and RUN_DIR/spec.yaml
    then says so. Steps may change: the run continues where it was."""
    whole = whole_runs("zero")
    run = interrupted_copy(whole, tmp_path / "run", keep_upto=4)
    r = placer_run(MODES["zero"], *CKPT, "--set", "training.batch_size=32", "--resume", str(run))
    assert r.returncode == 1 and "error[R033]:" in r.stderr and "Traceback" not in r.stderr
    assert "in what changes the computation: training.batch_size: 16 -> 32" in r.stderr
    assert "batch_size: 16" in (run / "spec.yaml").read_text()

    r = placer_run(MODES["zero"], *CKPT, "--set", "training.steps=8", "--resume", str(run))  # 6 -> 8: free
    assert r.returncode == 0, r.stderr
    assert "resumed from the checkpoint at step 4 of 8" in r.stdout
    losses = json.loads((run / "metrics.json").read_text())["losses"]
    assert len(losses) == 8 and losses[:6] == json.loads((whole / "metrics.json").read_text())["losses"]

    again = interrupted_copy(whole, tmp_path / "again", keep_upto=4)
    r = placer_run(MODES["zero"], "--steps", "6", *CKPT, "--set", "training.batch_size=32", "--resume", str(again),
                   "--resume-anyway")
    assert r.returncode == 0, r.stderr
    assert "--resume-anyway: continuing with training.batch_size: 16 -> 32" in r.stderr
    assert "resumed from the checkpoint at step 4 of 6" in r.stdout
    assert "  batch_size: 32\n" in (again / "spec.yaml").read_text()


def test_resume_refuses_what_it_cannot_continue(tmp_path):
    r = placer_run(MODES["zero"], "--resume", str(tmp_path))
    assert r.returncode == 1 and "error[R032]" in r.stderr and "is not a run directory" in r.stderr
    (tmp_path / "spec.yaml").write_text("")
    r = placer_run(MODES["zero"], "--resume", str(tmp_path))
    assert r.returncode == 1 and "error[R032]: --resume needs checkpoints" in r.stderr


# ---------------------------------------------------------------------------- restarts

SLOW_DATA = '''
import time

import torch


def make_batches(seconds=0.4):
    g = torch.Generator().manual_seed(0)
    while True:
        time.sleep(seconds)  # slow enough for the test to kill a rank mid-run
        yield torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
'''


def tiny_spec(two_cpu_spec, shard: str, timeout_s: int = 30, seconds: float = 0.4) -> Path:
    """`seconds`: each batch's delay (the same batches at any delay)."""
    group = f'  - {{layers: fc1..head, devices: [cpu, "cpu:1"], parallel: {{mode: data, overlap: true, shard: {shard}}}}}'
    return two_cpu_spec("tiny_restart", SLOW_DATA, steps=8, timeout_s=timeout_s, relu=True, placement=group,
                        optimizer="{op: Adam, lr: 0.01}", training="  prefetch: 0\n  checkpoint: {every: 2}\n",
                        data_kwargs={"seconds": seconds})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("shard, fault", [("none", "kill"), ("optimizer", "kill"), ("full", "kill"), ("none", "stop")])
def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_never_killed(shard, fault, tmp_path, two_cpu_spec):
    """`kill`: SIGKILL rank 1. `stop`: SIGSTOP it; rank 0 times out after timeout_s, the report
    names rank 1, and the stopped process is killed at once so the restart need not wait."""
    whole = tmp_path / "whole"  # uninterrupted, and not slowed down
    r = placer_run(str(tiny_spec(two_cpu_spec, shard, seconds=0)), "--run-dir", str(whole), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    spec = tiny_spec(two_cpu_spec, shard, timeout_s=8 if fault == "stop" else 30)

    run = tmp_path / "run"
    proc = h.placer_run_popen(str(spec), "--run-dir", str(run), "--max-restarts", "1",
                              cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        progress = run / "progress.jsonl"
        while time.monotonic() < deadline and not (
                progress.exists() and any(json.loads(line).get("step", 0) >= 3 for line in progress.read_text()
                                          .splitlines() if line.endswith("}"))):
            time.sleep(0.1)
        pid = h.worker(run / "program.py", 1)
        assert pid, "rank 1 is not running"
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if fault == "stop" and h.worker(run / "program.py", 1) == pid:  # still ours: never leave it stopped
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert "attempt 1 of 2" in out
    said = ("rank 1 (cpu:1) was killed by SIGKILL" if fault == "kill" else
            "rank 1 (cpu:1) stopped answering at step ")
    assert "attempt 1 of 2 failed after step " in err and said in err
    if fault == "stop":
        assert re.search(r"rank 0 \(cpu\) waited at step \d+ in .* and timed out after 8 s", err), err
        assert "was killed by SIGKILL" not in err
    assert "restarting: attempt 2 of 2, from the newest complete checkpoint" in err
    assert "resumed from the checkpoint at step " in out and ", 2 attempts)" in out
    log = (run / "run.log").read_text()
    assert said in log and "restarting: attempt 2 of 2" in log
    # each attempt's worker output in its own log, named by device
    assert {"cpu.log", "cpu-1.log", "cpu.restart1.log", "cpu-1.restart1.log"} <= {p.name for p in (run / "logs").iterdir()}
    assert_same_run(whole, run)


# ---------------------------------------------------------------------------- a kill during a save

BIG = """placer: 1
name: big_ckpt
model:
  layers:
    - {name: fc1, op: Linear, args: [16, 2048]}
    - {name: act, op: ReLU}
    - {name: mid, op: Linear, args: [2048, 2048]}
    - {name: head, op: Linear, args: [2048, 4]}
  input: {shape: [B, 16]}
  target: {shape: [B], dtype: int64, high: 4}
  loss: CrossEntropyLoss
devices: [cpu, "cpu:1"]
placement:
  - {layers: fc1..head, devices: [cpu, "cpu:1"], parallel: data}
training:
  batch_size: 8
  steps: 6
  optimizer: {op: Adam, lr: 0.001}
  checkpoint: {every: 2}
runtime: {timeout_s: 60}
"""
"""4.3 M parameters and Adam's two moments: about 52 MB per checkpoint (to step_N/dcp, half by each
rank), long enough for the test to see the files being written and kill the run then."""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
def test_a_run_killed_while_writing_a_checkpoint_resumes_from_the_one_before(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(BIG)
    whole = tmp_path / "whole"
    r = placer_run(str(spec), "--run-dir", str(whole), cwd=tmp_path)
    assert r.returncode == 0, r.stderr

    run = tmp_path / "run"
    proc = h.placer_run_popen(str(spec), "--run-dir", str(run),
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saving = run / "ckpt" / "step_4"
    try:
        deadline = time.monotonic() + 240
        def writing():  # a rank file under its temporary name, or DCP's files (its tensors) before COMPLETE
            return any(saving.glob("rank*.pt.tmp-*")) or any(saving.glob("dcp/*.distcp")) and \
                not (saving / "COMPLETE").exists()
        while time.monotonic() < deadline and proc.poll() is None and not writing():
            time.sleep(0.002)
        assert writing(), "never saw step 4's checkpoint being written"
        proc.kill()  # the whole run, mid-write: its workers die with it (PR_SET_PDEATHSIG)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while h.worker(run / "program.py", 0) or h.worker(run / "program.py", 1):
        assert time.monotonic() < deadline, "a worker outlived the killed run"
        time.sleep(0.1)
    assert not (saving / "COMPLETE").exists() and (run / "ckpt" / "step_2" / "COMPLETE").exists()
    assert not (run / "metrics.json").exists()

    r = placer_run(str(spec), "--resume", str(run), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resumed from the checkpoint at step 2 of 6" in r.stdout
    assert_same_run(whole, run)
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["step_2", "step_4", "step_6"]
    assert not list((run / "ckpt").rglob("*.tmp-*"))  # the rewritten step 4 holds whole files only
