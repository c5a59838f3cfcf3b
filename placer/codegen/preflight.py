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
