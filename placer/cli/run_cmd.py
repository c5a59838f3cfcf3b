"""`placer run`: generate the program into a run directory and launch it, one worker per device."""
from __future__ import annotations

import dataclasses
import errno
import gc
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import click

from placer import units
from placer.cli.console import DETAIL, INFO, RESULT, RunConsole, verbosity, verbosity_options
from placer.cli.failures import failure_report, failures_in_order, hang_report, restart_lines, signal_name
from placer.cli.options import set_option
from placer.cli.run_slurm import slurm_options
from placer.device import Device
from placer.diagnostics import Diagnostic, Loc, PlacerError, RunError
from placer.launch.slurm import JobNode

MEASURES = {"cuda_max_memory_allocated": "the CUDA allocator's peak (torch.cuda.max_memory_allocated)",
            "tensor_peak": "the most bytes torch's CPU allocator held for tensors in the first two steps"}


def measured_peak(m: dict) -> tuple[int | None, str | None]:
    """(bytes, measure) of a device's peak that the plan estimates: the CUDA allocator's on a GPU,
    the CPU allocator's tensor bytes on a CPU worker (its RSS, in metrics.json, holds far more)."""
    if m.get("measure") == "cuda_max_memory_allocated":
        return m["peak_bytes"], "cuda_max_memory_allocated"
    if "tensor_peak_bytes" in m:
        return m["tensor_peak_bytes"], "tensor_peak"
    return None, None


def summary_lines(metrics: dict, wall_s: float, attempts: int = 1, planned: dict | None = None) -> list[str]:
    """The run's speed, then per device: bytes sent, time by kind, measured peak memory beside
    the plan's estimate (`planned`: device -> bytes) and their ratio."""
    steps, sps = metrics.get("steps", 0), metrics.get("steps_per_s") or 0.0
    first = metrics.get("resumed_from") or 0
    what = f"trained {steps} steps" if not first else \
        f"trained steps {first + 1}..{steps} of {steps} (resumed from the checkpoint at step {first})"
    tries = f", {attempts} attempts" if attempts > 1 else ""
    lines = [f"{what}: {sps:.2f} steps/s, {metrics.get('samples_per_s') or 0:.0f} samples/s "
             f"({metrics.get('wall_s', 0):.2f} s training{' in the last attempt' if attempts > 1 else ''}, "
             f"{wall_s:.1f} s with start-up{tries})",
             f"{'device':<16} {'bytes sent':>12} {'compute s':>10} {'comm s':>8} {'data s':>8} "
             f"{'peak memory':>12} {'planned':>10} {'ratio':>6}"]
    times, memory, planned = metrics.get("time_s", {}), metrics.get("peak_memory", {}), planned or {}
    measures = set()
    for device in metrics.get("devices", []):
        t = times.get(device, {})
        peak, measure = measured_peak(memory.get(device, {}))
        measures.add(measure)
        plan = planned.get(device)
        ratio = f"{peak / plan:.2f}" if peak is not None and plan else "-"
        lines.append(f"{device:<16} {units.size(metrics.get('bytes_sent', {}).get(device, 0)):>12} "
                     f"{t.get('compute', 0):>10.3f} {t.get('comm', 0):>8.3f} {t.get('data', 0):>8.3f} "
                     f"{units.size(peak) if peak is not None else '-':>12} "
                     f"{units.size(plan) if plan is not None else '-':>10} {ratio:>6}")
    lines.append("(bytes: payload this rank handed to send / collectives; comm: time waiting in copies and "
                 "gradient syncs, plus DDP's all-reduce from each bucket's launch to its completion while backward "
                 "runs, which compute holds too; a pipeline schedule's sends count as compute)")
    for measure in sorted(m for m in measures if m):
        lines.append(f"(peak memory: {MEASURES[measure]}; planned: placer plan's estimate for one step; "
                     "ratio: peak / planned; each worker's RSS is in metrics.json)")
    return lines


