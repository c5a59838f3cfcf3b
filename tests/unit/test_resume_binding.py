"""A run directory is bound to the spec it trained with: RUN_DIR/spec.yaml is the spec after
every --set, fingerprint.json what a resume must keep, and a resume that changes the
computation is R033 naming the keys (no worker starts)."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.main import main
from placer.diagnostics import RunError
from placer.launch.resume import effective_spec, must_match, record_fingerprint, resume_changes
from placer.spec import load

SPEC = """placer: 1
name: tiny  # a comment kept when nothing overrides the file
model:
  layers:
    - {name: fc1, op: Linear, args: [4, 2]}
  input: {shape: [B, 4]}
  target: {shape: [B, 2]}
  loss: MSELoss
devices: [cpu, "cpu:1"]
placement:
  - {layers: fc1, devices: [cpu, "cpu:1"], parallel: data}
training:
  batch_size: 16
  steps: 4
  optimizer: {op: SGD, lr: 0.1}
  checkpoint: {every: 2}
"""


def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


def run_dir(tmp_path: Path, *overrides: str) -> Path:
    """A run directory as `placer run spec.yaml --set ...` leaves it."""
    doc = load.load_file(str(spec_file(tmp_path)), overrides)
    data, text = effective_spec(doc, SPEC.encode(), overrides)
    out = tmp_path / "run"
    out.mkdir()
    (out / "spec.yaml").write_text(text)
    record_fingerprint(out, data)
    return out


def changes(tmp_path: Path, run: Path, *overrides: str, anyway: bool = False, reshard: str | None = None) -> list[str]:
    doc = load.load_file(str(spec_file(tmp_path)), overrides)
    data, _ = effective_spec(doc, SPEC.encode(), overrides)
    return resume_changes(run, doc, data, anyway=anyway, reshard=reshard)[0]


def test_the_run_directory_keeps_the_spec_as_trained(tmp_path):
    doc = load.load_file(str(spec_file(tmp_path)))
    assert effective_spec(doc, SPEC.encode()) == (doc.data, SPEC)  # the file itself, comments and all
    overrides = ("training.batch_size=32", "training.optimizer.lr=0.01")
    data, text = effective_spec(load.load_file(str(spec_file(tmp_path)), overrides), SPEC.encode(), overrides, 6)
    assert text.startswith(f"# the spec as trained: {tmp_path / 'spec.yaml'} with --set training.batch_size=32 "
                           "--set training.optimizer.lr=0.01 --steps 6\n")
    again = load.load_text(text).data
    assert again == data and again["training"] == {"batch_size": 32, "steps": 6, "optimizer": {"op": "SGD", "lr": 0.01},
                                                   "checkpoint": {"every": 2}}


def test_what_a_resume_must_keep_leaves_out_steps_checkpoints_and_runtime(tmp_path):
    keep = must_match(load.load_file(str(spec_file(tmp_path))).data)
    assert keep["training.batch_size"] == 16 and keep["placement.0.devices"] == ["cpu", "cpu:1"]
    assert keep["training.precision"] == "fp32"  # a default: writing it out changes nothing
    assert not [k for k in keep if k.startswith(("name", "training.steps", "training.checkpoint", "runtime"))]


def test_a_resume_may_change_steps_checkpoints_and_runtime_but_not_the_computation(tmp_path):
    run = run_dir(tmp_path, "training.batch_size=32")
    assert changes(tmp_path, run, "training.batch_size=32", "training.steps=10", "training.checkpoint.every=5",
                   "runtime.timeout_s=9", "training.precision=fp32") == []
    with pytest.raises(RunError) as e:  # the spec file alone: its batch size is not the run's
        changes(tmp_path, run)
    d = e.value.diagnostics[0]
    assert d.code == "R033" and d.message.endswith("in what changes the computation: training.batch_size: 32 -> 16")
    assert "--resume-anyway" in d.hint and "training.steps, training.checkpoint, training.prefetch, runtime" in d.hint
    assert changes(tmp_path, run, "training.optimizer={op: Adam, lr: 0.1}", anyway=True) == [
        "training.batch_size: 32 -> 16", "training.optimizer.op: SGD -> Adam"]


FOUR = ('devices=[cpu, "cpu:1", "cpu:2", "cpu:3"]', 'placement.0.devices=[cpu, "cpu:1", "cpu:2", "cpu:3"]')


def test_a_resume_may_change_the_placement_where_its_checkpoints_reshard(tmp_path):
    """2 -> 4 data-parallel ranks, or DDP -> FSDP2 (`parallel: data` and `{mode: data}` are one
    thing): the program reshards; the computation's keys are still held to."""
    run = run_dir(tmp_path)
    assert changes(tmp_path, run, *FOUR) == ["devices: [cpu, cpu:1] -> [cpu, cpu:1, cpu:2, cpu:3]",
                                             "placement.0.devices: [cpu, cpu:1] -> [cpu, cpu:1, cpu:2, cpu:3]"]
    assert changes(tmp_path, run, "placement.0.parallel={mode: data}") == []
    assert changes(tmp_path, run, "placement.0.parallel={mode: data, shard: full}") == [
        "placement.0.parallel.shard: (not set) -> full"]
    with pytest.raises(RunError) as e:
        changes(tmp_path, run, *FOUR, "training.batch_size=32")
    assert e.value.diagnostics[0].message.endswith("in what changes the computation: training.batch_size: 16 -> 32")


