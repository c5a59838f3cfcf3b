"""What `placer run` says when workers fail: one report naming the rank that failed first, its
device and its exception (type and whole message, once, with every rank that raised the same),
the ranks that failed otherwise by themselves, and the ranks it took down (R020);
or, when ranks timed out, the rank that stopped answering and what it was doing (R034)."""
from __future__ import annotations

import re
import signal
from pathlib import Path

from placer.diagnostics import Diagnostic, Loc

_FRAME = re.compile(r'\s*File ".*", line \d+')
_LOG_LINE = re.compile(r"^\[?[WEIF]\d{4} |^Traceback \(most recent call last\)")  # torch's C++ log, a new traceback
# a rank that failed because a peer did: its collective or copy lost the other side
_PEER = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|DistBackendError|"
                   r"NCCL communicator was aborted|ProcessGroupGloo.*(closed|reset)|Socket closed|"
                   r"Got the following error when running the callback")
# what the program prints of its own (templates: train's simulation notice, report_step, resume_checkpoint)
_OWN = re.compile(r"simulating \d+ devices as CPU workers|step \d+/\d+  loss|resuming from the checkpoint|"
                  r"no usable checkpoint|rank \d+: the checkpoint at step")
MOST = 200
"""Lines of a message shown at most (a module's repr is whole well inside it)."""


def exception_of(tail: str) -> list[str]:
    """The last traceback's exception line (`ValueError: ...`) and the rest of its message,
    whole; [] when the output holds no traceback."""
    lines = tail.splitlines()
    frames = [i for i, line in enumerate(lines) if _FRAME.match(line)]
    if not frames:
        return []
    i = frames[-1] + 1
    while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):  # source line, ^^^ marks
        i += 1
    end = i + 1
    while end < len(lines) and not _LOG_LINE.match(lines[end]):
        end += 1
    return [line for line in lines[i:end] if line.strip()]


def last_lines(tail: str, most: int = 8) -> list[str]:
    """The output's last `most` lines, leaving out the program's own notices (the simulation
    line, steps, resuming): before an os._exit they would read as its exception."""
    return [line for line in tail.splitlines() if line.strip() and not _OWN.match(line)][-most:]


def excerpt(tail: str, most: int = 8) -> list[str]:
    """Why a rank failed: its exception (cut to `most` lines), else its last `most` lines."""
    shown = exception_of(tail)
    if not shown:
        return last_lines(tail, most)
    if len(shown) > most > 1:
        shown = shown[:most - 1] + [f"... ({len(shown) - most + 1} more lines)"]
    return shown[:most]


def failures_in_order(failures: dict[int, tuple[int | None, str]]) -> list[tuple[int, tuple[int | None, str]]]:
    """The likely cause first: a rank that exited with an error of its own, then one killed by a
    signal of its own (SIGABRT, SIGSEGV, SIGKILL: what the out-of-memory killer sends), whose
    death makes its peers fail, then one that lost a peer, then those the launcher stopped with
    SIGTERM because a peer had failed; by rank within each."""
    return sorted(failures.items(), key=lambda kv: (_kind(*kv[1]), kv[0]))


def _kind(code: int | None, tail: str) -> int:
    """0: an error of its own; 1: a signal of its own; 2: lost a peer; 3: stopped by the launcher."""
    if code is not None and code > 0:
        return 2 if _PEER.search("\n".join(exception_of(tail))) else 0
    return 3 if code == -signal.SIGTERM else 1


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _how(code: int | None) -> str:
    return f"was stopped by {signal_name(-code)}" if code is not None and code < 0 else f"exited with code {code}"