def detail_lines(metrics: dict) -> list[str]:
    """-v: what each rank handed to each torch.distributed call."""
    lines = []
    for device, calls in metrics.get("bytes_by_call", {}).items():
        if calls:
            lines.append(f"{device}: " + ", ".join(f"{name} {units.size(n)}" for name, n in sorted(calls.items())))
    return ["bytes per call, per device:", *("  " + line for line in lines)] if lines else []


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
        of = f" of {len(report.grads) + len(report.grads_unrecorded)}" if report.grads_unrecorded else ""
        lines.append(f"  first-step gradients: {len(report.grads)}{of} compared, worst {g[0]}: max |diff| {g[2]:.2e} "
                     f"of scale {g[3]:.2e}")
    if report.grads_unrecorded:  # what the check could not see, said rather than passed over
        names = report.grads_unrecorded
        lines.append(f"  first-step gradients not recorded by the run: {', '.join(names[:4])}"
                     f"{f' and {len(names) - 4} more' if len(names) > 4 else ''}")
    for names in report.tied:
        lines.append(f"  tied: {' = '.join(names)} (each copy compared)")
    return lines


def passed_line(report) -> str:
    if not report.grads_unrecorded:
        return "check passed: every step's loss, every parameter and every first-step gradient match the reference"
    n = len(report.grads)
    return (f"check passed: every step's loss and every parameter match the reference, and the {n} first-step "
            f"gradients the run recorded (of {n + len(report.grads_unrecorded)})")


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


@click.command("run")
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False))
@click.option("--check", is_flag=True,
              help="Also train the one-device reference and compare every step's loss, every copy of every final "
                   "parameter and every first-step gradient. When losses or parameters differ, the reference is "
                   "trained again from weights nudged by 1e-7, to tell float drift from a bug.")
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
              help="Continue the run in RUN_DIR from its newest complete checkpoint that verifies "
                   "(training.checkpoint); losses and final parameters are those of a run never interrupted. "
                   "The spec (after --set) must compute what RUN_DIR/spec.yaml computed: only training.steps, "
                   "training.checkpoint, training.prefetch and runtime may change (else R033).")
@click.option("--resume-anyway", is_flag=True,
              help="With --resume: continue from the checkpoint although the spec changes what a step computes "
                   "(batch size, optimizer, model, data, precision, schedule, placement), which R033 refuses "
                   "otherwise. The run is then no longer the continuation of the one it resumes.")
