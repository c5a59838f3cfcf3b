"""`placer run`: generate the program into a run directory and launch it, one worker per device."""
from __future__ import annotations

import errno
import gc
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from placer import units
from placer.cli.options import set_option
from placer.device import Device
from placer.diagnostics import Diagnostic, Loc, PlacerError, RunError


class Console:
    """What the run prints, also kept in RUN_DIR/run.log. Progress goes to stderr."""

    def __init__(self, quiet: bool):
        self.quiet = quiet  # json: stdout carries only the final object
        self.log: list[str] = []
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.step = 0  # the last step reported
        self.said_interrupted = False
        self.append = False  # a resumed run adds to the run.log it finds

    def say(self, line: str = "", err: bool = False) -> None:
        self.log.append(line)
        if not self.quiet or err:
            click.echo(line, err=err)

    def progress(self, record: dict) -> None:
        """A progress bar on a terminal; otherwise a line per second (and the first and last step)."""
        if "resumed_from" in record:  # the program says where it continues
            first = record["resumed_from"]
            self.step = first
            self.say(f"resumed from the checkpoint at step {first} of {record.get('steps')}" if first else
                     "no usable checkpoint: starting at step 0")
            return
        step, steps = record.get("step", 0), record.get("steps", 0)
        self.step = step
        text = f"step {step}/{steps}  loss {record.get('loss', float('nan')):.6f}  " \
               f"{record.get('samples_per_s', 0):.0f} samples/s"
        self.log.append(text)
        if self.tty:
            done = int(24 * step / steps) if steps else 0
            click.echo(f"\r[{'=' * done}{' ' * (24 - done)}] {text}", err=True, nl=step == steps)
        elif step in (1, steps) or time.monotonic() - self.last >= 1.0:
            click.echo(text, err=True)
            self.last = time.monotonic()

    def save(self, run_dir: Path) -> None:
        try:
            with open(run_dir / "run.log", "a" if self.append else "w") as f:
                f.write("\n".join(self.log) + "\n")
        except OSError:  # a full disk: the error being reported already says so
            pass


def default_run_dir(name: str, node_rank: int) -> str:
    """The default run directory's name (launcher.claim_run_dir adds -2, -3, ... if it is taken)."""
    return f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}" + (f"-node{node_rank}" if node_rank else "")


def summary_lines(metrics: dict, wall_s: float, attempts: int = 1) -> list[str]:
    steps, sps = metrics.get("steps", 0), metrics.get("steps_per_s") or 0.0
    first = metrics.get("resumed_from") or 0
    what = f"trained {steps} steps" if not first else \
        f"trained steps {first + 1}..{steps} of {steps} (resumed from the checkpoint at step {first})"
    tries = f", {attempts} attempts" if attempts > 1 else ""
    lines = [f"{what}: {sps:.2f} steps/s, {metrics.get('samples_per_s') or 0:.0f} samples/s "
             f"({metrics.get('wall_s', 0):.2f} s training{' in the last attempt' if attempts > 1 else ''}, "
             f"{wall_s:.1f} s with start-up{tries})",
             f"{'device':<16} {'bytes sent':>12} {'compute s':>10} {'comm s':>8} {'data s':>8}"]
    times = metrics.get("time_s", {})
    for device in metrics.get("devices", []):
        t = times.get(device, {})
        lines.append(f"{device:<16} {units.size(metrics.get('bytes_sent', {}).get(device, 0)):>12} "
                     f"{t.get('compute', 0):>10.3f} {t.get('comm', 0):>8.3f} {t.get('data', 0):>8.3f}")
    lines.append("(bytes: payload this rank handed to send / collectives; comm: time in copies and "
                 "gradient syncs, waiting included; DDP's overlapped all-reduce and a pipeline schedule's sends "
                 "count as compute)")
    return lines


