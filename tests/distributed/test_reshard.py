"""`placer run --resume` under another placement: a checkpoint of 2 data-parallel ranks resumes on 4
(and that one on 2 again), DDP's resumes under FSDP2 and under tensor parallelism, one pipeline
cut's under another, and each
continues exactly (`--check`: every loss, the checkpoint's and the new ones, and every final
parameter against the one-device reference). A damaged file of DCP's passes over its checkpoint.
What cannot be resharded, or changes the computation, is R033 before any worker starts, and the
checkpoints are left as they were.
A tiny 4-layer MLP, 4 steps, a checkpoint every 2, SGD with momentum (state to carry over)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

pytestmark = pytest.mark.distributed

SPEC = """placer: 1
name: tiny
model:
  layers:
    - {name: fc1, op: Linear, args: [16, 8]}
    - {name: act, op: ReLU}
    - {name: fc2, op: Linear, args: [8, 8]}
    - {name: head, op: Linear, args: [8, 4]}
  input: {shape: [B, 16]}
  target: {shape: [B], dtype: int64, high: 4}
  loss: CrossEntropyLoss
devices: [cpu, "cpu:1"]
placement:
PLACEMENT
training:
  batch_size: 8
  steps: 4
  optimizer: {op: SGD, lr: 0.1, kwargs: {momentum: 0.9}}
  checkpoint: {dir: ckpt, every: 2}
