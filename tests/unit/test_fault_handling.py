"""Bad input that would reach the program is refused before any worker starts, and the
program's fault handling (atomic files, checkpoints, timeouts) is what `generate` writes."""
from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import pytest

from placer.codegen import program as program_module
from placer.codegen.program import generate
from placer.diagnostics import PlacerError
from placer.spec.check import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))

TINY = """placer: 1
name: tiny
model:
  layers:
    - {name: fc1, op: Linear, args: [4, 2]}
  input: {shape: [B, 4]}
  target: {shape: [B, 2]}
  loss: MSELoss
devices: [cpu]
placement:
  - {layers: fc1, device: cpu}
training:
  batch_size: 4
  steps: 2
  optimizer: OPTIMIZER
"""


def tiny(tmp_path, optimizer="{op: SGD, lr: 0.1}", extra=""):
    path = tmp_path / "spec.yaml"
    path.write_text(TINY.replace("OPTIMIZER", optimizer) + extra)
    return load_spec(str(path))


def first_error(call) -> str:
    with pytest.raises(PlacerError) as e:
        call()
    return e.value.diagnostics[0].format()


@pytest.mark.parametrize("kwargs, where, says", [
    ('{momentum: "fast"}', "15:52", "rejects momentum='fast': TypeError"),
    ("{momentom: 0.9}", "15:52", "rejects momentom=0.9: TypeError"),
    ("{nesterov: true}", "15:52", "rejects nesterov=True: ValueError: Nesterov momentum requires a momentum"),
])
def test_optimizer_kwargs_are_tried_on_a_dummy_parameter(tmp_path, kwargs, where, says):
    spec = tiny(tmp_path, "{op: SGD, lr: 0.1, kwargs: %s}" % kwargs)
    text = first_error(lambda: generate(spec))
    assert f"spec.yaml:{where}: error[G004]: torch.optim.SGD {says}" in text
    if "momentom" in kwargs:
        assert "hint: did you mean 'momentum'?" in text


def test_a_program_that_does_not_parse_is_an_error_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setattr(program_module, "data_source", lambda spec: "def batches(:\n")
    text = first_error(lambda: generate(tiny(tmp_path)))
    assert "error[G005]: the generated program does not parse: " in text and "def batches(:" in text


def _group_calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("new_group", "pipeline_group", "init_process_group"):
                yield name, node


def test_every_process_group_waits_at_most_timeout_s():
    """runtime.timeout_s bounds every group, not only the default one (torch's new_group
    default is 30 minutes, whatever init_process_group was given)."""
    seen = set()
    for path in SPECS:
        text = generate(load_spec(str(path))).text
        for name, call in _group_calls(ast.parse(text)):
            timeout = next((k.value for k in call.keywords if k.arg == "timeout"), None)
            assert timeout is not None, f"{path.stem}: {ast.unparse(call)}"
            if not (name == "new_group" and ast.unparse(timeout) == "timeout"):  # the pasted pipeline_group
                assert ast.unparse(timeout) == "timedelta(seconds=TIMEOUT_S)", f"{path.stem}: {ast.unparse(call)}"
            seen.add(name)
    assert seen == {"new_group", "pipeline_group", "init_process_group"}


def template_namespace(**constants) -> dict:
    """The program's helpers and checkpoint functions, as a generated program pastes them."""
    import importlib

    ns = {m.split(".")[0]: importlib.import_module(m.split(".")[0]) for m in program_module.STDLIB + ["torch"]} | constants
    ns["dist"] = importlib.import_module("torch.distributed")
    for name in ("helpers.py", "checkpoint.py"):
        exec(compile((program_module.TEMPLATES / name).read_text(), name, "exec"), ns)
    return ns