def check_lines(report) -> list[str]:
    lines = [f"check: the run against the one-device reference (rtol {report.rtol:g}, atol {report.atol:g})",
             f"  {'step':>5}  {'loss (run)':>14}  {'loss (reference)':>16}  {'|diff|':>9}"]
    steps = report.steps
    shown = set(range(len(steps))) if len(steps) <= 12 else set(range(5)) | set(range(len(steps) - 5, len(steps)))
    if report.first_bad_step is not None:
        shown.add(report.first_bad_step - 1)
    prev = -1
    for i in sorted(shown):
        if i != prev + 1:
            lines.append(f"  {'...':>5}")
        step, a, b, d, ok = steps[i]
        mark = "" if ok else "  <- differs" if math.isfinite(d) else "  <- non-finite"
        lines.append(f"  {step:>5}  {a:>14.8f}  {b:>16.8f}  {d:>9.2e}{mark}")
        prev = i
    worst = max(report.params, key=lambda p: p[2], default=None)
    if worst:
        lines.append(f"  parameters: {len(report.params)} compared, max |diff| {worst[2]:.2e} ({worst[0]})")
    if report.grads:
        g = max(report.grads, key=lambda g: g[2] / g[3] if g[3] else g[2])
        lines.append(f"  first-step gradients: {len(report.grads)} compared, worst {g[0]}: max |diff| {g[2]:.2e} "
                     f"of scale {g[3]:.2e}")
    for names in report.tied:
        lines.append(f"  tied: {' = '.join(names)} (each copy compared)")
    return lines


def check_failure(report) -> str:
    parts = []
    if report.problem:
        parts.append(report.problem)
    if report.first_bad_step is not None:
        s = report.steps[report.first_bad_step - 1]
        if math.isfinite(s[1]) and math.isfinite(s[2]):
            parts.append(f"the loss differs from step {s[0]} on ({s[1]:.8f} vs {s[2]:.8f})")
        else:  # "nan vs nan" would read as a mismatch of two equal values
            parts.append(f"the loss is non-finite at step {s[0]} (run {s[1]}, reference {s[2]})")
    if report.first_bad_param is not None:
        p = next(p for p in report.params if p[0] == report.first_bad_param)
        parts.append(f"parameter {p[0]!r} differs by up to {p[2]:.2e}" if math.isfinite(p[2]) else
                     f"parameter {p[0]!r} is non-finite (nan or inf) in the run or the reference")
    if report.first_bad_grad is not None:
        g = next(g for g in report.grads if g[0] == report.first_bad_grad)
        parts.append(f"the gradient of {g[0]!r} at step 1 differs by up to {g[2]:.2e} (its largest element "
                     f"is {g[3]:.2e})")
    return "; ".join(parts)


def check_hint(report) -> str:
    """What to look at: the tied parameter involved, else randomness or numerics."""
    for name in (report.first_bad_grad, report.first_bad_param):
        tie = report.tie_of(name)
        if tie:
            return (f"{name!r} is a tied parameter ({' = '.join(tie)}): every copy must get the sum of all "
                    "copies' gradients and take the same step; a copy trained on its own part of the gradient "
                    "drifts (see RUN_DIR/reference and the table above)")
    return ("see RUN_DIR/reference and the table above; a layer with randomness (Dropout) or a mode that changes "
            "numerics cannot match (--rtol/--atol loosen the tolerance)")


@click.command("run")
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False))
@click.option("--check", is_flag=True,
              help="Also train the one-device reference and compare every step's loss, every copy of every final "
                   "parameter and every first-step gradient.")
@click.option("--rtol", type=click.FloatRange(min=0), default=None,
              help="--check: relative tolerance (default 1e-5; first-step gradients: 10x it, of their own scale).")
@click.option("--atol", type=click.FloatRange(min=0), default=None, help="--check: absolute tolerance (default 4e-5).")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Default: runs/<name>-<YYYYmmdd-HHMMSS>/. An existing one must be empty (see --overwrite).")
@click.option("--overwrite", is_flag=True,
              help="Reuse a --run-dir that holds files: a previous run's outputs there are deleted first.")
@click.option("--steps", type=click.IntRange(min=1), help="Train this many steps instead of training.steps.")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Machines taking part; start `placer run` on each with its --node-rank.")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="This machine's index: it runs the spec's nodeK/ devices.")
@click.option("--rdzv-endpoint", metavar="HOST:PORT", help="Node 0's address, where the nodes meet (--nnodes > 1).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--max-restarts", type=click.IntRange(min=0),
              help="Restart a failed run up to N times (same as --set runtime.max_restarts=N); each "
                   "restart resumes from the newest complete checkpoint (step 0 without one).")
