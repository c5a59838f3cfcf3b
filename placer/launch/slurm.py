"""Slurm: a spec's run as one batch job, one task per node, each running `placer run` for its node.

`script` writes the job script (`placer generate --sbatch` writes it alone; `placer run
--launcher slurm` writes it into the run directory and submits it): #SBATCH lines from the
spec's devices (nodes, GPUs per node), then one `srun` task per node running `placer run
--in-job` for that node's workers. So a node's workers start, log, write metrics and fail
exactly as in a local run, into the one run directory every node sees (`JobNode`: what a
node's task makes, waits for and leaves there). `submit`, `job_state` and `cancel` wrap
sbatch, scontrol / sacct and scancel. Nothing here prints.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from placer import __version__
from placer.device import Device
from placer.diagnostics import Diagnostic, Loc, RunError
from placer.spec.types import Spec

JOB_DIR = "job"
"""RUN_DIR/job/: the script's output (slurm-JOBID.out) and each node's node-K.out, .err, .json, .log."""

RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING"}
WAITING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "RESV_DEL_HOLD", "RESIZING"}
CANCELLED = {"CANCELLED", "PREEMPTED", "REVOKED"}
# every other state a job ends in (COMPLETED, FAILED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, BOOT_FAIL,
# DEADLINE, SPECIAL_EXIT) is final; so is a job Slurm no longer knows (UNKNOWN)

_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}|"
                   r"UNLIMITED|INFINITE)$")
_NAME = re.compile(r"^[A-Za-z0-9_.,+-]+$")  # partition, account, qos: what Slurm names are made of


@dataclass(frozen=True)
class JobShape:
    """What the job asks Slurm for: the spec's machines (nodeK/ prefixes) and devices on each."""

    nnodes: int
    per_node: int
    """Workers (devices) on each node: torch's launcher starts the same number on every node."""
    gpus_per_node: int
    """The most cuda devices any node holds (0 where every device runs as a CPU worker)."""


def job_shape(spec: Spec) -> JobShape:
    devices = [Device.parse(d) for d in spec.devices]
    per_node = Counter(d.node for d in devices)
    if sorted(per_node) != list(range(len(per_node))):
        raise RunError(Diagnostic("R003", f"the spec places devices on node(s) {', '.join(map(str, sorted(per_node)))}, "
                                  f"not on node0 .. node{len(per_node) - 1}", Loc(spec.file),
                                  "name the devices' machines node0/, node1/, ... without gaps"))
    if len(set(per_node.values())) > 1:
        raise RunError(Diagnostic("R031", f"nodes hold different numbers of devices {dict(per_node)}", Loc(spec.file),
                                  "torch's launcher starts the same number of workers on every node"))
    gpus = Counter(d.node for d in devices if not d.is_host)
    simulated = spec.runtime.simulate == "always"  # CPU workers wherever the job lands: no GPU to ask for
    return JobShape(len(per_node), per_node[0], 0 if simulated else max(gpus.values(), default=0))


@dataclass(frozen=True)
class SlurmOptions:
    """What the user adds to the job: `placer run --launcher slurm --partition P --time T ...`."""

    partition: str | None = None
    time: str | None = None
    account: str | None = None
    extra: tuple[str, ...] = ()
    """More sbatch options, each a `--name=value` written as its own #SBATCH line."""


def option_problem(name: str, value: str) -> str | None:
    """Why an option's value cannot go into the script (None: it can)."""
    if name == "time" and not _TIME.match(value):
        return f"--time {value!r} is not a Slurm time limit (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM:SS)"
    if name in ("partition", "account") and not _NAME.match(value):
        return f"--{name} {value!r} is not a Slurm name (letters, digits, _ . , + -)"
    if name == "sbatch_option" and (not value.startswith("--") or any(c in value for c in "\n\r#")):
        return f"--sbatch-option {value!r} must be one sbatch option written --name=value (no newline, no '#')"
    return None