def test_files_are_renamed_into_place_and_a_failed_write_leaves_the_old_file(tmp_path):
    ns = template_namespace()
    target = tmp_path / "metrics.json"
    ns["replace_atomically"](str(target), lambda tmp: ns["write_json"](tmp, {"a": 1}))
    assert target.read_text() == '{\n  "a": 1\n}'

    def half_written(tmp):
        Path(tmp).write_text('{"a": ')
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        ns["replace_atomically"](str(target), half_written)
    assert target.read_text() == '{\n  "a": 1\n}' and [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


@pytest.mark.parametrize("keep, kept", [(1, [4, 5]), (2, [2, 4, 5]), (None, [1, 2, 4, 5])])
def test_rotation_keeps_the_newest_complete_checkpoints_up_to_the_one_just_written(tmp_path, keep, kept):
    """step_3 is a crash's leftover (no COMPLETE); step_5 is from an earlier attempt that got further."""
    for step in (1, 2, 3, 4, 5):
        (tmp_path / f"step_{step}").mkdir()
        if step != 3:
            (tmp_path / f"step_{step}" / "COMPLETE").write_text("{}")
    template_namespace(CHECKPOINT_KEEP=keep)["rotate_checkpoints"](str(tmp_path), 4)
    assert sorted(int(p.name[5:]) for p in tmp_path.iterdir()) == kept


def test_keep_defaults_to_keeping_every_checkpoint_as_the_schema_says(tmp_path):
    spec = tiny(tmp_path, extra="  checkpoint: {dir: ckpt, every: 1}\n")
    assert spec.training.checkpoint.keep is None
    assert "CHECKPOINT_KEEP = None" in generate(spec).text


def test_check_calls_a_nan_loss_non_finite_not_a_mismatch():
    from placer.cli.run_cmd import check_failure, check_lines
    from placer.launch.check import CheckReport

    nan = float("nan")
    report = CheckReport(problem=None, first_bad_step=2, first_bad_param="w", ok=False,
                         steps=[(1, 0.5, 0.5, 0.0, True), (2, nan, nan, nan, False)],
                         params=[("w", 4, nan, nan, False)])
    assert check_failure(report) == ("the loss is non-finite at step 2 (run nan, reference nan); "
                                     "parameter 'w' is non-finite (nan or inf) in the run or the reference")
    assert check_lines(report)[3].endswith("<- non-finite")


# -- run directories -------------------------------------------------------------------------------

def test_runs_started_together_each_claim_their_own_directory(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from placer.launch.run import claim_run_dir

    stem = str(tmp_path / "runs" / "tiny-20260101-000000")
    with ThreadPoolExecutor(6) as pool:
        dirs = list(pool.map(lambda i: claim_run_dir(None, stem, b"spec %d" % i), range(6)))
    assert len(set(dirs)) == 6
    assert sorted(p.name for p in dirs) == sorted(["tiny-20260101-000000"] + [f"tiny-20260101-000000-{n}"
                                                                             for n in range(2, 7)])
    assert sorted((p / "spec.yaml").read_bytes() for p in dirs) == [b"spec %d" % i for i in range(6)]


def test_overwrite_removes_a_previous_runs_outputs_only(tmp_path):
    from placer.launch.run import claim_run_dir

    run = tmp_path / "run"
    for name in ("logs/x/stderr.log", "ckpt/step_2/rank0.pt", "metrics.json", "spec.yaml", "notes.txt"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("old")
    assert claim_run_dir(run, "unused", b"new", overwrite=True, checkpoint_dir="ckpt") == run
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt", "spec.yaml"]
    assert (run / "spec.yaml").read_bytes() == b"new"


@pytest.mark.parametrize("where, says", [
    ("afile/run", "cannot create the run directory {tmp}/afile/run: {tmp}/afile is a file, not a directory"),
    ("x" * 300, "cannot create the run directory {tmp}/" + "x" * 300 + ": File name too long"),
])
def test_a_run_directory_that_cannot_be_made_is_R026(tmp_path, where, says):
    from placer.launch.run import claim_run_dir

    (tmp_path / "afile").write_text("")
    text = first_error(lambda: claim_run_dir(tmp_path / where, "unused", b""))
    assert f"error[R026]: {says.format(tmp=tmp_path)}" in text


def run_cli(*args):
    from click.testing import CliRunner

    from placer.cli.main import main

    return CliRunner().invoke(main, ["run", *map(str, args)])


def test_a_run_dir_that_holds_files_is_refused_without_overwrite(tmp_path):
    tiny(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "progress.jsonl").write_text("{}\n")
    r = run_cli(tmp_path / "spec.yaml", "--run-dir", tmp_path / "run")
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.stderr.startswith(f"{tmp_path}/run: error[R027]: run directory {tmp_path}/run already holds files\n"
                               "  hint: choose a new --run-dir, or pass --overwrite")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["progress.jsonl"]


def test_a_full_disk_is_R028_not_a_traceback(tmp_path, monkeypatch):
    import errno

    tiny(tmp_path)
    write_text = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == "program.py":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    r = run_cli(tmp_path / "spec.yaml", "--run-dir", tmp_path / "run")
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert f"error[R028]: the disk is full: writing {tmp_path}/run/program.py: No space left on device" in r.stderr


def test_a_checkpoint_write_that_fails_on_a_full_disk_says_so(tmp_path, monkeypatch):
    """torch's writers fail as "enforce fail at inline_container.cc", DCP's as a CheckpointException
    (a BaseException) with the errno lost: the program raises ENOSPC naming the checkpoint (R028)."""
    import errno
    import shutil
    from collections import namedtuple

    ns = template_namespace()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10, 10, 0))

    class CheckpointException(BaseException):
        pass
    with pytest.raises(OSError) as e, ns["disk_full_said"](str(tmp_path)):
        raise CheckpointException("RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos")
    assert e.value.errno == errno.ENOSPC and str(e.value).endswith(f"writing the checkpoint {tmp_path}")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 0, 10 << 30))
    with pytest.raises(ValueError), ns["disk_full_said"](str(tmp_path)):  # room enough: another error
        raise ValueError("not the disk")
    with pytest.raises(OSError) as e, ns["disk_full_said"](str(tmp_path)):  # the errno in the context
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    assert e.value.errno == errno.ENOSPC