@click.option("--resume", "resume_dir", metavar="RUN_DIR", type=click.Path(file_okay=False),
              help="Continue the run in RUN_DIR from its newest complete checkpoint (training.checkpoint); "
                   "losses and final parameters are those of a run never interrupted.")
@set_option
def command(spec_path, check, rtol, atol, run_dir, overwrite, steps, nnodes, node_rank, rdzv_endpoint, fmt,
            max_restarts, resume_dir, overrides):
    """Generate SPEC's program into a run directory and launch it, one worker per device.

    Devices this machine lacks run as CPU workers on gloo when runtime.simulate is auto
    (the run says so). The run directory keeps program.py, spec.yaml, run.log, logs/ (each
    worker's output), progress.jsonl, metrics.json and final_params.pt; with --check also
    reference/ (the one-device run) and check.json.

    Ctrl-C (SIGINT) or SIGTERM stops the workers, says at which step, keeps the run
    directory and exits 130 or 143; workers also end if `placer run` is killed.
    `--resume RUN_DIR` then continues it from its newest complete checkpoint; with
    runtime.max_restarts (--max-restarts) a failed attempt is restarted the same way.

    \b
    Examples:
      placer run specs/mlp_group_transitions.yaml --check
      placer run spec.yaml --set training.batch_size=64 --max-restarts 2
      placer run spec.yaml --set training.checkpoint.every=10 --run-dir runs/a   # interrupted, then:
      placer run spec.yaml --resume runs/a
      placer run spec.yaml --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500   # on node 0
      placer run spec.yaml --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29500   # on node 1
    """
    from placer.cli.main import fail
    from placer.deps import require_torch

    require_torch("placer run")
    if nnodes > 1 and not rdzv_endpoint:
        raise click.UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if node_rank >= nnodes:
        raise click.UsageError(f"--node-rank {node_rank} is not below --nnodes {nnodes}")
    if max_restarts is not None:
        overrides += (f"runtime.max_restarts={max_restarts}",)
    if resume_dir and (run_dir or overwrite):
        raise click.UsageError("--resume RUN_DIR continues the run in RUN_DIR: leave out --run-dir and --overwrite")
    from placer.launch.run import Interrupted, interruptible

    console = Console(quiet=fmt == "json")
    try:
        with interruptible():
            outcome = run(spec_path, console, check=check, run_dir=run_dir, overwrite=overwrite, steps=steps,
                          nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, overrides=overrides,
                          resume=resume_dir, tolerance=(rtol, atol))
    except Interrupted as e:  # run() said where; exit as a shell does for a process the signal ended
        if not console.said_interrupted:
            console.say("interrupted before the run started", err=True)
        # everything is said and saved: leave without interpreter shutdown, where a second Ctrl-C
        # or a dying thread's finalizer printed "Exception ignored in: ..." after our one line
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + e.signum)
    except PlacerError as e:
        fail(e, fmt)
    except OSError as e:  # writing the run's own files (a full disk); the workers' are reported as R028 too
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        from placer.launch.run import disk_error

        fail(disk_error(e, f"writing {e.filename or 'the run directory'}"), fmt)
    finally:
        # The run is over: the interpreter's last garbage collection, of torch's objects, took
        # 5 s before placer could exit on a loaded 2-core machine; frozen objects are not collected
        gc.freeze()
    if fmt == "json":
        click.echo(json.dumps(outcome, indent=2, default=str))
    sys.exit(0 if outcome["ok"] else 1)


