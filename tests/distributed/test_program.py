"""The generated program on its own (torchrun, `python program.py`), and `placer run`'s
device binding, failures, timeouts and two launches meeting as two nodes on localhost."""
from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.main import main
from placer.codegen.program import generate
from placer.launch.check import compare
from placer.spec.check import load_spec

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"


def write_program(spec_name: str, path: Path) -> Path:
    path.write_text(generate(load_spec(str(SPECS / f"{spec_name}.yaml")), out_dir=str(path.parent)).text)
    return path


def python(*args, cwd, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_the_program_imports_no_placer(tmp_path):
    program = write_program("tinygpt", tmp_path / "program.py")
    tree = ast.parse(program.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not [m for m in imported if m.split(".")[0] == "placer"]
    # and at run time: a `placer` that cannot be imported shadows the real one
    blocker = tmp_path / "blocker" / "placer"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('the generated program imported placer')\n")
    env = {**os.environ, "PYTHONPATH": str(blocker.parent)}
    run = subprocess.run([sys.executable, str(program), "--reference", "--simulate", "--steps", "1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0 and "step 1/1" in run.stdout, run.stderr[-3000:]


def test_the_program_runs_under_torchrun_from_anywhere(tmp_path):
    """torchrun starts it; the user data module is found from the spec's directory, not the cwd."""
    program = write_program("mlp_user_data", tmp_path / "program.py")
    work = tmp_path / "elsewhere"
    work.mkdir()
    run = python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", program,
                 "--simulate", "--out", tmp_path / "out", "--steps", "3", cwd=work)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "step 3/3" in run.stdout
    ref = python(program, "--reference", "--simulate", "--out", tmp_path / "ref", "--steps", "3", cwd=work)
    assert ref.returncode == 0, ref.stderr[-3000:]
    report = compare(tmp_path / "out", tmp_path / "ref")
    assert report.ok and len(report.steps) == 3 and len(report.params) == 8, report.as_dict()
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["simulated"] and metrics["backend"] == "gloo" and metrics["world_size"] == 2


def test_the_program_moves_with_its_model_file(tmp_path):
    """The program finds the spec's files relative to its own file: moved together with its
    model file it still runs, from any working directory."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "tests/cases/valid/module_model", project)
    program = project / "out" / "program.py"
    program.parent.mkdir()
    program.write_text(generate(load_spec(str(project / "spec.yaml")), out_dir=str(program.parent)).text)
    project.rename(tmp_path / "moved")
    run = python(tmp_path / "moved/out/program.py", "--reference", "--simulate", "--steps", "1", cwd=tmp_path)
    assert run.returncode == 0 and "step 1/1" in run.stdout, run.stderr[-3000:]


def test_python_program_starts_its_own_workers_and_simulates_missing_gpus(tmp_path):
    program = write_program("mlp_layerwise_direct", tmp_path / "program.py")
    run = python(program, "--out", tmp_path / "out", "--steps", "2", "--measure", cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "simulating 2 devices as CPU workers on gloo: this machine lacks cuda:0, cuda:1" in run.stdout
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["devices"] == ["cuda:0", "cuda:1"] and metrics["simulated"] and len(metrics["losses"]) == 2
    # the activation went rank 0 -> rank 1 and its gradient back: 16 x 64 floats each way per step
    assert metrics["bytes_by_call"]["cuda:0"]["isend"] == 2 * 16 * 64 * 4
    assert metrics["bytes_by_call"]["cuda:1"]["isend"] == 2 * 16 * 64 * 4


def test_a_device_missing_here_is_simulated_with_a_notice(tmp_path):
    """mlp_cpu_gpu_mixed names cpu and cuda:0; this machine has no GPU."""
    r = CliRunner().invoke(main, ["run", str(SPECS / "mlp_cpu_gpu_mixed.yaml"), "--check", "--steps", "2",
                                  "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("simulating 2 devices as CPU workers on gloo: this machine lacks cuda:0")
    assert "check passed" in r.stdout
    assert (tmp_path / "run" / "run.log").read_text().splitlines()[0] == lines[0]


FLAKY_DATA = '''
import os
import time

import torch


def make_batches(fail_rank=1, fail_step=1, hang=False, skew=False):
    g = torch.Generator().manual_seed(0)
    for step in range(10**9):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        if os.environ.get("RANK") == str(fail_rank) and step >= fail_step:
            if skew:  # this rank alone trains on other targets from here on
                y = (y + 1) % 4
            elif hang:
                time.sleep(3600)
            else:
                raise RuntimeError(f"the data source ran dry at step {step}")
        yield x, y
'''


def _failing_spec(two_cpu_spec, **data_kwargs) -> Path:
    return two_cpu_spec("flaky", FLAKY_DATA, steps=3, timeout_s=3, data_kwargs=data_kwargs, training="  prefetch: 0\n")


def test_a_failing_worker_is_named_with_its_error(tmp_path, two_cpu_spec):
    spec = _failing_spec(two_cpu_spec, fail_rank=1)
    r = CliRunner().invoke(main, ["run", str(spec), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit)
    first = r.stderr.split("error[R020]: ", 1)[1]
    assert first.startswith("rank 1 (cpu:1) exited with code 1: RuntimeError: the data source ran dry at step 1\n")
    # once: rank 0 is listed as taken down, without its own traceback
    assert r.stderr.count("the data source ran dry") == 1 and r.stderr.count("error[R020]") == 1
    assert "  it took down: rank 0 (cpu), " in first
    assert f"hint: its whole output is in {tmp_path / 'run' / 'logs' / 'cpu-1.log'}" in first
    # nothing lost: the program, the spec and every worker's output stay in the run dir
    kept = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"program.py", "spec.yaml", "run.log", "logs"} <= kept
    # one log per device, named by it, with the worker's prints and its traceback
    assert sorted(p.name for p in (tmp_path / "run" / "logs").iterdir()) == ["cpu-1.log", "cpu.log"]
    assert "RuntimeError: the data source ran dry" in (tmp_path / "run" / "logs" / "cpu-1.log").read_text()
    assert "error[R020]" in (tmp_path / "run" / "run.log").read_text()


def test_runtime_timeout_bounds_a_copy_that_waits(tmp_path, two_cpu_spec):
    """Rank 1 hangs making its batch; rank 0's copy to it gives up after timeout_s (3 s). The
    report names rank 1, which stopped answering, not rank 0, which waited (R034)."""
    spec = _failing_spec(two_cpu_spec, fail_rank=1, hang=True)
    r = CliRunner().invoke(main, ["run", str(spec), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1
    assert ("error[R034]: rank 1 (cpu:1) stopped answering at step 2 in data; rank 0 (cpu) waited at step 2 in "
            "forward (isend to rank 1) and timed out after 3 s") in r.stderr, r.stderr
    rank0 = (tmp_path / "run" / "logs" / "cpu.log").read_text()  # rank 0's output, named by its device
    assert "error[R020]" not in r.stderr and "Timed out waiting 3000ms" in rank0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launches_meet_as_two_nodes_on_localhost(tmp_path):
    """specs/mlp_multi_node.yaml: node0/cuda:0..1 and node1/cuda:0..1, simulated; node 0 checks."""
    shutil.copy(SPECS / "mlp_multi_node.yaml", tmp_path / "spec.yaml")
    endpoint = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}

    def launch(node: int, *extra):
        cmd = [sys.executable, "-m", "placer.cli.main", "run", "spec.yaml", "--nnodes", "2", "--node-rank", str(node),
               "--rdzv-endpoint", endpoint, "--run-dir", f"node{node}", *extra]
        return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    nodes = [launch(0, "--check"), launch(1, "--format", "json")]
    outs = []
    try:
        for p in nodes:
            outs.append(p.communicate(timeout=240))
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, out + err[-3000:]
    assert "node 0 of 2: 2 workers (gloo)" in outs[0][0] and "check passed" in outs[0][0]
    h.assert_every_gradient_compared(tmp_path / "node0")  # node 1's ranks record theirs unasked
    node1 = json.loads(outs[1][0])
    assert node1["ok"] and node1["simulated"] and node1["world_size"] == 4 and node1["run_dir"] == "node1"
    metrics = json.loads((tmp_path / "node0" / "metrics.json").read_text())
    assert metrics["world_size"] == 4 and not (tmp_path / "node1" / "metrics.json").exists()
    # node 0's first worker is rank 0 (it prints the steps): the static rendezvous keeps node order
    out0 = [p.read_text() for p in (tmp_path / "node0" / "logs").glob("node0-cuda-0.log")]
    out1 = [p.read_text() for p in (tmp_path / "node1" / "logs").glob("node1-cuda-0.log")]
    assert "step 3/3" in out0[0] and "step" not in out1[0]
    # the classifier (node1/cuda:0, rank 2) received the merged activation and sent its gradient back
    assert metrics["bytes_by_call"]["node1/cuda:0"]["isend"] > metrics["bytes_by_call"]["node0/cuda:0"]["isend"]


def test_check_names_the_step_and_parameter_where_a_mismatch_starts(tmp_path, two_cpu_spec):
    """Rank 1 (the head) trains on other targets from step index 1 on: the second step differs."""
    spec = _failing_spec(two_cpu_spec, fail_rank=1, fail_step=1, skew=True)
    r = CliRunner().invoke(main, ["run", str(spec), "--check", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1, r.output
    table = r.stdout.split("check: ", 1)[1]
    assert "<- differs" not in table.splitlines()[2] and "<- differs" in table.splitlines()[3]
    assert "error[R021]: the run does not match the one-device reference: the loss differs from step 2 on" in r.stderr
    assert "parameter 'fc1.bias' differs" in r.stderr or "parameter 'fc1.weight' differs" in r.stderr
    check = json.loads((tmp_path / "run" / "check.json").read_text())
    assert not check["ok"] and check["first_bad_step"] == 2
