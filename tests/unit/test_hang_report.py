"""The hang report: which rank stopped answering (hang_of), and the watchdog that kills a
stopped worker as soon as the launcher ends it, instead of after torch elastic's grace."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from placer.launch.hang import Watchdog, doing, hang_of, read_statuses

TIMED_OUT = "RuntimeError: [unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"


def record(rank, pid, step, phase, op="", t=0.0, peak=0):
    return {"pid": pid, "rank": rank, "step": step, "phase": phase, "op": op, "seq": 1, "time": t, "peak": peak}


def write_status(run_dir: Path, rec: dict) -> None:
    """As the program's RankStatus writes it: one tab-separated line in a 512-byte file."""
    (run_dir / "status").mkdir(parents=True, exist_ok=True)
    line = "\t".join(str(rec[k]) for k in ("pid", "rank", "step", "seq", "time", "peak", "phase", "op")) + "\n"
    (run_dir / "status" / f"rank{rec['rank']}").write_bytes(line.encode().ljust(512, b"\0"))


def test_the_stopped_rank_is_named_not_the_one_that_waited():
    statuses = {0: record(0, 10, 3, "loss and backward", "all_reduce over ranks 0, 1", t=5.0),
                1: record(1, 11, 3, "forward", t=1.0)}
    failures = {0: (1, TIMED_OUT, 10), 1: (-9, "", 11)}
    hang = hang_of(failures, statuses, stopped_pids={11})
    assert hang is not None and hang.rank == 1 and hang.stopped
    assert hang.doing == "at step 3 in forward"
    assert hang.waiters == [(0, "at step 3 in loss and backward (all_reduce over ranks 0, 1)")]


def test_without_a_stopped_process_the_rank_whose_status_is_oldest_is_named():
    statuses = {0: record(0, 10, 4, "forward", "send to rank 1", t=9.0), 1: record(1, 11, 4, "data", t=2.0),
                2: record(2, 12, 4, "forward", "recv from rank 1", t=9.5), 3: record(3, 13, 4, "forward", t=8.0)}
    failures = {0: (1, TIMED_OUT, 10), 1: (-15, "", 11), 2: (1, TIMED_OUT, 12), 3: (-15, "", 13)}
    hang = hang_of(failures, statuses, stopped_pids=set())
    assert hang is not None and (hang.rank, hang.stopped, hang.doing) == (1, False, "at step 4 in data")
    assert [r for r, _ in hang.waiters] == [0, 2]


def test_no_timeout_no_hang_and_stale_statuses_are_ignored():
    statuses = {0: record(0, 10, 2, "forward"), 1: record(1, 99, 7, "data")}  # rank 1's is an earlier attempt's
    assert hang_of({0: (1, "ValueError: boom", 10), 1: (-15, "", 11)}, statuses, set()) is None
    hang = hang_of({0: (1, TIMED_OUT, 10), 1: (-15, "", 11)}, statuses, set())
    assert hang is None  # the one rank it could be has no status of this attempt: not guessed