def run(spec_path, console: Console, *, check, run_dir, overwrite=False, steps, nnodes, node_rank,
        rdzv_endpoint, overrides=(), resume=None, tolerance=(None, None)) -> dict:
    from placer.cli.main import load_and_warn
    from placer.codegen.program import generate
    from placer.launch import run as launcher

    spec = load_and_warn(spec_path, overrides, say=lambda text: console.say(text, err=True))
    if overrides:  # run.log says what differs from RUN_DIR/spec.yaml
        console.say("overrides: " + " ".join(f"--set {o}" for o in overrides))
    binding = launcher.bind(spec, nnodes)
    ckpt = spec.training.checkpoint
    if resume:
        run_dir = launcher.resumable_run_dir(Path(resume), spec)
        console.append = True
        console.say(f"resuming the run in {run_dir}")
        if (run_dir / "spec.yaml").read_bytes() != Path(spec_path).read_bytes():
            console.say(f"(the spec differs from {run_dir / 'spec.yaml'}; its checkpoint must fit this program)")
        program = generate(spec, filename="program.py", out_dir=str(run_dir))
        launcher.write_atomically(run_dir / "program.py", program.text)
    else:
        wanted = Path(run_dir) if run_dir else default_run_dir(spec.name, node_rank)
        program = generate(spec, filename="program.py", out_dir=str(wanted))  # a claimed name differs by a suffix only
        run_dir = launcher.claim_run_dir(Path(run_dir) if run_dir else None, wanted,
                                         Path(spec_path).read_bytes(), overwrite=overwrite,
                                         checkpoint_dir=ckpt.dir if ckpt else None)
        (run_dir / "program.py").write_text(program.text)
    outcome = {"ok": False, "run_dir": str(run_dir), "simulated": binding.simulate, "notice": binding.reason,
               "backend": binding.backend, "world_size": program.world_size}
    try:
        return _launch_and_check(spec, program, binding, run_dir, console, outcome, check=check, steps=steps,
                                 nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                                 resume=bool(resume), tolerance=tolerance)
    except PlacerError as e:
        console.log += [d.format() for d in e.diagnostics]
        raise
    except launcher.Interrupted:
        if console.tty:
            click.echo(err=True)  # off the progress bar's line
        console.say(f"interrupted at step {console.step}; run directory kept: {run_dir}", err=True)
        console.said_interrupted = True
        raise
    finally:
        console.save(run_dir)


def _launch_and_check(spec, program, binding, run_dir: Path, console: Console, outcome: dict, *, check, steps,
                      nnodes, node_rank, rdzv_endpoint, resume=False, tolerance=(None, None)) -> dict:
    from placer.launch import run as launcher

    if binding.reason:
        console.say(binding.reason)
    where = f"node {node_rank} of {nnodes}: " if nnodes > 1 else ""
    console.say(f"{where}{binding.nproc_per_node} workers ({binding.backend}), run dir {run_dir}")
    if nnodes == 1 and len({Device.parse(d).node for d in program.devices}) > 1:
        console.say("the spec spans several machines; all its workers run here "
                    "(use --nnodes N --node-rank K --rdzv-endpoint HOST:PORT on each machine)")
    args = ["--steps", str(steps)] if steps else []
    if check:  # both runs write their first-step gradients for the check
        args.append("--grads")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    restarts = spec.runtime.max_restarts
    if restarts:
        console.say(f"attempt 1 of {restarts + 1}" + ("" if ckpt_of(spec) else
                    " (no training.checkpoint: a restart starts again at step 0)"))

    def restarting(attempt: int, attempts: int, failures: dict, hang=None) -> None:
        for line in restart_lines(spec, program, attempt, attempts, failures, console.step, hang):
            console.say(line, err=True)

    result = launcher.launch(run_dir / "program.py", run_dir, binding, args, node_rank=node_rank,
                             rdzv_endpoint=rdzv_endpoint, max_restarts=restarts, resume=resume,
                             on_progress=console.progress, on_restart=restarting)
    outcome["metrics"] = result.metrics
    outcome["attempts"] = result.attempts
    stopped = _stopped(spec, run_dir)
    if stopped:  # the program stopped on its input: that is the whole story
        outcome["stopped"] = stopped.as_dict()
        raise RunError(stopped)
    if not result.ok:
        outcome["failures"] = {r: {"exit_code": c, "stderr_tail": t} for r, (c, t) in result.failures.items()}
        order = failures_in_order(result.failures)
        full = next((line for _, (_, tail) in order for line in tail.splitlines() if "[Errno 28]" in line), None)
        if full:  # a worker could not write (a checkpoint, the results): the disk, not the rank, is at fault
            raise RunError(Diagnostic("R028", f"the disk is full: a worker failed writing: {full.strip()}",
                                      Loc(str(run_dir)), "free some space (old runs/ directories, checkpoints), "
                                      "or choose a --run-dir on another disk"))
        if result.hang:  # the ranks that failed timed out waiting for one that stopped answering
            raise RunError(_hang(spec, program, run_dir, result.hang))
        first = order[0][0]
        raise RunError([_failure(spec, program, run_dir, r, code, tail, after=None if r == first else first)
                        for r, (code, tail) in order])
    if not result.metrics:  # ranks of node 0 write the results
        console.say(f"done in {result.wall_s:.1f} s; node 0 writes metrics.json and final_params.pt")
        outcome["ok"] = True
        return outcome
    for line in summary_lines(result.metrics, result.wall_s, result.attempts):
        console.say(line)
    if check:
        report = _check(spec, run_dir, binding, args, tolerance)
        outcome["check"] = report.as_dict()
        (run_dir / "check.json").write_text(json.dumps(outcome["check"], indent=2))
        for line in check_lines(report):
            console.say(line)
        if not report.ok:
            diag = Diagnostic("R021", f"the run does not match the one-device reference: {check_failure(report)}",
                              Loc(spec.file), check_hint(report))
            console.say(diag.format(), err=True)
            return outcome
        console.say("check passed: every step's loss, every parameter and every first-step gradient match the "
                    "reference")
    outcome["ok"] = True
    return outcome