@slurm_options
@set_option
@verbosity_options
def command(spec_path, check, rtol, atol, run_dir, overwrite, steps, nnodes, node_rank, rdzv_endpoint, fmt,
            max_restarts, resume_dir, resume_anyway, overrides, launcher, slurm, detach, in_job):
    """Generate SPEC's program into a run directory and launch it, one worker per device.

    Devices this machine lacks run as CPU workers on gloo when runtime.simulate is auto
    (the run says so). The run directory keeps program.py, spec.yaml, run.log,
    logs/<device>.log (each worker's output), progress.jsonl, metrics.csv and tensorboard/
    (per step: loss, lr, samples/s, step time, memory), metrics.json and final_params.pt;
    with --check also reference/ (the one-device run) and check.json. -q prints only errors
    and the result; -v adds torch elastic's log lines and bytes per call (docs/run.md).

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
      placer run spec.yaml --launcher slurm --partition gpu --time 1:00:00   # one Slurm job (docs/cluster.md)
    """
    from placer.cli.main import fail
    from placer.deps import require_torch

    require_torch("placer run")
    if launcher == "slurm" and (resume_dir or in_job or nnodes > 1 or node_rank or rdzv_endpoint):
        raise click.UsageError("--launcher slurm starts every node itself: leave out --resume, --in-job, "
                               "--nnodes, --node-rank and --rdzv-endpoint")
    if launcher != "slurm" and (detach or any(vars(slurm).values())):
        raise click.UsageError("--detach, --partition, --time, --account and --sbatch-option go with "
                               "--launcher slurm")
    if in_job and node_rank == 0 and os.environ.get("SLURM_NODEID", "").isdigit():
        node_rank = int(os.environ["SLURM_NODEID"])  # one task per node: its node rank is Slurm's
    if in_job and not run_dir:
        raise click.UsageError("--in-job runs in the job's run directory: pass --run-dir RUN_DIR")
    if nnodes > 1 and not rdzv_endpoint:
        raise click.UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if node_rank >= nnodes:
        raise click.UsageError(f"--node-rank {node_rank} is not below --nnodes {nnodes}")
    if max_restarts is not None:
        overrides += (f"runtime.max_restarts={max_restarts}",)
    if resume_dir and (run_dir or overwrite):
        raise click.UsageError("--resume RUN_DIR continues the run in RUN_DIR: leave out --run-dir and --overwrite")
    if resume_anyway and not resume_dir:
        raise click.UsageError("--resume-anyway goes with --resume RUN_DIR")
    from placer.launch.run import Interrupted, interruptible

    console = RunConsole(quiet=fmt == "json", level=verbosity())
    if launcher == "slurm":
        from placer.cli.run_slurm import submit_and_follow

        submit_and_follow(spec_path, console, fmt, slurm=slurm, detach=detach, run_dir=run_dir, overwrite=overwrite,
                          steps=steps, overrides=overrides, check=check, tolerance=(rtol, atol))
    job = JobNode(Path(run_dir), node_rank) if in_job else None
    try:
        with interruptible():
            outcome = run(spec_path, console, check=check, run_dir=run_dir, overwrite=overwrite, steps=steps,
                          nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, overrides=overrides,
                          resume=resume_dir, resume_anyway=resume_anyway, tolerance=(rtol, atol), job=job)
    except Interrupted as e:  # run() said where; exit as a shell does for a process the signal ended
        if job:
            job.report({"ok": False, "interrupted": signal_name(e.signum)})
        if not console.said_interrupted:
            console.say("interrupted before the run started", err=True)
        # everything is said and saved: leave without interpreter shutdown, where a second Ctrl-C
        # or a dying thread's finalizer printed "Exception ignored in: ..." after our one line
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + e.signum)
    except PlacerError as e:
        if job:
            job.report({"ok": False, "diagnostics": [d.as_dict() for d in e.diagnostics]})
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
    if job:
        job.report(outcome)
    if fmt == "json":
        click.echo(json.dumps(outcome, indent=2, default=str))
    sys.exit(0 if outcome["ok"] else 1)


def run(spec_path, console: RunConsole, *, check, run_dir, overwrite=False, steps, nnodes, node_rank,
        rdzv_endpoint, overrides=(), resume=None, resume_anyway=False, tolerance=(None, None),
        job: JobNode | None = None) -> dict:
    from placer.cli.main import load_and_warn
    from placer.codegen.program import generate
    from placer.launch import run as launcher
    from placer.launch.resume import effective_spec, record_fingerprint, resume_changes
    from placer.search import resolve

    spec = load_and_warn(spec_path, overrides, say=lambda text: console.say(text, err=True))
    if spec.auto and nnodes > 1:  # each node would search on its own machine, and might choose apart
        from placer.diagnostics import Diagnostic, PlanError

        raise PlanError(Diagnostic("A003", f"placement auto with --nnodes {nnodes}: each node would search on its "
                                   "own", spec.doc.loc(("placement",)), "write the placement first: `placer suggest "
                                   "SPEC -o placed.yaml`, then run placed.yaml on every node"))
    spec, chosen = resolve(spec, lambda text: console.say(text, err=True))  # `placement: auto`
    if overrides:  # run.log says how the run's spec.yaml came from SPEC
        console.say("overrides: " + " ".join(f"--set {o}" for o in overrides))
    binding = launcher.bind(spec, nnodes)
    # RUN_DIR/spec.yaml is the spec as trained, and fingerprint.json what a later --resume must keep
    data, text = (effective_spec(spec.doc, Path(spec_path).read_bytes(), overrides, steps) if chosen is None
                  else effective_spec(spec.doc, chosen.encode(), (), steps))  # auto: with the placement chosen
    if resume:
        run_dir = launcher.resumable_run_dir(Path(resume), spec)
        if node_rank == 0:  # (each machine writes its own run directory; on a shared disk node 0 claims)
            launcher.claim_checkpoint_dir(run_dir, spec, resume=True)
        console.append = True
        console.say(f"resuming the run in {run_dir}")
        program = generate(spec, filename="program.py", out_dir=str(run_dir))
        changed, moved = resume_changes(run_dir, spec.doc, data, anyway=resume_anyway, reshard=program.reshard)
        for change in changed:
            console.say(f"resharding the checkpoint: {change}" if change in moved else
                        f"--resume-anyway: continuing with {change}", err=True)
        launcher.write_atomically(run_dir / "program.py", program.text)
    elif job and job.joins():  # a cluster job's node: --launcher slurm or node 0 made the run directory
        run_dir = job.run_dir
        console.log_name = job.log_name
        program = job.program(spec)
    else:
        program, run_dir = launcher.new_run_dir(spec, run_dir, overwrite, node_rank, data, text, job is not None)
        if job:
            job.save_program(program)
        if node_rank == 0:
            launcher.claim_checkpoint_dir(run_dir, spec)

    def trains_on() -> None:  # a resume's checkpoint loaded: the run trains with this spec from here
        launcher.write_atomically(run_dir / "spec.yaml", text)
        record_fingerprint(run_dir, data, program.reshard)
    outcome = {"ok": False, "run_dir": str(run_dir), "simulated": binding.simulate, "notice": binding.reason,
               "backend": binding.backend, "world_size": program.world_size}
    try:
        return _launch_and_check(spec, program, binding, run_dir, console, outcome, check=check, steps=steps,
                                 nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                                 resume=bool(resume), on_resumed=trains_on, tolerance=tolerance)
    except PlacerError as e:
        console.log += [d.format() for d in e.diagnostics]
        raise
    except launcher.Interrupted:
        console.say(f"interrupted at step {console.step}; run directory kept: {run_dir}", err=True)
        console.said_interrupted = True
        raise
    finally:
        console.save(run_dir)