def test_status_files_are_read_back(tmp_path):
    write_status(tmp_path, record(1, 11, 3, "forward", "isend to rank 0"))
    (tmp_path / "status" / "rank0").write_bytes(b"12\t0\t3")  # torn: left out
    assert doing(read_statuses(tmp_path)[1]) == "at step 3 in forward (isend to rank 0)"
    assert list(read_statuses(tmp_path)) == [1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stopped_worker_is_killed_once_it_is_asked_to_end(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watchdog = Watchdog(tmp_path, interval=0.05)
    try:
        write_status(tmp_path, record(0, child.pid, 3, "forward"))
        child.send_signal(signal.SIGSTOP)
        watchdog.start()
        time.sleep(0.5)
        assert child.poll() is None and child.pid in watchdog.stopped  # stopped alone: left alone
        child.send_signal(signal.SIGTERM)  # pending until continued: torch elastic would wait 30 s
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        watchdog.stop()
        if child.poll() is None:
            child.kill()
            child.wait(timeout=5)


def test_a_hang_report_names_the_stopped_rank_first():
    from types import SimpleNamespace

    from placer.cli.failures import hang_report, restart_lines
    from placer.launch.hang import Hang

    spec = SimpleNamespace(file="spec.yaml", runtime=SimpleNamespace(timeout_s=20.0, loc=None),
                           training=SimpleNamespace(checkpoint=object()))
    devices = ["cpu", "cpu:1", "cpu:2"]
    hang = Hang(1, "at step 3 in forward", True, [(0, "at step 3 in backward (all_reduce over ranks 0, 1, 2)"),
                                                    (2, "at step 3 in backward (all_reduce over ranks 0, 1, 2)")])
    sentence = ("rank 1 (cpu:1) stopped answering at step 3 in forward; rank 0 (cpu) waited at step 3 in backward "
                "(all_reduce over ranks 0, 1, 2) (as did rank 2 (cpu:2)) and timed out after 20 s")
    diag = hang_report(spec, devices, Path("run"), hang)
    assert (diag.code, diag.message) == ("R034", sentence) and "placer killed it" in diag.hint
    failures = {0: (1, TIMED_OUT), 1: (-9, ""), 2: (1, TIMED_OUT)}
    assert restart_lines(spec, devices, 1, 2, failures, 3, hang) == [
        "attempt 1 of 2 failed after step 3:", f"  {sentence}",
        "restarting: attempt 2 of 2, from the newest complete checkpoint"]


def test_the_restart_report_still_hooks_into_this_torch():
    """torch's elastic agent has no public hook for a restart: placer wraps two of its methods.
    When a torch release renames them, restarts still happen but unreported: fail here instead."""
    import inspect

    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from placer.launch.run import RunResult, _restarts_reported

    monitor, restart = LocalElasticAgent._monitor_workers, SimpleElasticAgent._restart_workers
    for method in (monitor, restart):
        assert list(inspect.signature(method).parameters) == ["self", "worker_group"]
    with _restarts_reported(Path("run"), ["cpu", "cpu:1"], 1, RunResult(ok=True, run_dir=Path("run")), None,
                            Watchdog(Path("run"))):
        assert LocalElasticAgent._monitor_workers is not monitor
        assert SimpleElasticAgent._restart_workers is not restart
    assert (LocalElasticAgent._monitor_workers, SimpleElasticAgent._restart_workers) == (monitor, restart)


def test_what_the_program_writes_is_what_placer_reads(tmp_path):
    """The program's RankStatus (pasted from templates/helpers.py) and read_statuses agree."""
    import functools
    import mmap
    import os

    import torch.distributed as dist

    from placer.codegen.program import TEMPLATES

    text = (TEMPLATES / "helpers.py").read_text()
    namespace = {"os": os, "mmap": mmap, "time": time, "functools": functools, "dist": dist,
                 "peak_memory": lambda: (12345, "peak_rss_above_import")}
    exec(text[text.index("class RankStatus:"):text.index("STATUS = RankStatus()")], namespace)
    status = namespace["RankStatus"]()
    (tmp_path / "status").mkdir()
    with open(tmp_path / "status" / "rank2", "wb+") as f:
        f.truncate(status.SIZE)
        status.map, status.rank = mmap.mmap(f.fileno(), status.SIZE), 2  # open() without wrapping dist's calls
    status.at(6, "backward")
    status.calling("all_reduce over ranks 0, 1, 2")
    status.at(7, "data")  # a shorter line over a longer one
    assert doing(read_statuses(tmp_path)[2]) == "at step 8 in data"
    status.calling("recv from rank 1")
    read = read_statuses(tmp_path)[2]
    assert (read["pid"], read["seq"], doing(read)) == (os.getpid(), 4, "at step 8 in data (recv from rank 1)")
    assert read["peak"] == 12345  # taken as the step started (data), for the report of a SIGKILL