def test_metrics_that_cannot_be_written_stop_without_a_traceback(tmp_path):
    import errno

    from placer.launch.metrics import MetricsWriter

    plots = MetricsWriter(tmp_path, 8)

    class Full:
        def writerow(self, row):
            raise OSError(errno.ENOSPC, "No space left on device")
    plots.csv = Full()
    plots.add({"step": 1, "loss": 1.0})  # the follower thread goes on showing progress
    assert plots.stopped and plots.note.startswith("metrics.csv and TensorBoard's files stopped at step 1: ")
    plots.close()


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_a_checkpoint_dir_outside_the_run_dir_belongs_to_one_run(tmp_path, where):
    """training.checkpoint.dir absolute or ../: every run of the spec would save into it. The first
    run claims it (RUN names its run directory), a second is R029, a resume of the first goes on."""
    from placer.launch.run import claim_checkpoint_dir

    shared = tmp_path / "shared"
    spec = tiny(tmp_path, extra=f"  checkpoint: {{every: 1, dir: {shared if where == 'absolute' else '../shared'}}}\n")
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    claim_checkpoint_dir(first, spec)
    assert (shared / "RUN").read_text() == f"{first.resolve()}\n"
    claim_checkpoint_dir(first, spec, resume=True)
    with pytest.raises(PlacerError) as e:
        claim_checkpoint_dir(second, spec)
    d = e.value.diagnostics[0]
    assert d.code == "R029" and d.message == (f"training.checkpoint.dir {shared.resolve()} holds the checkpoints of "
                                              f"{first.resolve()}: two runs would write into one directory")
    (shared / "RUN").unlink()  # checkpoints no run claimed (an earlier placer's): a new run is refused too
    (shared / "step_1").mkdir()
    assert "holds the checkpoints of a run that did not claim it" in first_error(lambda: claim_checkpoint_dir(second, spec))
    claim_checkpoint_dir(first, spec, resume=True)  # a resume claims them
    inside = tiny(tmp_path, extra="  checkpoint: {every: 1, dir: ckpt}\n")
    claim_checkpoint_dir(second, inside)
    assert not (second / "ckpt").exists()  # the default: nothing to claim


def test_a_checkpoint_counts_when_complete_and_every_file_is_whole(tmp_path):
    """What a resume may load: a step with COMPLETE, whose files have the sizes it records and load."""
    import torch

    ns = template_namespace(CHECKPOINT_KEEP=None)
    state = {"step": 2, "rank": 0, "world": 1, "modules": [{"w": torch.ones(3)}], "optimizers": [], "losses": [1.0]}
    for step in (2, 4, 6):
        path = tmp_path / f"step_{step}"
        path.mkdir()
        torch.save(state | {"step": step}, path / "rank0.pt")
        if step != 4:  # step 4: killed before COMPLETE
            ns["write_json"](str(path / "COMPLETE"), {"step": step, "files": {"rank0.pt": (path / "rank0.pt").stat().st_size}})
    whole = (tmp_path / "step_6" / "rank0.pt").read_bytes()
    (tmp_path / "step_6" / "rank0.pt").write_bytes(whole[:100])  # damaged after COMPLETE was written
    assert ns["complete_steps"](str(tmp_path), 10) == [6, 2] and ns["complete_steps"](str(tmp_path), 5) == [2]
    assert ns["complete_steps"](str(tmp_path / "none"), 10) == []
    loaded, why = ns["read_checkpoint"](str(tmp_path), 6, 0, 1)
    assert loaded is None and why == f"rank0.pt is 100 bytes, not {len(whole)}"
    loaded, why = ns["read_checkpoint"](str(tmp_path), 2, 0, 1)
    assert why is None and loaded["losses"] == [1.0] and torch.equal(loaded["modules"][0]["w"], torch.ones(3))
    assert ns["read_checkpoint"](str(tmp_path), 2, 1, 2)[1].startswith("rank1.pt: FileNotFoundError")
    assert ns["read_checkpoint"](str(tmp_path), 2, 0, 2)[1] == "rank0.pt holds step 2 of rank 0 of 1"