def _launch_and_check(spec, program, binding, run_dir: Path, console: RunConsole, outcome: dict, *, check, steps,
                      nnodes, node_rank, rdzv_endpoint, resume=False, on_resumed=None,
                      tolerance=(None, None)) -> dict:
    from placer.launch import run as launcher
    from placer.launch.logs import log_name
    from placer.launch.metrics import MetricsWriter

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
    restarts = spec.runtime.max_restarts
    if restarts:
        console.say(f"attempt 1 of {restarts + 1}" + ("" if ckpt_of(spec) else
                    " (no training.checkpoint: a restart starts again at step 0)"))

    def restarting(attempt: int, attempts: int, failures: dict, hang=None) -> None:
        for line in restart_lines(spec, program.devices, attempt, attempts, failures, console.step, hang):
            console.say(line, err=True)

    console.say(f"each worker's output: {run_dir / 'logs'}/<device>.log "
                f"({', '.join(log_name(d) for d in program.devices[:2])}{', ...' if len(program.devices) > 2 else ''})")
    plots = MetricsWriter(run_dir, spec.training.batch_size, append=resume) if node_rank == 0 else None
    if plots and plots.note:  # an optional extra nobody asked for: said only under -v
        console.say(plots.note, level=DETAIL)

    def progress(record: dict) -> None:
        if "resumed_from" in record and on_resumed:
            on_resumed()
        if plots:
            plots.add(record)
        console.progress(record)

    # A reference on the CPU trains beside the workers (one worker's share of the cores, which the
    # workers leave idle while they wait on each other); one on a GPU waits, not to share its memory.
    beside = check and node_rank == 0 and (binding.simulate or Device.parse(program.devices[0]).is_host)
    ref = _start_reference(run_dir, binding, args) if beside else None
    try:
        result = launcher.launch(run_dir / "program.py", run_dir, binding, args, devices=list(program.devices),
                                 node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, max_restarts=restarts,
                                 resume=resume, on_progress=progress, on_restart=restarting,
                                 verbose=console.level > 0)
    except BaseException:
        _stop(ref)
        raise
    finally:
        if plots:
            plots.close()
    if not (result.ok and result.metrics):  # nothing to compare the reference with
        _stop(ref)
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
            raise RunError(hang_report(spec, program.devices, run_dir, result.hang))
        from placer.launch.hang import read_statuses

        raise RunError(failure_report(spec, program.devices, run_dir, result.failures, read_statuses(run_dir),
                                      program.planned_memory))
    if resume and on_resumed:  # again: a node other than 0 sees no progress records
        on_resumed()
    if not result.metrics:  # ranks of node 0 write the results
        console.say(f"done in {result.wall_s:.1f} s; node 0 writes metrics.json and final_params.pt", level=RESULT)
        outcome["ok"] = True
        return outcome
    for i, line in enumerate(summary_lines(result.metrics, result.wall_s, result.attempts,
                                           program.planned_memory)):
        console.say(line, level=RESULT if i == 0 else INFO)
    for line in detail_lines(result.metrics):
        console.say(line, level=DETAIL)
    if check:
        from placer.launch.check import sensitivity_hint

        report = _check(spec, run_dir, ref or _start_reference(run_dir, binding, args), tolerance)
        sens = _sensitivity(spec, run_dir, binding, args, report, console)
        outcome["check"] = report.as_dict()
        if sens is not None:
            outcome["check"]["sensitivity"] = {**dataclasses.asdict(sens), "drift": sens.drift}
        (run_dir / "check.json").write_text(json.dumps(outcome["check"], indent=2))
        for line in check_lines(report) + (sens.lines() if sens else []):
            console.say(line)
        if not report.ok:
            diag = Diagnostic("R021", f"the run does not match the one-device reference: {check_failure(report)}",
                              Loc(spec.file), sensitivity_hint(report, sens, list(program.boundaries)))
            console.say(diag.format(), err=True)
            return outcome
        console.say(passed_line(report), level=RESULT)
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


