"""`placer run --launcher slurm` against a real Slurm: a one-node cluster on this machine
(munged, slurmctld and slurmd from Debian's slurm-wlm and munge, a minimal slurm.conf in a
temporary directory), started once for the module and shut down after it. Without Slurm
installed, or without root (slurmd starts job steps as their user), the tests skip and say why.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")

CONF = """\
ClusterName=placertest
SlurmctldHost={host}
SlurmUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
MinJobAge=300
KillWait=10
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 5) -> str:
    return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:]) if path.exists() else ""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """SLURM_CONF of a running one-node cluster; its daemons end with the module."""
    missing = [c for c in DAEMONS if shutil.which(c) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not found): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("a Slurm cluster of one's own needs root (slurmd runs job steps as their user)")
    d = tmp_path_factory.mktemp("slurm")
    (d / "state").mkdir()
    (d / "spool").mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(host=host, dir=d, ctld_port=_free_port(), d_port=_free_port(), cpus=os.cpu_count()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons: list[subprocess.Popen] = []

    def start(*cmd: str) -> None:
        daemons.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    try:
        start("munged", "-F", "-f", f"--key-file={key}", f"--socket={d}/munge.sock", f"--log-file={d}/munged.log",
              f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed")
        deadline = time.monotonic() + 10
        while not (d / "munge.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        start("slurmctld", "-D", "-i")
        start("slurmd", "-D", "-N", host)
        up = False
        while time.monotonic() < deadline + 20 and not up:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            up = out.strip() == "idle"
            dead = [p.args[0] for p in daemons if p.poll() is not None]
            if dead:
                break
            time.sleep(0.2)
        if not up:
            why = "; ".join(f"{n}: {_tail(d / f'{n}.log')}" for n in ("munged", "slurmctld", "slurmd"))
            pytest.skip(f"the one-node Slurm cluster did not come up ({why})")
        yield env
    finally:
        jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()
        if jobs:
            subprocess.run(["scancel", *jobs], env=env, capture_output=True)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and subprocess.run(
                    ["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.strip():
                time.sleep(0.2)
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True)
        for p in reversed(daemons):  # slurmd, slurmctld, then munged, which they authenticate with
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if p.args[0] == "slurmctld":
                daemons[0].send_signal(signal.SIGTERM)  # munged has nothing left to serve


def placer(env: dict, *args: str, cwd: Path, **kw) -> subprocess.Popen:
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", "placer", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


DATA = '''
import os
import time

import torch


def make_batches(fail_rank=None, seconds=0.0):
    g = torch.Generator().manual_seed(0)
    step = 0
    while True:
        if step == 1 and os.environ.get("RANK") == str(fail_rank):
            raise RuntimeError(f"rank {fail_rank} ran out of data on purpose")
        time.sleep(seconds)
        yield torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        step += 1
'''


def spec(tmp_path: Path, steps: int, **data_kwargs) -> Path:
    (tmp_path / "data.py").write_text(DATA)
    path = tmp_path / "spec.yaml"
    path.write_text(f"""placer: 1
name: tiny_slurm
model:
  layers:
    - {{name: fc1, op: Linear, args: [16, 8]}}
    - {{name: head, op: Linear, args: [8, 4]}}
  input: {{shape: [B, 16]}}
  target: {{shape: [B], dtype: int64, high: 4}}
  loss: CrossEntropyLoss
devices: [cpu, "cpu:1"]
placement:
  - {{layers: fc1..head, devices: [cpu, "cpu:1"], parallel: data}}
training:
  batch_size: 8
  steps: {steps}
  optimizer: {{op: SGD, lr: 0.1}}
  data: {{module: data.py:make_batches, kwargs: {json.dumps(data_kwargs)}}}
runtime:
  timeout_s: 30
""")
    return path


def test_a_slurm_run_checks_against_the_reference(slurm, tmp_path):
    run_dir = tmp_path / "run"
    proc = placer(slurm, "run", str(spec(tmp_path, steps=2)), "--launcher", "slurm", "--run-dir", str(run_dir),
                  "--check", "--time", "5", "--format", "json", cwd=tmp_path)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    outcome = json.loads(out)
    assert outcome["ok"] and outcome["job_state"] == "COMPLETED" and outcome["check"]["ok"], outcome
    assert outcome["metrics"]["steps"] == 2
    assert "#SBATCH --time=5" in (run_dir / "job.sbatch").read_text()
    for name in ("program.py", "spec.yaml", "run.log", "metrics.json", "final_params.pt", "check.json",
                 "logs/cpu.log", "logs/cpu-1.log", "job/node-0.json", "job/submit.log"):
        assert (run_dir / name).exists(), name
    assert "check passed" in (run_dir / "run.log").read_text()
    assert "Traceback" not in err


def wait_for_job(env: dict, job: str, timeout: float = 240) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
        state = out.split("JobState=")[1].split()[0] if "JobState=" in out else "UNKNOWN"
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state
        time.sleep(0.5)
    return "TIMED OUT"


def test_the_generated_script_submitted_by_hand(slurm, tmp_path):
    """`placer generate --sbatch` then `sbatch`: the job makes its run directory itself."""
    proc = placer(slurm, "generate", str(spec(tmp_path, steps=1)), "--sbatch", "job.sbatch", cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    env = {**slurm, "PLACER_RUN_DIR": str(tmp_path / "run"),
           "PYTHONPATH": str(ROOT) + os.pathsep + slurm.get("PYTHONPATH", "")}
    job = subprocess.run(["sbatch", "--parsable", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert wait_for_job(slurm, job) == "COMPLETED", _tail(tmp_path / f"slurm-{job}.out") + \
        _tail(tmp_path / "run" / "job" / "node-0.err")
    outcome = json.loads((tmp_path / "run" / "job" / "node-0.json").read_text())
    assert outcome["ok"] and outcome["metrics"]["steps"] == 1
    assert (tmp_path / "run" / "metrics.json").exists() and (tmp_path / "run" / "logs" / "cpu-1.log").exists()


def test_a_failing_rank_is_named(slurm, tmp_path):
    run_dir = tmp_path / "run"
    proc = placer(slurm, "run", str(spec(tmp_path, steps=3, fail_rank=1)), "--launcher", "slurm",
                  "--run-dir", str(run_dir), cwd=tmp_path)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, out + err
    assert "error[R020]: rank 1 (cpu:1) exited with code 1: RuntimeError: rank 1 ran out of data on purpose" in err
    assert f"hint: its whole output is in {run_dir / 'logs' / 'cpu-1.log'}" in err
    assert "ended FAILED" in err and "Traceback" not in err
    assert json.loads((run_dir / "job" / "node-0.json").read_text())["diagnostics"][0]["code"] == "R020"


def test_scancel_is_reported_as_cancelled(slurm, tmp_path):
    run_dir = tmp_path / "run"
    proc = placer(slurm, "run", str(spec(tmp_path, steps=10000, seconds=0.2)), "--launcher", "slurm",
                  "--run-dir", str(run_dir), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "progress.jsonl").exists() or not (run_dir / "progress.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        job = (run_dir / "job" / "job_id").read_text().strip()
        subprocess.run(["scancel", job], env=slurm, check=True)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, out + err
    assert f"error[R043]: Slurm job {job} ended CANCELLED" in err and f"run directory kept: {run_dir}" in err


def test_in_job_nodes_share_one_run_directory(tmp_path):
    """What a two-node job's srun runs, without Slurm (this machine is both nodes): each node's
    `placer run --in-job` (its rank from $SLURM_NODEID), node 0 making the run directory and node
    1 running in it; every device's log, node 0's metrics and each node's outcome land in it."""
    path = spec(tmp_path, steps=2)
    path.write_text(path.read_text().replace('devices: [cpu, "cpu:1"]', "devices: [node0/cpu, node1/cpu]"))
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [placer({**os.environ, "SLURM_NODEID": str(k)}, "run", str(path), "--in-job", "--run-dir", "run",
                    "--nnodes", "2", "--rdzv-endpoint", endpoint, cwd=tmp_path) for k in (1, 0)]  # node 1 waits
    try:
        outs = [p.communicate(timeout=240) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, out + err
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["node0-cpu.log", "node1-cpu.log"]
    assert json.loads((run / "metrics.json").read_text())["world_size"] == 2
    assert all(json.loads((run / "job" / f"node-{k}.json").read_text())["ok"] for k in (0, 1))
    assert "node 0 of 2: 1 workers (gloo)" in (run / "run.log").read_text()
    assert "node 1 of 2: 1 workers (gloo)" in (run / "job" / "node-1.log").read_text()