def script(spec: Spec, *, spec_path: str, run_dir: str | None, options: SlurmOptions,
           placer_args: tuple[str, ...] = (), python: str = sys.executable) -> str:
    """The job script. `run_dir` None: the job makes runs/<name>-<job id> in the directory it
    is submitted from (or $PLACER_RUN_DIR); `placer_args` are passed to every node's
    `placer run` (--check, --set, --steps ...)."""
    shape = job_shape(spec)
    q = shlex.quote
    out = f"{run_dir}/{JOB_DIR}/slurm-%j.out" if run_dir else None
    sbatch = [f"--job-name=placer-{spec.name}", f"--nodes={shape.nnodes}", "--ntasks-per-node=1"]
    if shape.gpus_per_node:
        sbatch.append(f"--gpus-per-node={shape.gpus_per_node}")
    sbatch += [f"--output={out}"] if out else []
    sbatch += [f"--{k}={v}" for k, v in (("partition", options.partition), ("time", options.time),
                                         ("account", options.account)) if v]
    sbatch += list(options.extra)
    gpus = f"{shape.gpus_per_node} GPU(s)" if shape.gpus_per_node else "no GPU (CPU workers)"
    lines = [
        "#!/bin/bash",
        f"# Slurm job for placer spec {spec.name!r} ({spec_path}), written by placer {__version__}.",
        "#   sbatch THIS_FILE                     submit it yourself, or let",
        f"#   placer run {q(spec_path)} --launcher slurm   write it into a run directory, submit it and follow it.",
        f"# {shape.nnodes} node(s), {shape.per_node} worker(s) (one per device) and {gpus} on each. Every node",
        "# runs one task, `placer run --in-job` for its workers: logs, metrics and the failure report are a",
        "# local run's, in the one run directory, which must be on a filesystem every node sees.",
        *(f"#SBATCH {o}" for o in sbatch),
        "set -euo pipefail",
        "",
        f"SPEC={q(str(Path(spec_path).resolve()))}",
        f"RUN_DIR={q(run_dir)}" if run_dir else f'RUN_DIR="${{PLACER_RUN_DIR:-runs/{spec.name}-$SLURM_JOB_ID}}"',
        f'PLACER="${{PLACER:-{python} -m placer}}"  # a Python with placer and torch, on every node',
        f'mkdir -p "$RUN_DIR/{JOB_DIR}"',
    ]
    task = ['$PLACER run "$SPEC" --in-job --run-dir "$RUN_DIR"', *map(q, placer_args)]
    if shape.nnodes > 1:  # node K (its $SLURM_NODEID) runs the spec's nodeK/ devices
        lines += ["# torch elastic's rendezvous (a TCP store) on the job's first node; a port per job",
                  'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                  "PORT=$((29500 + SLURM_JOB_ID % 1000))"]
        task += ['--nnodes "$SLURM_NNODES" --rdzv-endpoint "$HEAD:$PORT"']
    lines += ["",
              f"# one task per node (its node rank: $SLURM_NODEID); node K's output in $RUN_DIR/{JOB_DIR}/node-K.out, .err",
              f'srun --kill-on-bad-exit=1 --output="$RUN_DIR/{JOB_DIR}/node-%n.out" '
              f'--error="$RUN_DIR/{JOB_DIR}/node-%n.err" \\',
              "  " + " ".join(task)]
    return "\n".join(lines) + "\n"


def _command(name: str, spec: Spec | None = None) -> str:
    path = shutil.which(name)
    if path is None:
        raise RunError(Diagnostic("R040", f"Slurm's {name} is not on this machine's PATH",
                                  Loc(spec.file) if spec else Loc(),
                                  "run placer on a Slurm login node (or `module load slurm`), or write the "
                                  "script with `placer generate SPEC --sbatch FILE` and submit it there"))
    return path


def submit(script_path: Path, spec: Spec) -> str:
    """`sbatch --parsable SCRIPT`: the job id. R041 when sbatch refuses the job."""
    proc = subprocess.run([_command("sbatch", spec), "--parsable", str(script_path)], capture_output=True, text=True,
                          check=False)
    job = proc.stdout.strip().split(";")[0]  # "ID" or "ID;CLUSTER"
    if proc.returncode or not job.isdigit():
        said = (proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}").splitlines()
        raise RunError(Diagnostic("R041", f"sbatch refused the job: {said[-1]}", Loc(str(script_path)),
                                  "check --partition, --time, --account and --sbatch-option against `sinfo`; "
                                  f"the script is {script_path}"))
    return job


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str
    """Slurm's JobState (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ...), or UNKNOWN."""
    reason: str = ""
    """Why it waits (Resources, Priority, ...) or ended (NonZeroExitCode, ...); "" for None."""
    exit_code: str = ""
    """`code:signal` of the script."""
    nodes: str = ""

    @property
    def done(self) -> bool:
        return self.state not in RUNNING | WAITING

    @property
    def running(self) -> bool:
        return self.state in RUNNING


def job_state(job_id: str) -> JobState:
    """The job's state from scontrol (the controller keeps ended jobs for MinJobAge, 300 s by
    default), else from sacct (accounting), else UNKNOWN."""
    proc = subprocess.run([_command("scontrol"), "show", "job", "-o", job_id], capture_output=True, text=True,
                          check=False)
    fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout)) if proc.returncode == 0 else {}
    if "JobState" in fields:
        reason = fields.get("Reason", "")
        return JobState(job_id, fields["JobState"], "" if reason == "None" else reason, fields.get("ExitCode", ""),
                        "" if fields.get("NodeList") == "(null)" else fields.get("NodeList", ""))
    sacct = shutil.which("sacct")
    if sacct:
        proc = subprocess.run([sacct, "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode,Reason,NodeList"],
                              capture_output=True, text=True, check=False)
        rows = [line.split("|") for line in proc.stdout.splitlines() if line.count("|") == 3]
        if proc.returncode == 0 and rows:
            state, code, reason, nodes = rows[0]
            return JobState(job_id, state.split()[0], "" if reason == "None" else reason, code, nodes)
    return JobState(job_id, "UNKNOWN")


