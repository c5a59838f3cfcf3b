"""`placer run` under faults a user meets: a non-finite loss, data that runs out, Ctrl-C and
SIGTERM. Tiny 2-rank CPU runs; every wait is bounded and only the processes a test started
are signalled."""
from __future__ import annotations

import os
import re
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
    proc = h.placer_run_popen(str(spec), "--run-dir", str(run_dir),
                              cwd=tmp_path, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
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


# ---------------------------------------------------------------------------- hangs

SLOW_DATA = '''
import os
import re
import time

import torch


def make_batches(seconds=0.2, stall_rank=None, stall_step=None):
    g = torch.Generator().manual_seed(0)
    step = 0
    while True:
        time.sleep(seconds)  # slow enough for the test to stop a rank mid-run
        if step == stall_step and os.environ.get("RANK") == str(stall_rank):
            time.sleep(3600)  # this rank hangs in its own code
        yield torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        step += 1
'''

TIMEOUT_S = 8
HANG_MODES = {  # relu=True: fc1, act, head
    "data": '  - {layers: fc1..head, devices: [cpu, "cpu:1"], parallel: data}',
    "layerwise": '  - {layers: fc1..act, device: cpu}\n  - {layers: head, device: "cpu:1"}',
    "pipeline": '  - {layers: fc1..act, device: cpu}\n  - {layers: head, device: "cpu:1"}\n'
                'pipeline: {microbatches: 2, schedule: 1f1b}',
    "tensor": '  - {layers: fc1..head, devices: [cpu, "cpu:1"], parallel: tensor}',
    "fsdp": '  - {layers: fc1..head, devices: [cpu, "cpu:1"], parallel: {mode: data, shard: full}}',
}


def hung_run(tmp_path: Path, spec: Path, stop_rank: int | None, sig=signal.SIGSTOP) -> tuple[int, str, float]:
    """`placer run spec`; once step 2 is done, send `sig` to rank `stop_rank` (None: none). (exit
    code, stderr, seconds from the signal, or from step 2, to the exit)."""
    run_dir = tmp_path / "run"
    proc = h.placer_run_popen(str(spec), "--run-dir", str(run_dir),
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pid = None
    try:
        progress = run_dir / "progress.jsonl"
        assert wait_until(lambda: progress.exists() and '"step": 2,' in progress.read_text(), 180), "no step 2"
        if stop_rank is not None:
            pid = h.worker(run_dir / "program.py", stop_rank)
            assert pid, f"rank {stop_rank} is not running"
            os.kill(pid, sig)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=120)
        return proc.returncode, err, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if pid and h.worker(run_dir / "program.py", stop_rank) == pid:  # still ours: never leave it stopped
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("mode", list(HANG_MODES))
def test_a_stopped_rank_is_named_and_the_run_ends_within_the_timeout(mode, tmp_path, two_cpu_spec):
    """SIGSTOP rank 1: rank 0 times out after timeout_s, and the one report names rank 1, its
    step and phase, and what rank 0 waited in. The stopped rank is killed at once: torch
    elastic's SIGTERM grace alone (30 s) would go past the bound."""
    spec = two_cpu_spec("hang", SLOW_DATA, steps=100000, timeout_s=TIMEOUT_S, relu=True,
                        placement=HANG_MODES[mode], training="  prefetch: 0\n")
    code, err, seconds = hung_run(tmp_path, spec, stop_rank=1)
    assert code == 1, err
    assert seconds < TIMEOUT_S + 15, (seconds, err)
    errors = [line for line in err.splitlines() if "error[" in line]
    assert len(errors) == 1 and "error[R034]" in errors[0], err
    assert re.search(r"error\[R034\]: rank 1 \(cpu:1\) stopped answering at step \d+ in [a-z0-9 ()]+; "
                     rf"rank 0 \(cpu\) waited at step \d+ in .+ and timed out after {TIMEOUT_S} s$", errors[0]), err
    assert "its process was stopped (SIGSTOP or Ctrl-Z: state T) and placer killed it" in err
    assert errors[0] in (tmp_path / "run" / "run.log").read_text() and "Traceback" not in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_hung_in_its_own_code_is_named_by_its_status(tmp_path, two_cpu_spec):
    """Rank 1 sleeps inside the data function at step 4 (not stopped): rank 0 times out, and
    the report names rank 1 as the one whose status did not advance, in its data phase."""
    spec = two_cpu_spec("hang", SLOW_DATA, steps=100000, timeout_s=TIMEOUT_S, relu=True, placement=HANG_MODES["data"],
                        training="  prefetch: 0\n", data_kwargs={"stall_rank": 1, "stall_step": 3})
    code, err, seconds = hung_run(tmp_path, spec, stop_rank=None)
    assert code == 1, err
    assert "error[R034]: rank 1 (cpu:1) stopped answering at step 4 in data; rank 0 (cpu) waited at step 4 in " \
           f"loss and backward (all_reduce over ranks 0, 1) and timed out after {TIMEOUT_S} s" in err, err
    assert "its status did not advance" in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sigkilled_rank_is_named_first_with_its_measured_peak_memory(tmp_path, two_cpu_spec):
    """What the out-of-memory killer does: SIGKILL rank 1 of a DDP run. Rank 1 is the failure (not
    rank 0, whose all-reduce lost it), with the peak memory it had reached and the plan's estimate."""
    spec = two_cpu_spec("kill", SLOW_DATA, steps=100000, timeout_s=30, relu=True, placement=HANG_MODES["data"],
                        training="  prefetch: 0\n")
    code, err, _ = hung_run(tmp_path, spec, stop_rank=1, sig=signal.SIGKILL)
    assert code == 1, err
    lines = err[err.index("error[R020]"):].splitlines()
    assert lines[0] == "error[R020]: rank 1 (cpu:1) was stopped by SIGKILL", err
    assert re.fullmatch(r"  \(SIGKILL is what the out-of-memory killer sends; its peak memory by step \d+ was "
                        r"[\d.]+ [KMG]iB \(the plan's estimate: [\d.]+ [KMG]?i?B\): see the plan's memory for this "
                        r"device\)", lines[1]), err
    # rank 0 is one short line: its all-reduce lost the peer, or (a loaded machine) the launcher
    # stopped it first
    assert re.match(r"  it took down: rank 0 \(cpu\), (lost a peer|stopped by SIGTERM)", lines[2]), err


EXIT_DATA = '''
import os

import torch


def make_batches(exit_step=2):
    g = torch.Generator().manual_seed(0)
    for step in range(10**9):
        if step == exit_step and os.environ.get("RANK") == "1":
            os._exit(3)  # no exception, no word: what a native crash or a stray os._exit leaves
        yield torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
'''


def test_a_rank_that_exits_without_a_word_is_not_shown_a_log_line_as_its_exception(tmp_path, two_cpu_spec):
    spec = two_cpu_spec("exit", EXIT_DATA, steps=6, timeout_s=30, placement=HANG_MODES["data"],
                        training="  prefetch: 0\n")
    r = CliRunner().invoke(main, ["run", str(spec), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1, r.output
    assert ("error[R020]: rank 1 (cpu:1) exited with code 3 at step 3 in data without a word (no exception: "
            "os._exit, or native code)\n") in r.stderr, r.stderr
    assert "simulating" not in r.stderr.split("error[R020]")[1]