@pytest.mark.parametrize("side", ["trained", "new", "earlier"])
def test_a_placement_whose_checkpoints_cannot_reshard_is_R033_saying_why(tmp_path, side):
    run = run_dir(tmp_path)
    if side == "trained":
        record_fingerprint(run, load.load_file(str(spec_file(tmp_path))).data, "segment 0 (s0) is tensor parallel")
    elif side == "earlier":  # a fingerprint without the reshard entry
        text = (run / "fingerprint.json").read_text()
        (run / "fingerprint.json").write_text(text.replace('"reshard": null', '"old": null'))
    with pytest.raises(RunError) as e:
        changes(tmp_path, run, *FOUR, reshard="segment 0 (s0) syncs by parameter_server" if side == "new" else None)
    d = e.value.diagnostics[0]
    why = {"trained": "as trained, segment 0 (s0) is tensor parallel",
           "new": "under the new placement, segment 0 (s0) syncs by parameter_server",
           "earlier": "as trained, they were written by an earlier placer, as each rank's pieces only"}[side]
    assert d.code == "R033" and d.message == (
        f"the placement differs from the one the run in {run} trained with (devices: [cpu, cpu:1] -> "
        "[cpu, cpu:1, cpu:2, cpu:3]; placement.0.devices: [cpu, cpu:1] -> [cpu, cpu:1, cpu:2, cpu:3]) and its "
        f"checkpoints cannot be resharded: {why}")


def test_a_run_directory_from_an_earlier_placer_has_no_fingerprint_to_hold_to(tmp_path):
    run = run_dir(tmp_path)
    (run / "fingerprint.json").unlink()
    assert changes(tmp_path, run, "training.batch_size=32") == []


def test_resume_refuses_another_batch_size_before_any_worker_starts(tmp_path):
    pytest.importorskip("torch")
    run = run_dir(tmp_path)
    spec = str(tmp_path / "spec.yaml")
    r = CliRunner().invoke(main, ["run", spec, "--resume", str(run), "--set", "training.batch_size=32"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert ("--set training.batch_size=32: error[R033]: the spec differs from the one the run in "
            f"{run} trained with, in what changes the computation: training.batch_size: 16 -> 32") in r.stderr
    assert not (run / "program.py").exists() and "batch_size: 16" in (run / "spec.yaml").read_text()
    r = CliRunner().invoke(main, ["run", spec, "--resume-anyway"])
    assert r.exit_code == 2 and "--resume-anyway goes with --resume RUN_DIR" in r.output


def test_which_placements_save_checkpoints_that_reshard():
    """Whole tensors and DTensor shards of the model reshard; pieces of a program's own do not."""
    from placer.codegen.program import reshard_blocker
    from placer.codegen.segments import Seg

    def seg(mode="data", **kw):
        return Seg(k=0, name="s0", layers=("fc1",), ranks=(0, 1), mode=mode, **kw)
    assert reshard_blocker([seg("none"), seg(sync="allreduce"), seg(sync="allreduce", shard="full")], False, False) is None
    assert reshard_blocker([seg("tensor")], False, False) is None  # DTensor shards of the model's Linears
    assert reshard_blocker([seg("tensor", replicas=2)], False, False) == (
        "segment 0 (s0) is tensor parallel over data replicas or a module's blocks")
    assert reshard_blocker([seg("channel")], False, False) == ("segment 0 (s0) is channel parallel, whose slices are "
                                                               "this program's own")
    assert "syncs by parameter_server" in reshard_blocker([seg(sync="parameter_server")], False, False)
    assert "ZeroRedundancyOptimizer" in reshard_blocker([seg(sync="allreduce", shard="optimizer")], False, False)
    assert "torch.distributed.pipelining" in reshard_blocker([seg("none")], True, False)
    assert "span 2 machines" in reshard_blocker([seg("none")], False, False, nodes=2)