def cancel(job_id: str) -> None:
    subprocess.run([_command("scancel"), job_id], capture_output=True, check=False)


@dataclass(frozen=True)
class JobNode:
    """One node's task in a cluster job (`placer run --in-job`): all nodes share RUN_DIR. Node 0
    makes it unless `placer run --launcher slurm` already did; the others run in it. Each node
    leaves its outcome in RUN_DIR/job/node-K.json, which the submitting `placer run` reads."""

    run_dir: Path
    node_rank: int

    def joins(self) -> bool:
        """True: the run directory is (or will be) made by someone else; run in it."""
        return self.node_rank > 0 or (self.run_dir / JOB_DIR / "program.json").is_file()

    @property
    def log_name(self) -> str:
        return "run.log" if self.node_rank == 0 else f"{JOB_DIR}/node-{self.node_rank}.log"

    def program(self, spec: Spec, timeout_s: float = 300.0):
        """The Program that made RUN_DIR/program.py, as `save_program` left it (node K > 0 waits
        for node 0 to write it; R044 if it never does)."""
        from placer.codegen.program import Program

        path, deadline = self.run_dir / JOB_DIR / "program.json", time.monotonic() + timeout_s
        while not path.is_file():
            if time.monotonic() > deadline:
                raise RunError(Diagnostic("R044", f"node {self.node_rank} waited {timeout_s:g} s for {path}, which "
                                          "node 0 writes", Loc(str(path)), "the run directory must be on a "
                                          "filesystem every node of the job sees (not /tmp); read node 0's output "
                                          f"in {self.run_dir / JOB_DIR}"))
            time.sleep(0.5)
        meta = json.loads(path.read_text())
        return Program(text=(self.run_dir / "program.py").read_text(), devices=tuple(meta["devices"]),
                       nproc_per_node=meta["nproc_per_node"], nnodes=meta["nnodes"],
                       planned_memory=meta["planned_memory"], boundaries=tuple(meta["boundaries"]))

    def save_program(self, program) -> None:
        """What the nodes need of the Program besides its text (generating it again costs seconds)."""
        meta = {k: v for k, v in dataclasses.asdict(program).items() if k != "text"}
        (self.run_dir / JOB_DIR).mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / JOB_DIR / "program.json.tmp"
        tmp.write_text(json.dumps(meta, indent=2))
        tmp.replace(self.run_dir / JOB_DIR / "program.json")  # whole or absent for a node that waits

    def report(self, outcome: dict) -> None:
        try:
            (self.run_dir / JOB_DIR).mkdir(parents=True, exist_ok=True)
            (self.run_dir / JOB_DIR / f"node-{self.node_rank}.json").write_text(
                json.dumps(outcome, indent=2, default=str))
        except OSError:  # a full disk or a run directory never made: the node's own output says why
            pass


def read_outcomes(run_dir: Path) -> dict[int, dict]:
    """Each node's outcome that `JobNode.report` left, by node rank."""
    found = {}
    for path in sorted((run_dir / JOB_DIR).glob("node-*.json")):
        try:
            found[int(path.stem.split("-")[1])] = json.loads(path.read_text())
        except (OSError, ValueError, IndexError):
            pass
    return found
