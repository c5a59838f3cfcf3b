"""Launch a generated program: one worker per device, through torch's elastic launcher.

The program does the work; this module decides where it runs (real GPUs or
simulated CPU workers), starts it with `torch.distributed.launcher`, follows
its progress file and collects its metrics. It never prints: the CLI gets
progress through a callback and the outcome as a `RunResult`.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from placer.device import Device
from placer.diagnostics import Diagnostic, Loc, RunError
from placer.launch.hang import STATUS_DIR, Hang, Watchdog, hang_of, read_statuses
from placer.spec.types import Spec

PROGRESS = "progress.jsonl"
METRICS = "metrics.json"


@dataclass(frozen=True)
class Binding:
    """How spec devices map to this machine."""

    simulate: bool
    reason: str | None
    """One line saying why devices run as CPU workers (None when real)."""
    backend: str
    nproc_per_node: int
    nnodes: int


def cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install is "no GPU" for binding purposes
        return 0


def bind(spec: Spec, nnodes: int = 1) -> Binding:
    """Decide real vs simulated devices and the backend (runtime.simulate / backend), and how
    many workers each of `nnodes` machines starts (nnodes 1: all of them here)."""
    cudas = [Device.parse(d) for d in spec.devices if not Device.parse(d).is_host]
    have = cuda_count()
    missing = sorted({d.local for d in cudas if (d.index or 0) >= have})  # `cuda` alone is cuda:0
    mode = spec.runtime.simulate
    if mode == "never" and missing:
        raise RunError(Diagnostic("R030", f"devices {', '.join(missing)} are not on this machine "
                                  f"({have} GPU(s) found) and runtime.simulate is 'never'", spec.runtime.loc,
                                  "set runtime.simulate: auto to run them as CPU workers"))
    simulate = mode == "always" or (mode == "auto" and bool(missing))
    reason = None
    if simulate:
        why = "runtime.simulate is 'always'" if mode == "always" else \
            f"this machine lacks {', '.join(missing)} ({have} GPU(s) found)"
        reason = f"simulating {len(spec.devices)} devices as CPU workers on gloo: {why}"
    backend = spec.runtime.backend
    if simulate:  # CPU workers talk over gloo whatever the spec asks for
        backend = "gloo"
    elif backend == "auto":
        backend = "nccl" if cudas and len(cudas) == len(spec.devices) else "gloo"
    per_node = dict(Counter(Device.parse(d).node for d in spec.devices))  # nodes in order of first listing
    if nnodes == 1:  # every device's worker on this machine (a multi-node spec included)
        return Binding(simulate, reason, backend, len(spec.devices), 1)
    if sorted(per_node) != list(range(nnodes)):
        raise RunError(Diagnostic("R003", f"--nnodes is {nnodes} but the spec places devices on node(s) "
                                  f"{', '.join(map(str, sorted(per_node)))}", Loc(spec.file),
                                  f"pass --nnodes {len(per_node)}, or name devices node0/ .. node{nnodes - 1}/"))
    counts = set(per_node.values())
    if len(counts) > 1:
        raise RunError(Diagnostic("R031", f"nodes hold different numbers of devices {per_node}", Loc(spec.file),
                                  "torch's launcher starts the same number of workers on every node"))
    return Binding(simulate, reason, backend, counts.pop(), nnodes)


OUTPUTS = ("program.py", "spec.yaml", "run.log", "logs", PROGRESS, METRICS, "final_params.pt", "first_grads.pt",
           "stopped.json", "metrics.csv", "tensorboard", STATUS_DIR,
           "reference", "reference.log", "reference_nudged", "reference_nudged.log", "check.json", "fingerprint.json",
           "job", "job.sbatch")
"""What a run writes into its directory (--overwrite removes these, and the checkpoint directory)."""


def claim_run_dir(path: Path | None, stem: str | Path, spec_text: bytes, *, overwrite: bool = False,
                  checkpoint_dir: str | None = None, ignore: tuple[str, ...] = ()) -> Path:
    """A run directory that this run alone writes to, claimed by creating its spec.yaml
    exclusively (two runs started together never share one). `path` None: `stem`, `stem-2`, ...,
    the first that os.mkdir creates. A given `path` is created if missing; if it holds files it
    is refused (R027) unless `overwrite`, which removes a previous run's outputs first; entries
    named in `ignore` do not count (a Slurm job's job/ folder, which its script makes first)."""
    try:
        if path is None:
            path, n = Path(stem), 2
            while not _made(path):
                path, n = Path(f"{stem}-{n}"), n + 1
        elif not _made(path):
            if not path.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
            if any(p.name not in ignore for p in path.iterdir()) and not overwrite:
                raise RunError(Diagnostic("R027", f"run directory {path} already holds files", Loc(str(path)),
                                          "choose a new --run-dir, or pass --overwrite to replace a previous "
                                          "run's outputs there"))
            if overwrite:
                _remove_outputs(path, checkpoint_dir)
        try:
            with open(path / "spec.yaml", "xb") as f:
                f.write(spec_text)
        except FileExistsError:  # another run claimed it between our look and our write
            raise RunError(Diagnostic("R027", f"run directory {path} was claimed by another run", Loc(str(path)),
                                      "choose another --run-dir")) from None
    except OSError as e:
        assert path is not None  # set before anything that raises
        blocker = next((p for p in (path, *path.parents) if _is_file(p)), None)
        # mkdir's "File exists" / "Not a directory" would not say which
        err = e if blocker is None else OSError(errno.ENOTDIR, f"{blocker} is a file, not a directory", str(blocker))
        raise disk_error(err, f"cannot create the run directory {path}") from None
    return path


def default_run_dir(name: str, node_rank: int) -> str:
    """The default run directory's name (launcher.claim_run_dir adds -2, -3, ... if it is taken)."""
    return f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}" + (f"-node{node_rank}" if node_rank else "")