runtime: {timeout_s: 30}
"""
DATA = '  - {layers: fc1..head, devices: [cpu, "cpu:1"], parallel: data}'
PIPELINE = ('  - {layers: fc1, device: cpu}\n  - {layers: act..head, device: "cpu:1"}\n'
            "pipeline: {microbatches: 2, schedule: 1f1b}")
FOUR = ["--set", 'devices=[cpu, "cpu:1", "cpu:2", "cpu:3"]',
        "--set", 'placement.0.devices=[cpu, "cpu:1", "cpu:2", "cpu:3"]']
TWO = ["--set", 'devices=[cpu, "cpu:1"]', "--set", 'placement.0.devices=[cpu, "cpu:1"]']
NEW = {  # another placement of each original run: (the original, its --set's)
    "more_data_ranks": ("data", FOUR),
    "fsdp2": ("data", ["--set", "placement.0.parallel={mode: data, shard: full}"]),
    "pipeline_cut": ("pipeline", ["--set", 'placement=[{layers: fc1..fc2, device: cpu}, {layers: head, device: "cpu:1"}]']),
    "tensor": ("pair", ["--set", "placement.0.parallel=tensor"]),  # fc1 column-split, head row-split: DTensors
}
PAIR = "    - {name: fc2, op: Linear, args: [8, 8]}\n"  # left out of the "pair" model: fc1, act, head


def placer_run(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = h.placer_run_popen(*args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The spec of each original placement and its uninterrupted 4-step run, made when first asked for."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            spec = folder / "spec.yaml"
            text = SPEC.replace("PLACEMENT", PIPELINE if name == "pipeline" else DATA)
            spec.write_text(text.replace(PAIR, "") if name == "pair" else text)
            r = placer_run(str(spec), "--run-dir", str(folder / "whole"), cwd=folder)
            assert r.returncode == 0, r.stderr
            made[name] = spec, folder / "whole"
        return made[name]
    return get


def interrupted(run: Path, to: Path, keep_upto: int = 2) -> Path:
    """`run` as a run stopped after step `keep_upto`: later checkpoints and the results gone."""
    shutil.copytree(run, to)
    for step_dir in (to / "ckpt").iterdir():
        if int(step_dir.name.split("_")[1]) > keep_upto:
            shutil.rmtree(step_dir)
    for name in ("metrics.json", "final_params.pt"):
        (to / name).unlink()
    return to


def assert_continued_exactly(r: subprocess.CompletedProcess, step: int, steps: int, ranks: int) -> None:
    assert r.returncode == 0, r.stderr
    assert f"resumed from the checkpoint at step {step} of {steps}, resharded from {ranks} ranks" in r.stdout
    assert f"trained steps {step + 1}..{steps} of {steps}" in r.stdout
    assert "check passed" in r.stdout, r.stdout


@pytest.mark.parametrize("new", list(NEW))
def test_a_checkpoint_resumes_under_another_placement_and_continues_exactly(new, runs, tmp_path):
    original, sets = NEW[new]
    spec, whole = runs(original)
    run = interrupted(whole, tmp_path / "run")
    r = placer_run(str(spec), *sets, "--resume", str(run), "--check", cwd=tmp_path)
    assert_continued_exactly(r, 2, 4, 2)
    assert "resharding the checkpoint: " in r.stderr and "--resume-anyway" not in r.stderr
    assert sorted(json.loads((run / "ckpt" / "step_4" / "COMPLETE").read_text())["files"])[-1] == \
        f"rank{3 if new == 'more_data_ranks' else 1}.pt"  # step 4 is the new placement's own
    if new == "more_data_ranks":  # and back: 4 ranks' checkpoint at step 4 on 2, two steps further
        back = interrupted(run, tmp_path / "back", keep_upto=4)
        r = placer_run(str(spec), *TWO, "--steps", "6", "--resume", str(back), "--check", cwd=tmp_path)
        assert_continued_exactly(r, 4, 6, 4)


@pytest.mark.parametrize("damage", ["bit", "truncated"])
def test_a_damaged_file_of_a_checkpoint_by_name_passes_over_it(damage, runs, tmp_path):
    """A low bit flipped in one of DCP's files, resumed on 4 ranks; or the file cut short, resumed
    under the same placement (which loads DCP's files too): the checkpoint before it is used."""
    spec, whole = runs("data")
    run = interrupted(whole, tmp_path / "run", keep_upto=4)
    damaged = run / "ckpt" / "step_4" / "dcp" / "__1_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data) if damage == "bit" else bytes(data[:len(data) // 2]))
    r = placer_run(str(spec), *(FOUR if damage == "bit" else []), "--steps", "6", "--resume", str(run), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    why = "is damaged: its sha256 is not the one COMPLETE records" if damage == "bit" else \
        f"is {len(data) // 2} bytes, not {len(data)}"
    assert (f"the checkpoint at step 4 is not usable: {run / 'ckpt' / 'step_4'}/dcp/__1_0.distcp {why}; "
            "resuming from the checkpoint at step 2 instead") in r.stderr
    resharded = ", resharded from 2 ranks" if damage == "bit" else ""
    assert f"resumed from the checkpoint at step 2 of 6{resharded}\n" in r.stdout


@pytest.mark.parametrize("change, says", [
    (["--set", "placement.0.parallel=channel"], "and its checkpoints cannot be resharded: under the new placement, "
                                               "segment 0 (s0) is channel parallel, whose slices are this program's own"),
    (["--set", "training.optimizer={op: Adam, lr: 0.01}"],
     "in what changes the computation: training.optimizer.op: SGD -> Adam; training.optimizer.lr: 0.1 -> 0.01"),
    (["--set", "training.batch_size=16", *FOUR], "in what changes the computation: training.batch_size: 8 -> 16"),
])
def test_a_resume_that_cannot_continue_is_R033_and_leaves_the_checkpoints(change, says, runs, tmp_path):
    spec, whole = runs("data")
    run = interrupted(whole, tmp_path / "run")
    before = {p: p.read_bytes() for p in (run / "ckpt").rglob("*") if p.is_file()}
    r = placer_run(str(spec), *change, "--resume", str(run), cwd=tmp_path)
    assert r.returncode == 1 and "error[R033]" in r.stderr and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (run / "logs" / "cpu-2.log").exists()
    assert {p: p.read_bytes() for p in (run / "ckpt").rglob("*") if p.is_file()} == before