def _start_reference(run_dir: Path, binding, args: list[str], name: str = "reference") -> subprocess.Popen:
    """Start training the one-device reference into RUN_DIR/NAME (its output in NAME.log)."""
    cmd = [sys.executable, str(run_dir / "program.py"), "--reference", "--out", str(run_dir / name), *args]
    if binding.simulate:
        cmd.append("--simulate")
    with open(run_dir / f"{name}.log", "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)


def _finish_reference(spec, run_dir: Path, proc: subprocess.Popen, name: str = "reference") -> Path:
    """Wait for the reference that `_start_reference` started; R022 when it failed."""
    if proc.wait() != 0:
        lines = (run_dir / f"{name}.log").read_text(errors="replace").strip().splitlines()
        tail = "\n".join("    " + line for line in lines[-8:])
        raise RunError(Diagnostic("R022", f"the one-device reference exited with code {proc.returncode}:\n{tail}",
                                  Loc(spec.file), f"its whole output is in {run_dir / (name + '.log')}"))
    return run_dir / name


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def _reference(spec, run_dir: Path, binding, args: list[str], name: str = "reference") -> Path:
    """Train the one-device reference into RUN_DIR/NAME, and wait for it."""
    return _finish_reference(spec, run_dir, _start_reference(run_dir, binding, args, name), name)


def _sensitivity(spec, run_dir: Path, binding, args: list[str], report, console):
    """When the losses or parameters differ: the reference again with its initial weights nudged
    (RUN_DIR/reference_nudged), to tell float drift from a bug. None when they match."""
    from placer.launch.check import PERTURB, Sensitivity, compare

    if report.ok or report.problem or (report.first_bad_step is None and report.first_bad_param is None):
        return None
    console.say(f"the check failed: training the reference again with its weights nudged by {PERTURB:g}")
    nudged = _reference(spec, run_dir, binding, [*args, "--perturb", repr(PERTURB)], "reference_nudged")
    return Sensitivity.of(report, compare(nudged, run_dir / "reference", report.rtol, report.atol))


def _check(spec, run_dir: Path, ref: subprocess.Popen, tolerance=(None, None)):
    from placer.launch.check import ATOL, BF16_ATOL, BF16_RTOL, RTOL, compare

    ref_dir = _finish_reference(spec, run_dir, ref)
    rtol, atol = tolerance
    bf16 = spec.training.precision == "bf16"  # the looser tolerance check_lines states
    return compare(run_dir, ref_dir, (BF16_RTOL if bf16 else RTOL) if rtol is None else rtol,
                   (BF16_ATOL if bf16 else ATOL) if atol is None else atol)
