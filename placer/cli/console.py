"""How the command line talks: -q / -v on every command, colour, and `placer run`'s progress.

Every command takes -q (only errors, warnings and the final result) and -v (more detail; -vv more
still). Colour goes to a terminal only (click strips it elsewhere) and never under NO_COLOR
(https://no-color.org). Progress is rich's bar on a terminal, plain lines otherwise.
"""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import click

RESULT, INFO, DETAIL = -1, 0, 1
"""Levels of a line: RESULT shows even under -q, INFO unless -q, DETAIL under -v."""


def _store(key):
    def callback(ctx, param, value):
        ctx.meta[key] = value
    return callback


def verbosity_options(f):
    """-q / -v, read back with verbosity()."""
    f = click.option("-v", "--verbose", count=True, expose_value=False, callback=_store("placer.verbose"),
                     help="More detail (torch elastic's log lines, per-rank figures, timings); -vv more.")(f)
    return click.option("-q", "--quiet", is_flag=True, expose_value=False, callback=_store("placer.quiet"),
                        help="Only errors, warnings and the final result.")(f)


def verbosity() -> int:
    """-1 under -q, 0 by default, N under -v x N."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return 0
    quiet, verbose = ctx.meta.get("placer.quiet", False), ctx.meta.get("placer.verbose", 0)
    if quiet and verbose:
        raise click.UsageError("-q and -v contradict each other: give one")
    return -1 if quiet else verbose


def echo(text: str = "", level: int = INFO, err: bool = False) -> None:
    """Print `text` if the verbosity asks for its level."""
    if verbosity() >= level:
        click.echo(text, err=err)


def colour() -> bool:
    """Whether styles may be written: not under NO_COLOR (any non-empty value). click.echo
    strips them anyway where the stream is not a terminal."""
    return not os.environ.get("NO_COLOR")


_SEVERITY = re.compile(r"\b(error|warning)\[([A-Z]\d{3})\]")
_HINT = re.compile(r"^(\s*)(hint:)", re.M)


def paint(report: str) -> str:
    """A text report of diagnostics with its severities, codes and hints coloured."""
    if not colour():
        return report

    def severity(m):
        return click.style(m.group(0), fg="red" if m.group(1) == "error" else "yellow", bold=True)
    report = _SEVERITY.sub(severity, report)
    return _HINT.sub(lambda m: m.group(1) + click.style(m.group(2), fg="cyan", bold=True), report)


def clock(seconds: float) -> str:
    """0:07, 12:34, 1:02:03."""
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class RunConsole:
    """What `placer run` prints, also kept in RUN_DIR/run.log. Progress goes to stderr: rich's
    bar on a terminal (elapsed, ETA, steps/s, loss), else a plain line a second."""

    def __init__(self, quiet: bool, level: int = 0, tty: bool | None = None):
        self.quiet = quiet  # json: stdout carries only the final object
        self.level = level  # verbosity(): -1 (-q), 0, 1 (-v)
        self.log: list[str] = []
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.last = 0.0
        self.step = 0  # the last step reported
        self.first = 0  # the step this attempt started from (resumed runs)
        self.said_interrupted = False
        self.append = False  # a resumed run adds to the run.log it finds
        self.log_name = "run.log"  # a cluster job's node K > 0: job/node-K.log (node 0 writes run.log)
        self.bar: Any = None  # rich.progress.Progress while a bar is shown
        self.task: Any = None

    def say(self, line: str = "", err: bool = False, level: int = INFO) -> None:
        self.log.append(line)
        if err or (not self.quiet and self.level >= level):
            self.end_bar()
            click.echo(paint(line) if err else line, err=err)

    def progress(self, record: dict) -> None:
        if "resumed_from" in record:  # the program says where it continues
            first = record["resumed_from"]
            self.step = self.first = first
            for bad in record.get("passed_over", []):  # damaged, truncated or unreadable: which file, and instead
                instead = f"the checkpoint at step {first}" if first else "step 0"
                self.say(f"the checkpoint at step {bad['step']} is not usable: {bad['dir']}/{bad['why']}; "
                         f"resuming from {instead} instead", err=True)
            resharded = f", resharded from {record['resharded_from']} ranks" if record.get("resharded_from") else ""
            self.say(f"resumed from the checkpoint at step {first} of {record.get('steps')}{resharded}" if first else
                     "no usable checkpoint: starting at step 0")
            return
        step, steps = record.get("step", 0), record.get("steps", 0)
        self.step = step
        elapsed = record.get("elapsed_s", 0.0)
        rate = (step - self.first) / elapsed if elapsed else 0.0
        eta = (steps - step) / rate if rate else 0.0
        loss = record.get("loss", float("nan"))
        text = f"step {step}/{steps}  loss {loss:.6f}  {rate:.2f} steps/s  " \
               f"{record.get('samples_per_s', 0):.0f} samples/s  elapsed {clock(elapsed)}  eta {clock(eta)}"
        self.log.append(text)
        if self.level < 0 or self.quiet and not self.tty:
            return
        if self.tty:
            self.show_bar(step, steps, loss, rate)
        elif step in (1, steps) or time.monotonic() - self.last >= 1.0:
            click.echo(text, err=True)
            self.last = time.monotonic()

    def show_bar(self, step: int, steps: int, loss: float, rate: float) -> None:
        if self.bar is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                                TextColumn("eta"), TimeRemainingColumn(),
                                TextColumn("{task.fields[rate]:.2f} steps/s  loss {task.fields[loss]:.6f}"),
                                console=Console(stderr=True), transient=False)
            self.task = self.bar.add_task("train", total=steps, completed=step, rate=rate, loss=loss)
            self.bar.start()
        else:
            self.bar.update(self.task, completed=step, rate=rate, loss=loss)
        if step == steps:
            self.end_bar()

    def end_bar(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def save(self, run_dir: Path) -> None:
        try:
            with open(run_dir / self.log_name, "a" if self.append else "w") as f:
                f.write("\n".join(self.log) + "\n")
        except OSError:  # a full disk: the error being reported already says so
            pass
