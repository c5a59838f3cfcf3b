"""Checks `generate` makes before a program is handed to workers: what would otherwise fail
in every worker at once (or as a crash of placer itself) fails here, as a located error."""
from __future__ import annotations

import ast
import inspect

from placer.diagnostics import Diagnostic, PlanError, SpecError, did_you_mean
from placer.spec.types import Spec


def check_optimizer(spec: Spec) -> None:
    """Build the spec's optimizer on a one-element parameter and take one step: kwargs of the
    wrong type (`momentum: "fast"`) or name fail here, at the kwarg that causes it (G004)."""
    import torch

    opt = spec.training.optimizer
    cls = getattr(torch.optim, opt.op, None)
    if not isinstance(cls, type):  # an unknown name is P052's (validate) to report
        return
    base = {"lr": opt.lr} if opt.lr is not None else {}

    def problem(kwargs: dict) -> str | None:
        try:
            param = torch.nn.Parameter(torch.zeros(1))
            optimizer = cls([param], **kwargs)
            param.grad = torch.zeros(1)
            optimizer.step()
        except Exception as e:  # whatever torch raises for a bad argument
            return f"{type(e).__name__}: {e}"
        return None

    why = problem(base | opt.kwargs)
    if why is None:
        return
    # point at the first kwarg that fails on its own with the same error; else at them all
    culprit = next((k for k in opt.kwargs if problem(base | {k: opt.kwargs[k]}) == why), None)
    path: tuple[str, ...]
    if culprit is not None:
        path, what = ("training", "optimizer", "kwargs", culprit), f"{culprit}={opt.kwargs[culprit]!r}"
    elif opt.lr is not None and problem(base) == why:
        path, what = ("training", "optimizer", "lr"), f"lr={opt.lr!r}"
    else:
        path, what = ("training", "optimizer", "kwargs"), ", ".join(f"{k}={v!r}" for k, v in opt.kwargs.items())
    known = [p for p in inspect.signature(cls).parameters if p not in ("self", "params")]
    hint = (did_you_mean(culprit, known) if culprit and culprit not in known else None) or \
        f"torch.optim.{opt.op} takes {', '.join(known)}; check the values' types"
    raise SpecError(Diagnostic("G004", f"torch.optim.{opt.op} rejects {what}: {why}", spec.doc.loc(path), hint))


def check_lr_schedule(spec: Spec) -> None:
    """Build the spec's lr_schedule on an SGD of one parameter and step it twice: a kwarg of
    the wrong name or type (`T_max: "ten"`) fails here, located at lr_schedule (G006)."""
    import torch

    sched = spec.training.lr_schedule
    if sched is None:
        return
    cls = getattr(torch.optim.lr_scheduler, sched.op, None)
    if not isinstance(cls, type):  # an unknown name is P090's (validate) to report
        return
    try:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=spec.training.optimizer.lr or 0.1)
        scheduler = cls(optimizer, **sched.kwargs)
        for _ in range(2):
            optimizer.step()
            scheduler.step()
    except Exception as e:  # whatever torch raises for a bad argument
        known = [p for p in inspect.signature(cls).parameters if p not in ("self", "optimizer")]
        raise SpecError(Diagnostic("G006", f"torch.optim.lr_scheduler.{sched.op} rejects its kwargs: "
                                   f"{type(e).__name__}: {e}", spec.doc.loc(("training", "lr_schedule")),
                                   f"it takes {', '.join(known)}")) from None


def parse_program(text: str, spec: Spec) -> None:
    """The generated text must parse; if not, report it (G005) rather than crash."""
    try:
        ast.parse(text)
    except SyntaxError as e:
        line = (e.text or "").strip()
        raise PlanError(Diagnostic("G005", f"the generated program does not parse: {e.msg} at its line "
                                   f"{e.lineno}: {line[:120]!r}", spec.doc.loc(()),
                                   "a placer bug, or a spec value that should have been refused: please report "
                                   "it with the spec")) from None
