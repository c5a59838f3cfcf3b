"""`placer run --launcher slurm`: the run as one Slurm job, submitted and followed to its end.

The run directory is made here as for a local run (program.py, spec.yaml), with the job's
script in it (job.sbatch); each node's task runs `placer run --in-job` there. While the job
waits this says why (Slurm's reason); while it runs, its progress (RUN_DIR/progress.jsonl)
and what the nodes' `placer run` say (RUN_DIR/job/node-K.out, .err); when it ends, its state
becomes placer's exit code: 0 done, 1 failed (node 0's report names the rank that failed
first), 143 cancelled (as a local run stopped by SIGTERM). Ctrl-C cancels the job.
"""
from __future__ import annotations

import functools
import json
import re
import sys
import time
from pathlib import Path

import click

from placer.cli.console import RESULT, RunConsole
from placer.diagnostics import Diagnostic, Loc, PlacerError, RunError
from placer.launch.slurm import CANCELLED, JOB_DIR, SlurmOptions, option_problem

POLL_S = 0.5
UNKNOWN_POLLS = 20  # a job Slurm does not know for this many polls in a row has ended
_PROGRESS_LINE = re.compile(r"^step \d+/\d+  loss ")  # the node's plain progress: shown from progress.jsonl instead


def _checked(ctx, param, value):
    for v in value if isinstance(value, tuple) else [value] if value else []:
        problem = option_problem(param.name, v)
        if problem:
            raise click.BadParameter(problem, ctx, param)
    return value


_SBATCH = [
    click.option("--partition", callback=_checked, help="Slurm: the partition (sbatch --partition)."),
    click.option("--time", "time", callback=_checked, metavar="LIMIT",
                 help="Slurm: the job's time limit, e.g. 30 or 1:00:00 or 2-00:00:00 (sbatch --time)."),
    click.option("--account", callback=_checked, help="Slurm: the account charged (sbatch --account)."),
    click.option("--sbatch-option", "sbatch_option", multiple=True, callback=_checked, metavar="--NAME=VALUE",
                 help="Slurm: any other sbatch option, as an #SBATCH line (repeatable), e.g. "
                      "--sbatch-option=--qos=high --sbatch-option=--exclusive"),
]
_RUN = [
    click.option("--launcher", type=click.Choice(["local", "slurm"]), default="local", show_default=True,
                 help="slurm: submit the run as one Slurm job and follow it: nodes and GPUs per node from the "
                      "spec's devices, one task per node running `placer run --in-job` (run directory, logs, "
                      "metrics and failure report as here; it must be on a filesystem the nodes share). "
                      "Exit 0 done, 1 failed, 143 cancelled (docs/cluster.md)."),
    click.option("--detach", is_flag=True,
                 help="--launcher slurm: submit, say the job id and run directory, and return (exit 0)."),
    click.option("--in-job", is_flag=True,
                 help="Run as one node's task of a cluster job (the job script of --launcher slurm and "
                      "`generate --sbatch` passes it): the node rank is $SLURM_NODEID unless --node-rank says; "
                      "node 0 makes --run-dir unless it holds the program already, the other nodes run in it; "
                      "each node leaves its outcome in RUN_DIR/job/node-K.json."),
]


def sbatch_options(f):
    """--partition, --time, --account and --sbatch-option, passed on as one `slurm` SlurmOptions."""
    @functools.wraps(f)
    def command(*args, partition, time, account, sbatch_option, **kwargs):
        return f(*args, slurm=SlurmOptions(partition, time, account, tuple(sbatch_option)), **kwargs)
    for option in reversed(_SBATCH):
        command = option(command)
    return command


def slurm_options(f):
    """`placer run`'s: --launcher, --detach, --in-job and the sbatch options."""
    f = sbatch_options(f)
    for option in reversed(_RUN):
        f = option(f)
    return f


