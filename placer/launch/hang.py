"""A rank that stopped answering: who it was and what it was doing, and no wait for it.

Each worker keeps its step, phase and communication call in RUN_DIR/status/rankR (the
program's `RankStatus`). When its peers time out waiting for it, torch's launcher sends every
worker SIGTERM and gives it 30 s to end; a stopped process (SIGSTOP, state T) cannot end until
continued, so `Watchdog` kills it at once. `hang_of` then names the rank that stopped
answering: the stopped one, else the one whose status is oldest among those that did not time
out themselves.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

STATUS_DIR = "status"

_TIMED_OUT = re.compile(r"timed out|timeout|deadline exceeded", re.IGNORECASE)
_ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""Signals the launcher ends its workers with: pending on a stopped worker, it is being ended."""


@dataclass(frozen=True)
class Hang:
    """A hang report: the rank that stopped answering and the ranks that waited for it."""

    rank: int
    doing: str
    """Its step and what it was doing: `at step 3 in forward (send to rank 1)`."""
    stopped: bool
    """Its process was seen stopped (state T) and was killed."""
    waiters: list[tuple[int, str]]
    """(rank, what it was doing) of each rank that timed out waiting."""


def read_statuses(run_dir: Path) -> dict[int, dict]:
    """rank -> its last status (pid, rank, step, seq, time, peak, phase, op; peak: its peak memory
    in bytes as its last step started); unreadable files are left out."""
    found = {}
    for path in (run_dir / STATUS_DIR).glob("rank*"):
        with contextlib.suppress(OSError, ValueError):
            line = path.read_bytes().split(b"\n", 1)[0].decode()
            pid, rank, step, seq, when, peak, phase, op = line.split("\t")
            found[int(rank)] = {"pid": int(pid), "rank": int(rank), "step": int(step), "seq": int(seq),
                                "time": float(when), "peak": int(peak), "phase": phase, "op": op}
    return found


def doing(record: dict | None) -> str:
    """`at step 3 in backward (all_reduce over ranks 0, 1)` ("" when unknown)."""
    if not record:
        return ""
    where = f"at step {record['step']} in {record['phase']}" if record.get("step") else f"in {record.get('phase')}"
    return where + (f" ({record['op']})" if record.get("op") else "")


def proc_state(pid: int) -> tuple[str, int, int] | None:
    """(state letter, parent pid, pending signals mask) of a live process, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    pending = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            pending |= int(line.split()[1], 16)
    return fields[0], int(fields[1]), pending


class Watchdog(threading.Thread):
    """Polls the workers of this launcher (its children named in the status files): remembers
    each one seen stopped (state T), with its status then, and kills a stopped one as soon as
    a signal that ends it is pending, so the launcher does not wait out its grace period."""

    def __init__(self, run_dir: Path, interval: float = 0.2):
        super().__init__(daemon=True)
        self.run_dir, self.interval = run_dir, interval
        self.stopped: dict[int, dict] = {}  # pid -> its status record when first seen stopped
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            with contextlib.suppress(Exception):  # a watchdog must never end the run
                self.look()

    def look(self) -> None:
        for record in read_statuses(self.run_dir).values():
            pid = int(record.get("pid", 0))
            state = proc_state(pid) if pid > 0 else None
            if state is None or state[1] != os.getpid() or state[0] != "T":
                continue
            self.stopped.setdefault(pid, record)
            if any(state[2] & (1 << (s - 1)) for s in _ENDING):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        self.done.set()
        if self.is_alive():
            self.join(timeout=2)


def hang_of(failures: dict[int, tuple[int | None, str, int | None]], statuses: dict[int, dict],
            stopped_pids: set[int]) -> Hang | None:
    """The hang behind a failed attempt, or None if no rank timed out. `failures`: global rank
    -> (exit code, tail of its stderr, pid); `statuses` from read_statuses, after the failure."""
    def status(rank: int) -> dict | None:
        record = statuses.get(rank)
        pid = failures.get(rank, (None, "", None))[2]
        return record if record and (pid is None or record.get("pid") == pid) else None  # this attempt's

    waiters = sorted(r for r, (code, tail, _) in failures.items() if code and code > 0 and _TIMED_OUT.search(tail))
    if not waiters:
        return None
    ranks = set(failures) | set(statuses)
    stopped = [r for r in sorted(ranks) if (status(r) or {}).get("pid") in stopped_pids]
    if stopped:
        culprit = stopped[0]
    else:
        others = [r for r in ranks if r not in waiters and status(r)]
        if not others:
            return None  # every rank we see timed out: the one they waited for is elsewhere
        culprit = min(others, key=lambda r: (status(r) or {}).get("time", 0.0))
    return Hang(culprit, doing(status(culprit)), bool(stopped), [(r, doing(status(r))) for r in waiters])