def new_run_dir(spec, run_dir, overwrite: bool, node_rank: int, data, text: str, in_job: bool = False):
    """Claim a run directory (`run_dir`, or a new runs/<name>-<time>) and write the program,
    the spec as trained and its fingerprint into it: (program, run dir). `in_job`: the job's
    script made RUN_DIR/job/ already (its nodes' output goes there)."""
    from placer.codegen.program import generate
    from placer.launch.resume import record_fingerprint

    ckpt = spec.training.checkpoint
    wanted = Path(run_dir) if run_dir else default_run_dir(spec.name, node_rank)
    program = generate(spec, filename="program.py", out_dir=str(wanted))  # a claimed name differs by a suffix only
    run_dir = claim_run_dir(Path(run_dir) if run_dir else None, wanted, text.encode(), overwrite=overwrite,
                            checkpoint_dir=ckpt.dir if ckpt else None, ignore=("job",) if in_job else ())
    (run_dir / "program.py").write_text(program.text)
    record_fingerprint(run_dir, data, program.reshard)
    return program, run_dir


def resumable_run_dir(path: Path, spec: Spec) -> Path:
    """`placer run --resume RUN_DIR`: RUN_DIR must be a run's directory (its spec.yaml) and the
    spec must save checkpoints to resume from (R032). Which checkpoint is the program's choice:
    the newest complete one that every rank can read."""
    if not (path / "spec.yaml").is_file():
        raise RunError(Diagnostic("R032", f"{path} is not a run directory (it has no spec.yaml)", Loc(str(path)),
                                  "pass the directory `placer run` printed as 'run dir'"))
    if spec.training.checkpoint is None:
        raise RunError(Diagnostic("R032", "--resume needs checkpoints, and the spec saves none", Loc(spec.file),
                                  "add training.checkpoint (for example --set training.checkpoint.every=10) "
                                  "to the runs you mean to resume"))
    return path


CLAIM = "RUN"
"""In a checkpoint directory outside the run directory: the run directory whose checkpoints it holds."""