def _stopped(spec, run_dir: Path) -> Diagnostic | None:
    """Why the program stopped itself (its OUT/stopped.json), as a diagnostic."""
    try:
        info = json.loads((run_dir / "stopped.json").read_text())
    except (OSError, ValueError):
        return None
    step = info.get("step")
    if info.get("reason") == "non-finite loss":
        return Diagnostic("R024", f"{info.get('message')}; the run stopped there", spec.training.optimizer.loc,
                          "a smaller training.optimizer.lr, or inputs and targets without inf/nan, usually fix it")
    if info.get("reason") == "checkpoint mismatch":
        return Diagnostic("R033", f"{info.get('message')}", Loc(spec.file),
                          "resume with the spec the run was started with (RUN_DIR/spec.yaml), or start a new run")
    if info.get("reason") == "data exhausted":
        data = spec.training.data
        return Diagnostic("R025", f"{info.get('message')}; the run stopped there", getattr(data, "loc", Loc(spec.file)),
                          "make the data function yield at least training.steps batches, or pass fewer --steps")
    return Diagnostic("R020", f"the program stopped at step {step}: {info.get('message')}", Loc(spec.file))


def ckpt_of(spec):
    return spec.training.checkpoint


def restart_lines(spec, program, attempt: int, attempts: int, failures: dict, step: int, hang=None) -> list[str]:
    """What an attempt that failed and is restarted says: the ranks that failed and how (or the
    rank the others timed out waiting for), and where the next attempt continues."""
    lines = [f"attempt {attempt} of {attempts} failed after step {step}:"]
    for rank, (code, tail) in [] if hang else failures_in_order(failures):
        device = program.devices[rank] if 0 <= rank < len(program.devices) else "?"
        if code is not None and code < 0:
            how = f"was killed by {_signal_name(-code)}"
        else:
            last = next((line.strip() for line in excerpt(tail, 1)), "")
            how = f"exited with code {code}" + (f": {last}" if last else "")
        lines.append(f"  rank {rank} ({device}) {how}")
    if hang:
        lines.append(f"  {hang_sentence(spec, program, hang)}")
    where = "from the newest complete checkpoint" if ckpt_of(spec) else "at step 0 (no training.checkpoint)"
    lines.append(f"restarting: attempt {attempt + 1} of {attempts}, {where}")
    return lines


def failures_in_order(failures: dict[int, tuple[int | None, str]]) -> list[tuple[int, tuple[int | None, str]]]:
    """The likely cause first: a rank that exited with an error, then one killed by a signal of
    its own (SIGABRT, SIGSEGV, SIGKILL when out of memory), then one that failed because a peer's
    connection closed (a failed worker exits at once, often before the launcher stops the
    others), then those the launcher stopped with SIGTERM because a peer had failed; by rank
    within each."""
    def kind(code: int | None, tail: str) -> int:
        if code is not None and code > 0:
            return 2 if _PEER_GONE.search(tail) else 0
        return 3 if code == -signal.SIGTERM else 1
    return sorted(failures.items(), key=lambda kv: (kind(*kv[1]), kv[0]))


