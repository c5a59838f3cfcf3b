"""`placer generate --sbatch`: the job script, and the errors before anything is submitted
(the real Slurm runs are tests/distributed/test_slurm.py)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from click.testing import CliRunner

from placer.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def sbatch(tmp_path: Path, spec: str, *args: str) -> str:
    out = tmp_path / "job.sbatch"
    r = CliRunner().invoke(main, ["generate", str(ROOT / "specs" / spec), "--sbatch", str(out), *args])
    assert r.exit_code == 0, r.output
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0  # it parses
    return out.read_text()


def test_two_nodes_of_two_gpus(tmp_path):
    text = sbatch(tmp_path, "mlp_multi_node.yaml", "--partition", "gpu", "--time", "1:00:00",
                  "--sbatch-option=--qos=high", "--set", "training.steps=5")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --partition=gpu", "#SBATCH --time=1:00:00", "#SBATCH --qos=high"):
        assert line + "\n" in text
    assert 'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert ('$PLACER run "$SPEC" --in-job --run-dir "$RUN_DIR" --set training.steps=5 --nnodes "$SLURM_NNODES" '
            '--rdzv-endpoint "$HEAD:$PORT"') in text
    assert f"SPEC={ROOT / 'specs' / 'mlp_multi_node.yaml'}\n" in text


def test_cpu_workers_on_one_node_ask_for_no_gpu(tmp_path):
    text = sbatch(tmp_path, "mlp_cpu_workers.yaml")
    assert "#SBATCH --nodes=1\n" in text and "--gpus-per-node" not in text and "--rdzv-endpoint" not in text
    assert 'RUN_DIR="${PLACER_RUN_DIR:-runs/mlp_cpu_workers-$SLURM_JOB_ID}"' in text


def test_a_bad_time_limit_is_a_usage_error(tmp_path):
    r = CliRunner().invoke(main, ["generate", str(ROOT / "specs" / "mlp_cpu_workers.yaml"), "--sbatch",
                                  str(tmp_path / "j"), "--time", "1h"])
    assert r.exit_code == 2 and "--time '1h' is not a Slurm time limit" in r.output


def test_without_slurm_the_run_says_r040(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    r = CliRunner().invoke(main, ["run", str(ROOT / "specs" / "mlp_cpu_workers.yaml"), "--launcher", "slurm",
                                  "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1, r.output
    assert "error[R040]: Slurm's sbatch is not on this machine's PATH" in r.stderr
    assert (tmp_path / "run" / "job.sbatch").exists()  # written all the same: it can be submitted elsewhere


def test_slurm_flags_that_start_nodes_themselves_are_refused():
    r = CliRunner().invoke(main, ["run", "spec.yaml", "--launcher", "slurm", "--nnodes", "2"])
    assert r.exit_code == 2 and "--launcher slurm starts every node itself" in r.output


def fake_slurm(monkeypatch, states, on_poll=None):
    """sbatch accepts the job as 7; scontrol reports `states` in turn (the last one from then on)."""
    from placer.cli import run_slurm
    from placer.launch import slurm

    seen = []

    def job_state(job_id):
        state = states[min(len(seen), len(states) - 1)]
        seen.append(state)
        if on_poll:
            on_poll(len(seen))
        return slurm.JobState(job_id, *state)

    monkeypatch.setattr(slurm, "submit", lambda script, spec: "7")
    monkeypatch.setattr(slurm, "job_state", job_state)
    monkeypatch.setattr(run_slurm, "POLL_S", 0.0)
    return seen


def test_a_job_out_of_time_before_placer_reported_is_r042(tmp_path, monkeypatch):
    fake_slurm(monkeypatch, [("PENDING", "Priority"), ("RUNNING", "", "", "gpu01"), ("TIMEOUT", "TimeLimit", "0:15")])
    r = CliRunner().invoke(main, ["run", str(ROOT / "specs" / "mlp_cpu_workers.yaml"), "--launcher", "slurm",
                                  "--time", "1", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1, r.output
    assert "job 7 pending (Priority)" in r.stdout and "job 7 running on gpu01" in r.stdout
    assert "error[R042]: Slurm job 7 ended TIMEOUT (TimeLimit), exit code 0:15, and node(s) 0 never reported" in r.stderr
    assert "hint: raise --time" in r.stderr
    assert "submitted Slurm job 7" in (tmp_path / "run" / "job" / "submit.log").read_text()


def test_a_controller_that_forgets_the_job_for_a_moment_is_asked_again(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"

    def node_done(polls):
        if polls == 2:  # node 0's placer run finished while scontrol could not say
            (run_dir / "job" / "node-0.json").write_text('{"ok": true, "metrics": {"steps": 3}}')
    seen = fake_slurm(monkeypatch, [("RUNNING",), ("UNKNOWN",), ("UNKNOWN",), ("COMPLETED", "", "0:0")], node_done)
    r = CliRunner().invoke(main, ["run", str(ROOT / "specs" / "mlp_cpu_workers.yaml"), "--launcher", "slurm",
                                  "--run-dir", str(run_dir), "--format", "json"])
    assert r.exit_code == 0, r.output
    assert len(seen) == 4
    outcome = json.loads(r.stdout)
    assert outcome["ok"] and outcome["job_state"] == "COMPLETED" and outcome["metrics"] == {"steps": 3}


def test_a_check_that_fails_on_the_node_is_its_report_not_r042(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"

    def node_done(polls):
        if polls == 1:  # R021 is said on the node, which exits 1: an outcome without diagnostics
            (run_dir / "job" / "node-0.json").write_text('{"ok": false, "check": {"ok": false}}')
    fake_slurm(monkeypatch, [("RUNNING",), ("FAILED", "NonZeroExitCode", "1:0")], node_done)
    r = CliRunner().invoke(main, ["run", str(ROOT / "specs" / "mlp_cpu_workers.yaml"), "--launcher", "slurm",
                                  "--check", "--run-dir", str(run_dir)])
    assert r.exit_code == 1, r.output
    assert "Slurm job 7 ended FAILED (NonZeroExitCode), exit code 1:0: the report above" in r.stderr
    assert "R042" not in r.stderr
    assert "--check" in (run_dir / "job.sbatch").read_text()