def claim_checkpoint_dir(run_dir: Path, spec: Spec, resume: bool = False) -> None:
    """A training.checkpoint.dir outside the run directory (absolute, or `../`) is the same for
    every run of the spec: the run claims it by creating its RUN file exclusively (as claim_run_dir
    claims spec.yaml), and one that another run claimed, or that holds checkpoints no run claimed
    (a new run would save over them), is R029. A resume claims an unclaimed one: its own, from an
    earlier placer. Inside the run directory (the default, `ckpt`) there is nothing to claim."""
    ckpt = spec.training.checkpoint
    if ckpt is None or (run_dir / ckpt.dir).resolve().is_relative_to(run_dir.resolve()):
        return
    target, owner = (run_dir / ckpt.dir).resolve(), str(run_dir.resolve())
    try:
        target.mkdir(parents=True, exist_ok=True)
        if not resume and any(p.name.startswith("step_") for p in target.iterdir()) and \
                not (target / CLAIM).exists():
            claimed = "a run that did not claim it"
        else:
            with open(target / CLAIM, "x") as f:
                f.write(owner + "\n")
            return
    except FileExistsError:
        claimed = (target / CLAIM).read_text().strip()
    except OSError as e:
        raise disk_error(e, f"cannot create the checkpoint directory {target}") from None
    if claimed != owner:
        raise RunError(Diagnostic(
            "R029", f"training.checkpoint.dir {target} holds the checkpoints of {claimed}: two runs would write "
            "into one directory", ckpt.loc,
            "give each run its own (--set training.checkpoint.dir=...), or a relative dir, which is inside each "
            "run's directory (the default, ckpt)"))


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _is_file(path: Path) -> bool:
    try:
        return path.exists() and not path.is_dir()
    except OSError:  # a name too long to look up
        return False


def _made(path: Path) -> bool:
    """os.mkdir(path): True if this call created it, False if it exists (no check-then-create race)."""
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir()
        return True
    except FileExistsError:
        return False


def _remove_outputs(path: Path, checkpoint_dir: str | None) -> None:
    names = list(OUTPUTS)
    if checkpoint_dir and (path / checkpoint_dir).resolve().is_relative_to(path.resolve()) and \
            (path / checkpoint_dir).resolve() != path.resolve():
        names.append(checkpoint_dir)
    for name in names:
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()


def disk_error(e: OSError, doing: str) -> RunError:
    """An OSError of the run's own files as a diagnostic: a full disk (R028) or a path that
    cannot be made or written (R026)."""
    where = Loc(str(e.filename)) if e.filename else Loc()
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return RunError(Diagnostic("R028", f"the disk is full: {doing}: {e.strerror}", where,
                                   "free some space (old runs/ directories, checkpoints), or choose a --run-dir "
                                   "on another disk"))
    return RunError(Diagnostic("R026", f"{doing}: {e.strerror or e}", where,
                               "choose a --run-dir whose parent is a writable directory, with a shorter name"))


def worker_threads(nproc_per_node: int) -> int:
    """CPU threads per worker: oversubscribed threads slow a 2-core machine several-fold."""
    return max(1, (os.cpu_count() or 1) // nproc_per_node)


class Interrupted(Exception):
    """`placer run` got SIGINT or SIGTERM; the workers have been stopped."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interruptible():
    """SIGINT and SIGTERM raise Interrupted in the main thread for the block, instead of
    KeyboardInterrupt (SIGINT) or death (SIGTERM), so the run can say where it stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def interrupt(signum, frame):
        raise Interrupted(signum)
    saved = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@dataclass
class RunResult:
    ok: bool
    run_dir: Path
    metrics: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)
    """global rank -> (exit code, tail of its stderr)."""
    wall_s: float = 0.0
    attempts: int = 1
    """How many times the workers were started (1 + the restarts that happened)."""
    hang: Hang | None = None
    """When ranks timed out waiting: the rank they waited for and what each was doing."""


def _follow(path: Path, on_progress, stop: threading.Event, pos: int = 0) -> None:
    """Call on_progress(record) for each line the program appends to progress.jsonl after `pos`."""
    while not stop.is_set() or path.exists() and path.stat().st_size > pos:
        if path.exists():
            with open(path) as f:
                f.seek(pos)
                for line in f:
                    if not line.endswith("\n"):
                        break
                    pos += len(line)
                    try:
                        on_progress(json.loads(line))
                    except ValueError:
                        pass
        if stop.wait(0.2):
            stop.set()


