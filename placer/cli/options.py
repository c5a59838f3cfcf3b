"""Options that several commands share, and the hints for options they do not take."""
from __future__ import annotations

import click

from placer.spec.load import split_override


def _check_overrides(ctx, param, values):
    for text in values:
        try:
            split_override(text)
        except ValueError as e:
            raise click.BadParameter(str(e), ctx, param) from None
    return values


def set_option(f):
    """`--set KEY=VALUE` (repeatable): change the spec without editing it, checked like the file."""
    return click.option(
        "--set", "overrides", multiple=True, metavar="KEY=VALUE", callback=_check_overrides,
        help="Override a value of the spec, e.g. --set training.batch_size=64 --set runtime.max_restarts=2 "
             "--set 'devices=[cpu, cuda:0]' (list items by index: placement.0.device=cpu). Repeatable; "
             "VALUE is YAML; the result is validated like the file and errors name the override.")(f)


# torchrun's flags (and a few other launchers' habits): where placer decides the same thing.
_FROM_SPEC = "the spec decides it: one worker (rank) per device listed in `devices:`"
_MACHINES = ("machines are the spec's `nodeK/` device prefixes (`node1/cuda:0`); "
             "`placer run` takes --nnodes N --node-rank K --rdzv-endpoint HOST:PORT on each machine")
_RENDEZVOUS = "`placer run --rdzv-endpoint HOST:PORT` (node 0's address, with --nnodes); on one machine " \
              "placer picks a free port itself"
LAUNCHER_FLAGS = {
    "nproc-per-node": _FROM_SPEC,
    "nproc": _FROM_SPEC,
    "num-processes": _FROM_SPEC,
    "world-size": _FROM_SPEC,
    "gpus": _FROM_SPEC,
    "nnodes": _MACHINES,
    "node-rank": _MACHINES,
    "num-machines": _MACHINES,
    "master-addr": _RENDEZVOUS,
    "master-port": _RENDEZVOUS,
    "main-process-ip": _RENDEZVOUS,
    "main-process-port": _RENDEZVOUS,
    "rdzv-endpoint": _RENDEZVOUS,
    "rdzv-backend": "placer run uses torch's c10d rendezvous; give --rdzv-endpoint HOST:PORT for several machines",
    "rdzv-id": "placer run names the rendezvous itself; give --rdzv-endpoint HOST:PORT for several machines",
    "standalone": "placer run on one machine is standalone already (no rendezvous to set up)",
    "max-restarts": "`placer run --max-restarts N`, or `runtime.max_restarts` in the spec",
    "tee": "placer run keeps every worker's output in RUN_DIR/logs/<device>.log and the run's own in "
           "RUN_DIR/run.log",
    "log-dir": "placer run keeps every worker's output in RUN_DIR/logs/<device>.log (--run-dir chooses RUN_DIR)",
    "redirects": "placer run keeps every worker's output in RUN_DIR/logs/<device>.log (--run-dir chooses RUN_DIR)",
    "backend": "the spec decides it: `runtime.backend` (auto: nccl between cuda devices, gloo otherwise); "
               "--set runtime.backend=gloo",
    "batch-size": "the spec decides it: `training.batch_size` (--set training.batch_size=64)",
    "lr": "the spec decides it: `training.optimizer.lr` (--set training.optimizer.lr=0.01)",
    "seed": "the spec decides it: `training.seed` (--set training.seed=1)",
}


def launcher_hint(option: str) -> str | None:
    """The hint for an option placer does not take, spelled torchrun's way or with underscores."""
    return LAUNCHER_FLAGS.get(option.lstrip("-").replace("_", "-").lower())
