"""`placer run` under faults a user meets: a non-finite loss, data that runs out, Ctrl-C and
SIGTERM. Tiny 2-rank CPU runs; every wait is bounded and only the processes a test started
are signalled."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.main import main

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]

DATA = '''
import torch


def make_batches(n=10**9, nan_at=None):
    g = torch.Generator().manual_seed(0)
    for step in range(n):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        if step == nan_at:
            x[0, 0] = float("nan")
        yield x, y
'''


def tiny_spec(two_cpu_spec, steps: int = 4, **data_kwargs) -> Path:
    return two_cpu_spec("tiny2", DATA, steps=steps, timeout_s=20, data_kwargs=data_kwargs)


def test_a_non_finite_loss_stops_the_run_at_its_step(tmp_path, two_cpu_spec):
    spec = tiny_spec(two_cpu_spec, nan_at=1)
    r = CliRunner().invoke(main, ["run", str(spec), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1, r.output
    line = "spec.yaml:17:14: error[R024]: the loss is nan at step 2; the run stopped there"
    assert r.stderr.splitlines()[-2].endswith(line) and "Traceback" not in r.output
    assert line in (tmp_path / "run" / "run.log").read_text()
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_data_that_runs_out_is_named_with_the_step(tmp_path, two_cpu_spec):
    spec = tiny_spec(two_cpu_spec, n=2)
    r = CliRunner().invoke(main, ["run", str(spec), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1, r.output
    assert ("error[R025]: the data iterator is exhausted at step 3: it gave 2 batches, training needs 4; "
            "the run stopped there") in r.stderr
    assert "StopIteration" not in r.output


def workers_of(program: Path) -> list[int]:
    """The pids of processes running `program` (this test's run directory's, so ours alone)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(program).encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGKILL, -9)])
def test_a_signalled_run_ends_its_workers(tmp_path, two_cpu_spec, sig, code):
    """Ctrl-C / SIGTERM: one line, run.log says it, exit 130 / 143. SIGKILL: placer cannot stop its
    workers itself; the kernel does (PR_SET_PDEATHSIG). No worker outlives the run in any case."""
    spec = tiny_spec(two_cpu_spec, steps=100000)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-m", "placer.cli.main", "run", str(spec), "--run-dir", str(run_dir)],
                            cwd=tmp_path, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        for line in proc.stderr:  # progress goes to stderr: wait for the first step
            if line.startswith("step 1/") or time.monotonic() > deadline:
                break
        assert workers_of(run_dir / "program.py"), "no worker running"
        proc.send_signal(sig)
        rest = proc.stderr.read()  # ends when placer exits
        assert proc.wait(timeout=60) == code, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert wait_until(lambda: not workers_of(run_dir / "program.py"), 20), "a worker outlived placer"
    if sig != signal.SIGKILL:
        line = rest.strip().splitlines()[-1]
        assert line.startswith("interrupted at step ") and line.endswith(f"; run directory kept: {run_dir}"), rest
        assert "Traceback" not in rest and "SignalException" not in rest
        assert (run_dir / "run.log").read_text().splitlines()[-1] == line