def launch(program: Path, run_dir: Path, binding: Binding, program_args: list[str] | tuple[str, ...] = (), *,
           devices: list[str], node_rank: int = 0, rdzv_endpoint: str | None = None, max_restarts: int = 0,
           resume: bool = False, on_progress=None, on_restart=None, verbose: bool = False) -> RunResult:
    """Run `program` with one worker per device (`devices`, in rank order) through torch's
    elastic launcher; each worker's output goes to RUN_DIR/logs/<device>.log.

    `resume`: the program continues the run in `run_dir` from its newest complete checkpoint
    (progress.jsonl is appended to). Up to `max_restarts` times, a failed attempt is followed by
    a new one, which resumes the same way; on_restart(attempt, attempts, failures) is called
    first, with failures as in RunResult (global rank -> (exit code, tail of its stderr)).
    `verbose`: torch elastic's own log lines are shown (otherwise the RunResult reports failures)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from placer.launch.logs import DeviceLogs

    run_dir.mkdir(parents=True, exist_ok=True)
    for name in (PROGRESS, "stopped.json") if not resume else ("stopped.json",):  # this run's only
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / STATUS_DIR, ignore_errors=True)  # a resumed run's earlier workers' statuses
    saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PLACER_LAUNCHER_PID", SHARED_STORE,
                                                 "PYTHONUNBUFFERED")}
    os.environ["PYTHONUNBUFFERED"] = "1"  # prints and tracebacks reach the worker's log in order
    os.environ["OMP_NUM_THREADS"] = str(worker_threads(binding.nproc_per_node))  # the workers inherit it
    os.environ["PLACER_LAUNCHER_PID"] = str(os.getpid())  # the workers end with this process (die_with_launcher)
    # Where a run may restart, workers get a store of their own each attempt: the rendezvous store
    # shared with them keeps the keys of the attempt before, and restarted workers would wait in
    # init_process_group. A single attempt on one node shares it, as torchrun does: with a store
    # of their own a 5-step run took 0.17 s longer at the median, twice as spread (6 pairs).
    if max_restarts or binding.nnodes > 1:
        os.environ[SHARED_STORE] = "1"
    else:
        os.environ.pop(SHARED_STORE, None)
    # One node: a private c10d rendezvous on a free port. Several: the static rendezvous, which
    # (unlike c10d's, which orders nodes by arrival) makes node K's workers ranks K*n .. K*n+n-1,
    # so the spec's nodeK/ devices run on the machine started with --node-rank K.
    multi = binding.nnodes > 1
    config = LaunchConfig(
        min_nodes=binding.nnodes, max_nodes=binding.nnodes, nproc_per_node=binding.nproc_per_node,
        run_id=os.environ.get("PLACER_RUN_ID", uuid.uuid4().hex[:12]) if not multi else "placer",
        rdzv_backend="static" if multi else "c10d", rdzv_endpoint=rdzv_endpoint or "127.0.0.1:0",
        rdzv_configs={"rank": node_rank, "timeout": 120} if multi else {},
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
        logs_specs=DeviceLogs(run_dir / "logs", devices),
    )
    args = [str(program), "--out", str(run_dir), "--measure", *program_args] + (["--simulate"] if binding.simulate else []) \
        + (["--resume"] if resume else [])
    stop = threading.Event()
    follower = None
    if on_progress:
        # a resumed run's file holds the earlier runs' records: only this run's are news
        start = (run_dir / PROGRESS).stat().st_size if resume and (run_dir / PROGRESS).exists() else 0
        follower = threading.Thread(target=_follow, args=(run_dir / PROGRESS, on_progress, stop, start), daemon=True)
        follower.start()
    watchdog = Watchdog(run_dir)  # kills a stopped worker that the launcher is ending
    if sys.platform.startswith("linux"):
        watchdog.start()
    t0 = time.perf_counter()
    result = RunResult(ok=True, run_dir=run_dir)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with _quiet_launcher(not verbose), _frame_names(), _restarts_reported(run_dir, devices, max_restarts, result, on_restart,
                                                              watchdog):
            elastic_launch(config, entrypoint=sys.executable)(*args)
    except SignalException as e:  # the agent has stopped the workers with the same signal
        raise Interrupted(e.sigval) from None
    except ChildFailedError as e:
        result.ok = False
        for rank, failure in e.failures.items():  # keyed by global rank
            result.failures[rank] = (failure.exitcode, _log_tail(run_dir, devices[rank]))
        watchdog.stop()
        result.hang = hang_of({r: (c, tail, e.failures[r].pid) for r, (c, tail) in result.failures.items()},
                              read_statuses(run_dir), set(watchdog.stopped))
    except (RendezvousError, RuntimeError, OSError) as e:  # the nodes never met: nothing ran
        where = f" at {rdzv_endpoint}" if rdzv_endpoint else ""
        raise RunError(Diagnostic("R023", f"the workers could not start{where}: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}", Loc(str(program)),
                                  "check --rdzv-endpoint (node 0's HOST:PORT, reachable from every node) "
                                  "and start `placer run` on every node")) from None
    finally:
        watchdog.stop()
        stop.set()
        if follower:
            follower.join(timeout=2)
        if threading.current_thread() is threading.main_thread():  # the agent installed its own
            for s, handler in handlers.items():
                signal.signal(s, handler)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    result.wall_s = time.perf_counter() - t0
    metrics = run_dir / METRICS
    if metrics.exists():
        result.metrics = json.loads(metrics.read_text())
    return result


SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@contextlib.contextmanager
def _restarts_reported(run_dir: Path, devices: list[str], max_restarts: int, result: RunResult, on_restart,
                       watchdog: Watchdog):
    """While the block runs, torch's elastic agent tells us of each attempt that failed before it
    starts the next (its own log says only "will restart worker group"): the failures it saw
    (and the hang behind them, if ranks timed out) go to on_restart, and result.attempts counts
    the attempts. torch has no public hook for this: two of its methods are wrapped for the
    block (tests/unit/test_hang_report.py fails when a torch release renames them)."""
    try:
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        monitor, restart = LocalElasticAgent._monitor_workers, SimpleElasticAgent._restart_workers
    except (ImportError, AttributeError):  # another torch: restarts still happen, unreported
        yield
        return
    seen: dict = {}

    def monitored(agent, worker_group):
        outcome = monitor(agent, worker_group)
        seen["failures"] = getattr(outcome, "failures", {}) or {}
        return outcome

    def restarted(agent, worker_group):
        failed = seen.get("failures", {})
        failures = {rank: (f.exitcode, _log_tail(run_dir, devices[rank])) for rank, f in failed.items()}
        result.attempts += 1
        if on_restart:
            with contextlib.suppress(Exception):  # a report must never stop the restart
                hang = hang_of({r: (c, tail, failed[r].pid) for r, (c, tail) in failures.items()},
                               read_statuses(run_dir), set(watchdog.stopped))
                on_restart(result.attempts - 1, max_restarts + 1, failures, hang=hang)
        return restart(agent, worker_group)

    # patched on the classes for the launch only (setattr: torch's methods, replaced on purpose)
    setattr(LocalElasticAgent, "_monitor_workers", monitored)
    setattr(SimpleElasticAgent, "_restart_workers", restarted)
    try:
        yield
    finally:
        setattr(LocalElasticAgent, "_monitor_workers", monitor)
        setattr(SimpleElasticAgent, "_restart_workers", restart)


@contextlib.contextmanager
def _frame_names():
    """torch's dynamic rendezvous names the method behind each event it records with two calls of
    inspect.stack(), which reads the source lines of every frame on the stack: under placer's
    deeper stack about 0.3 s of a run's start (700 getframeinfo calls). The same name, read from
    the frame itself, while placer launches."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
        slow = rdzv.get_method_name
    except (ImportError, AttributeError):
        yield
        return

    def get_method_name(depth=2):
        try:
            return sys._getframe(depth).f_code.co_name  # 0: this frame, as inspect.stack()[0]
        except ValueError:
            return "no_method_name"

    rdzv.get_method_name = get_method_name
    try:
        yield
    finally:
        rdzv.get_method_name = slow


@contextlib.contextmanager
def _quiet_launcher(quiet: bool = True):
    """The launcher logs each failure and SIGTERM it sends; the RunResult reports them instead
    (`quiet` False, for -v: its INFO lines too)."""
    if not quiet:
        logging.basicConfig(format="%(message)s")
        logging.getLogger("torch.distributed.elastic").setLevel(logging.INFO)
        yield
        return
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith("torch.distributed.elastic")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _log_tail(run_dir: Path, device: str, lines: int = 400) -> str:
    """The end of the device's newest log: enough to hold a traceback whose message ends in a
    long repr (a module's), whole."""
    from placer.launch.logs import read_log

    text = [_RANK_PREFIX.sub("", line) for line in read_log(run_dir, device).splitlines()]
    return "\n".join(text[-lines:])


_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")  # torch prefixes worker errors with their rank