_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe")


def _failure(spec, program, run_dir: Path, rank: int, code: int | None, tail: str, after: int | None) -> Diagnostic:
    device = program.devices[rank] if 0 <= rank < len(program.devices) else "?"
    shown = "\n".join("    " + line for line in excerpt(tail))
    if code is not None and code < 0:
        how = f"was stopped by {_signal_name(-code)}" + (f" after rank {after} failed" if after is not None else "")
        if code == -signal.SIGTERM or not shown:
            return Diagnostic("R020", f"rank {rank} ({device}) {how}", Loc(spec.file))
        return Diagnostic("R020", f"rank {rank} ({device}) {how}:\n{shown}", Loc(spec.file),
                          f"its whole output is under {run_dir / 'logs'}")
    return Diagnostic("R020", f"rank {rank} ({device}) exited with code {code}" + (f":\n{shown}" if shown else ""),
                      Loc(spec.file), f"its whole output is under {run_dir / 'logs'}")


def hang_sentence(spec, program, hang) -> str:
    """`rank 1 (cpu:1) stopped answering at step 3 in forward; rank 0 (cpu) waited at step 3 in
    backward (all_reduce over ranks 0, 1) and timed out after 20 s`."""
    def who(rank: int) -> str:
        return f"rank {rank} ({program.devices[rank] if 0 <= rank < len(program.devices) else '?'})"

    (first, where), *more = hang.waiters
    waited = f"{who(first)} waited" + (f" {where}" if where else "")
    if more:
        waited += f" (as did {', '.join(who(r) for r, _ in more)})"
    return (f"{who(hang.rank)} stopped answering{' ' + hang.doing if hang.doing else ''}; "
            f"{waited} and timed out after {spec.runtime.timeout_s:g} s")


def _hang(spec, program, run_dir: Path, hang) -> Diagnostic:
    """One report for a hang: the rank that stopped answering and where, then who waited for it."""
    how = ("its process was stopped (SIGSTOP or Ctrl-Z: state T) and placer killed it" if hang.stopped else
           "its status did not advance (a hang in its own code or a peer it waits for)")
    return Diagnostic("R034", hang_sentence(spec, program, hang), spec.runtime.loc,
                      f"{how}; every rank's output is under {run_dir / 'logs'}; runtime.timeout_s bounds the wait")


_FRAME = re.compile(r'\s*File ".*", line \d+')


def excerpt(tail: str, most: int = 8) -> list[str]:
    """The lines of a rank's output that say why it failed: from a traceback, its exception line
    (`ValueError: ...`) and what follows it, cut to `most` lines, since a message that holds a
    module's repr would otherwise show only the repr's tail; else the last `most` lines."""
    lines = [line for line in tail.splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if _FRAME.match(line)]
    if frames:
        i = frames[-1] + 1
        while i < len(lines) and lines[i].startswith("    "):  # the frame's source line and its ^^^ marks
            i += 1
        if i < len(lines):
            shown = lines[i:i + most]
            if len(lines) - i > most > 1:
                shown[-1] = f"... ({len(lines) - i - most + 1} more lines)"
            return shown
    return lines[-most:]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _check(spec, run_dir: Path, binding, args: list[str], tolerance=(None, None)):
    from placer.launch.check import ATOL, RTOL, compare

    ref_dir = run_dir / "reference"
    cmd = [sys.executable, str(run_dir / "program.py"), "--reference", "--out", str(ref_dir), *args]
    if binding.simulate:
        cmd.append("--simulate")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (run_dir / "reference.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join("    " + line for line in proc.stderr.strip().splitlines()[-8:])
        raise RunError(Diagnostic("R022", f"the one-device reference exited with code {proc.returncode}:\n{tail}",
                                  Loc(spec.file), f"its whole output is in {run_dir / 'reference.log'}"))
    rtol, atol = tolerance
    return compare(run_dir, ref_dir, RTOL if rtol is None else rtol, ATOL if atol is None else atol)