@pytest.mark.parametrize("damage", ["bit", "block"])
def test_a_checkpoint_file_of_the_right_size_but_damaged_is_refused_by_its_digest(tmp_path, damage):
    """A flipped low bit or an inverted 4 KiB block keeps the size and, in tensor data, still
    loads: only the sha256 that save_hashed recorded in COMPLETE tells it apart."""
    import torch

    ns = template_namespace(CHECKPOINT_KEEP=None)
    path = tmp_path / "step_2"
    path.mkdir()
    state = {"step": 2, "rank": 0, "world": 1, "modules": [{"w": torch.randn(64, 64)}], "optimizers": [], "losses": []}
    entry = ns["save_hashed"](state, str(path / "rank0.pt"))
    raw = (path / "rank0.pt").read_bytes()
    assert entry == {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}  # what was written
    ns["write_json"](str(path / "COMPLETE"), {"step": 2, "files": {"rank0.pt": entry}})
    assert ns["read_checkpoint"](str(tmp_path), 2, 0, 1)[1] is None
    data = bytearray(raw)
    middle = len(data) // 2  # inside the tensor's 16 KiB
    if damage == "bit":
        data[middle] ^= 1
    else:
        data[middle - 2048:middle + 2048] = bytes(b ^ 0xFF for b in data[middle - 2048:middle + 2048])
    (path / "rank0.pt").write_bytes(bytes(data))
    assert torch.load(path / "rank0.pt", weights_only=True)["step"] == 2  # torch.load alone takes it
    loaded, why = ns["read_checkpoint"](str(tmp_path), 2, 0, 1)
    assert loaded is None and why == "rank0.pt is damaged: its sha256 is not the one COMPLETE records"


def test_a_restart_says_which_rank_failed_how_and_which_attempt_follows():
    from types import SimpleNamespace

    from placer.cli.failures import restart_lines

    spec = SimpleNamespace(training=SimpleNamespace(checkpoint=object()))
    lines = restart_lines(spec, ("cpu", "cpu:1"), 1, 3, {1: (-9, ""), 0: (1, "Traceback\nRuntimeError: boom\n")}, 5)
    assert lines == ["attempt 1 of 3 failed after step 5:", "  rank 0 (cpu) exited with code 1: RuntimeError: boom",
                     "  rank 1 (cpu:1) was killed by SIGKILL",
                     "restarting: attempt 2 of 3, from the newest complete checkpoint"]


def test_the_cpu_reference_trains_beside_the_workers_and_is_stopped_when_they_fail(tmp_path, monkeypatch):
    import subprocess

    from placer.launch import run as launcher

    tiny(tmp_path)
    started, seen = [], {}
    popen = subprocess.Popen

    def spy(cmd, *args, **kwargs):
        proc = popen(cmd, *args, **kwargs)
        if "--reference" in cmd:
            started.append(proc)
        return proc

    def launch(program, run_dir, *args, **kwargs):  # the workers fail at once
        seen["reference running"] = [p.poll() for p in started] == [None]
        return launcher.RunResult(ok=False, run_dir=run_dir, failures={0: (1, "boom")})

    monkeypatch.setattr(subprocess, "Popen", spy)
    monkeypatch.setattr(launcher, "launch", launch)
    r = run_cli(tmp_path / "spec.yaml", "--check", "--run-dir", tmp_path / "run")
    assert r.exit_code == 1 and "error[R020]" in r.stderr
    assert seen == {"reference running": True}
    assert started[0].returncode is not None  # killed, not left behind
    assert not (tmp_path / "run" / "reference" / "final_params.pt").exists()