class Tail:
    """The complete lines appended to a file since the last call."""

    def __init__(self, path: Path):
        self.path, self.pos = path, 0

    def lines(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return []
        if not final:
            data = data[:data.rfind(b"\n") + 1]
        self.pos += len(data)
        return data.decode(errors="replace").splitlines()


def submit_and_follow(spec_path, console: RunConsole, fmt: str, *, slurm: SlurmOptions, detach: bool, run_dir,
                      overwrite, steps, overrides, check, tolerance) -> None:
    """`placer run --launcher slurm`; exits with the job's outcome."""
    from placer.cli.main import fail
    from placer.launch.run import Interrupted, interruptible

    outcome: dict = {"ok": False}
    try:
        with interruptible():
            code = _submit_and_follow(spec_path, console, outcome, slurm=slurm, detach=detach, run_dir=run_dir,
                                      overwrite=overwrite, steps=steps, overrides=overrides, check=check,
                                      tolerance=tolerance)
    except Interrupted as e:
        from placer.launch import slurm as jobs

        if "job_id" in outcome:  # Ctrl-C here stops the job, as it stops a local run's workers
            jobs.cancel(outcome["job_id"])
            console.say(f"interrupted: cancelled Slurm job {outcome['job_id']} at step {console.step}; "
                        f"run directory kept: {outcome['run_dir']}", err=True)
        else:
            console.say("interrupted before the job was submitted", err=True)
        _save(console, outcome)
        sys.exit(128 + e.signum)
    except PlacerError as e:
        console.log += [d.format() for d in e.diagnostics]
        _save(console, outcome)
        fail(e, fmt)
    _save(console, outcome)
    if fmt == "json":
        click.echo(json.dumps(outcome, indent=2, default=str))
    sys.exit(code)


def _save(console: RunConsole, outcome: dict) -> None:
    if "run_dir" in outcome:  # the nodes write run.log: the submitter's own lines go beside their output
        console.log_name = f"{JOB_DIR}/submit.log"
        console.save(Path(outcome["run_dir"]))


def _submit_and_follow(spec_path, console: RunConsole, outcome: dict, *, slurm: SlurmOptions, detach, run_dir,
                       overwrite, steps, overrides, check, tolerance) -> int:
    from placer.cli.main import load_and_warn
    from placer.launch import slurm as jobs
    from placer.launch.resume import effective_spec
    from placer.launch.run import PROGRESS, new_run_dir

    spec = load_and_warn(spec_path, overrides, say=lambda text: console.say(text, err=True))
    shape = jobs.job_shape(spec)
    data, text = effective_spec(spec.doc, Path(spec_path).read_bytes(), overrides, steps)
    program, run_dir = new_run_dir(spec, run_dir, overwrite, 0, data, text)  # errors here, not after the queue
    run_dir = run_dir.resolve()
    outcome["run_dir"] = str(run_dir)
    jobs.JobNode(run_dir, 0).save_program(program)
    args: list[str] = ["--check"] if check else []
    for flag, value in (("--rtol", tolerance[0]), ("--atol", tolerance[1]), ("--steps", steps)):
        args += [flag, str(value)] if value is not None else []
    for o in overrides:
        args += ["--set", o]
    args += ["-v"] if console.level > 0 else ["-q"] if console.level < 0 else []
    script = run_dir / "job.sbatch"
    script.write_text(jobs.script(spec, spec_path=spec_path, run_dir=str(run_dir), options=slurm,
                                  placer_args=tuple(args)))
    job_id = jobs.submit(script, spec)
    outcome.update(launcher="slurm", job_id=job_id)
    (run_dir / JOB_DIR / "job_id").write_text(job_id + "\n")
    gpus = f", {shape.gpus_per_node} GPU(s) per node" if shape.gpus_per_node else ""
    console.say(f"submitted Slurm job {job_id}: {shape.nnodes} node(s) x {shape.per_node} worker(s){gpus}, "
                f"run dir {run_dir} (script: job.sbatch)")
    if detach:
        console.say(f"follow it: squeue -j {job_id}; tail -f {run_dir / JOB_DIR}/node-0.err; "
                    f"cancel it: scancel {job_id}")
        outcome["ok"] = True
        return 0
    state = _follow(job_id, run_dir / PROGRESS, run_dir / JOB_DIR, console)
    outcomes = jobs.read_outcomes(run_dir)
    outcome.update({k: v for k, v in outcomes.get(0, {}).items() if k != "run_dir"}, launcher="slurm",
                   job_state=state.state, job_exit_code=state.exit_code, run_dir=str(run_dir),
                   nodes={k: v.get("ok") for k, v in outcomes.items()})
    ended = f"Slurm job {job_id} ended {state.state}" + (f" ({state.reason})" if state.reason else "")
    if state.state in CANCELLED:
        outcome["ok"] = False
        console.say(Diagnostic("R043", f"{ended} at step {console.step}; run directory kept: {run_dir}",
                               Loc(str(script)), "scancel or a preemption stopped it; with training.checkpoint, "
                               f"`placer run {spec_path} --resume {run_dir}` continues it (on this machine)"
                               ).format(), err=True)
        return 143
    complete = len(outcomes) == shape.nnodes
    if state.state == "COMPLETED" and complete and all(o.get("ok") for o in outcomes.values()):
        outcome["ok"] = True
        return 0
    outcome["ok"] = False
    reported = complete or any(o.get("diagnostics") for o in outcomes.values())
    if state.state != "TIMEOUT" and reported:  # the nodes' own reports (R020, R021 ...) came first
        console.say(f"{ended}, exit code {state.exit_code}: the report above; every node's output is in "
                    f"{run_dir / JOB_DIR}", err=True)
        return 1
    raise RunError(_ended_early(spec, run_dir, job_id, state, outcomes, shape.nnodes, ended))


def _ended_early(spec, run_dir: Path, job_id: str, state, outcomes: dict, nnodes: int, ended: str) -> Diagnostic:
    """R042: the job ended without every node's `placer run` reporting (killed, out of time, never started)."""
    silent = [k for k in range(nnodes) if k not in outcomes]
    why = f"node(s) {', '.join(map(str, silent))} never reported" if silent else "the nodes did not finish"
    out = run_dir / JOB_DIR / f"slurm-{job_id}.out"
    tail = [line for p in (out, run_dir / JOB_DIR / "node-0.err") if p.exists()
            for line in p.read_text(errors="replace").splitlines() if line.strip()][-6:]
    text = f"{ended}, exit code {state.exit_code or '?'}, and {why}" + "".join(f"\n    {line}" for line in tail)
    hint = ("raise --time (the job ran out of its time limit); " if state.state == "TIMEOUT" else "") + \
        f"read {out} and {run_dir / JOB_DIR}/node-K.err (`placer` must run on every node: $PLACER in job.sbatch)"
    return Diagnostic("R042", text, Loc(str(run_dir / "job.sbatch")), hint)


def _follow(job_id: str, progress: Path, job_dir: Path, console: RunConsole):
    """Poll the job until it ends: its state when it changes, progress records, and the nodes' lines."""
    from placer.launch import slurm as jobs

    records, said = Tail(progress), None
    tails: dict[Path, Tail] = {}

    def relay(final: bool = False) -> None:
        for line in records.lines(final):
            try:
                console.progress(json.loads(line))
            except ValueError:
                pass
        for path in sorted(job_dir.glob("node-*.out")) + sorted(job_dir.glob("node-*.err")):
            tail = tails.setdefault(path, Tail(path))
            node = path.stem.split("-")[1]
            for line in tail.lines(final):
                if not _PROGRESS_LINE.match(line):
                    # at RESULT level: the node's own -q / -v already chose what it says
                    console.say(line if node == "0" else f"node {node}: {line}", err=path.suffix == ".err",
                                level=RESULT)

    unknown = 0
    while True:
        state = jobs.job_state(job_id)
        unknown = unknown + 1 if state.state == "UNKNOWN" else 0
        if 0 < unknown < UNKNOWN_POLLS:  # the controller busy or restarting: ask again before giving up
            time.sleep(POLL_S)
            continue
        if (state.state, state.reason) != said:
            said = (state.state, state.reason)
            if not state.done and state.state != "COMPLETING":  # ending: what it ended as comes next
                where = f" on {state.nodes}" if state.running and state.nodes else ""
                console.say(f"job {job_id} {state.state.lower()}{where}" + (f" ({state.reason})" if state.reason else ""))
        relay(final=state.done)
        if state.done:
            console.end_bar()
            return state
        time.sleep(POLL_S)