def failure_report(spec, devices, run_dir: Path, failures: dict[int, tuple[int | None, str]],
                   statuses: dict[int, dict] | None = None, planned: dict[str, int] | None = None) -> Diagnostic:
    """R020: the first failing rank's exception once, whole, with every rank that raised the same
    (`ranks 0 (cpu:0) and 1 (cpu:1) exited with code 1: ...`); then ranks that failed by
    themselves with another exception, and the ranks it took down (lost a peer, or stopped).
    `statuses` (hang.read_statuses): where a rank that left no exception was, and the peak
    memory of one SIGKILL took; `planned`: device -> the plan's estimate beside it."""
    from placer import units
    from placer.launch.hang import doing
    from placer.launch.logs import log_name

    def device(rank: int) -> str:
        return devices[rank] if 0 <= rank < len(devices) else "?"

    (first, (code, tail)), *rest = failures_in_order(failures)
    error = exception_of(tail)
    same = [r for r, (c, t) in rest if error and c == code and exception_of(t) == error]
    rest = [(r, ct) for r, ct in rest if r not in same]
    if len(error) > MOST:
        error = error[:MOST] + [f"... ({len(error) - MOST} more lines in the log)"]
    who = [f"{r} ({device(r)})" for r in [first, *same]]
    status = (statuses or {}).get(first)
    text = (f"rank {who[0]}" if not same else f"ranks {', '.join(who[:-1])} and {who[-1]}") + f" {_how(code)}"
    shown = error or last_lines(tail)
    if shown and not (code == -signal.SIGTERM and not error):
        text += f": {shown[0]}" + "".join(f"\n    {line}" for line in shown[1:])
    elif code is not None and code > 0:  # os._exit: nothing said
        text += f"{' ' + doing(status) if status else ''} without a word (no exception: os._exit, or native code)"

    def other(rank: int, code: int | None, tail: str) -> str:
        if _kind(code, tail) == 2:  # one short line: the collective lost the rank that failed
            lost = _PEER.search("\n".join(exception_of(tail)))
            return f"rank {rank} ({device(rank)}), lost a peer ({lost.group(0) if lost else 'its collective failed'})"
        why = excerpt(tail, 1) if code is not None and code > 0 else []
        how = _how(code).removeprefix("was ")
        return f"rank {rank} ({device(rank)}), {how}" + (f" ({why[0].strip()})" if why else "")
    if code == -signal.SIGKILL:
        peak = f"; its peak memory by step {status['step']} was {units.size(status['peak'])}" \
            if status and status.get("peak") else ""
        estimate = (planned or {}).get(device(first))
        plan = f" (the plan's estimate: {units.size(estimate)})" if peak and estimate is not None else ""
        text += f"\n  (SIGKILL is what the out-of-memory killer sends{peak}{plan}: see the plan's memory for this device)"
    own = [(r, ct) for r, ct in rest if _kind(*ct) in (0, 1)]  # an error or signal of its own, not a lost peer
    if own:
        text += "\n  also failed by itself: " + "; ".join(other(r, c, t) for r, (c, t) in own)
    if len(own) < len(rest):
        text += "\n  it took down: " + "; ".join(other(r, c, t) for r, (c, t) in rest if (r, (c, t)) not in own)
    return Diagnostic("R020", text, Loc(spec.file),
                      f"its whole output is in {run_dir / 'logs' / log_name(device(first))}")


def hang_sentence(spec, devices, hang) -> str:
    """`rank 1 (cpu:1) stopped answering at step 3 in forward; rank 0 (cpu) waited at step 3 in
    backward (all_reduce over ranks 0, 1) and timed out after 20 s`."""
    def who(rank: int) -> str:
        return f"rank {rank} ({devices[rank] if 0 <= rank < len(devices) else '?'})"

    (first, where), *more = hang.waiters
    waited = f"{who(first)} waited" + (f" {where}" if where else "")
    if more:
        waited += f" (as did {', '.join(who(r) for r, _ in more)})"
    return (f"{who(hang.rank)} stopped answering{' ' + hang.doing if hang.doing else ''}; "
            f"{waited} and timed out after {spec.runtime.timeout_s:g} s")


def hang_report(spec, devices, run_dir: Path, hang) -> Diagnostic:
    """R034: one report for a hang, the rank that stopped answering and where, then who waited for it."""
    how = ("its process was stopped (SIGSTOP or Ctrl-Z: state T) and placer killed it" if hang.stopped else
           "its status did not advance (a hang in its own code or a peer it waits for)")
    return Diagnostic("R034", hang_sentence(spec, devices, hang), spec.runtime.loc,
                      f"{how}; every rank's output is under {run_dir / 'logs'}; runtime.timeout_s bounds the wait")


def restart_lines(spec, devices, attempt: int, attempts: int, failures: dict, step: int, hang=None) -> list[str]:
    """What an attempt that failed and is restarted says: the ranks that failed and how (or the
    rank the others timed out waiting for), and where the next attempt continues."""
    lines = [f"attempt {attempt} of {attempts} failed after step {step}:"]
    for rank, (code, tail) in [] if hang else failures_in_order(failures):
        device = devices[rank] if 0 <= rank < len(devices) else "?"
        if code is not None and code < 0:
            how = f"was killed by {signal_name(-code)}"
        else:
            last = next((line.strip() for line in excerpt(tail, 1)), "")
            how = f"exited with code {code}" + (f": {last}" if last else "")
        lines.append(f"  rank {rank} ({device}) {how}")
    if hang:
        lines.append(f"  {hang_sentence(spec, devices, hang)}")
    where = "from the newest complete checkpoint" if spec.training.checkpoint else \
        "at step 0 (no training.checkpoint)"
    lines.append(f"restarting: attempt {attempt + 1} of {attempts}, {where}")
    return lines
