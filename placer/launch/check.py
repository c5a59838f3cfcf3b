"""`run --check`: compare a parallel run with the one-device reference.

Both runs write `metrics.json` (with per-step `losses`), `final_params.pt`
(the whole model's parameters under the reference model's names; a tied
parameter under each of its names, the run's copies each from the rank that
holds it) and `first_grads.pt` (each parameter's gradient as the first step
takes it). The check passes when every step's loss and every final parameter
agree within float32 tolerance, and every first-step gradient agrees relative
to its own scale: a wrong gradient fails however small the learning rate that
would hide it in the parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

RTOL = 1e-5
ATOL = 4e-5
BF16_RTOL, BF16_ATOL = 2e-2, 2e-3
"""precision bf16: the run and the bf16 reference round the same products to bfloat16 (8 bits of
mantissa) after sums over other rows (each rank's) and in another order: agreement to about
bfloat16's resolution, 2**-8 ~ 4e-3, a few roundings deep."""
GRAD_RTOL = 10
"""A gradient matches when max |diff| <= GRAD_RTOL * rtol * max |reference gradient| + a floor
(1e-4 of its largest element by default: sums over ranks add in another order). The floor is
GRAD_FLOOR * rtol of the model's largest gradient (at least atol / 1000): a gradient zero by
construction (attention's key bias, which the softmax cancels) is all rounding, of the size of
the others' (bf16: the measured gap is 1.1e-5, its scale 1.9e-5, the largest gradient's ~0.1)."""
GRAD_FLOOR = 0.05


@dataclass
class CheckReport:
    ok: bool
    steps: list = field(default_factory=list)
    """(step, run loss, reference loss, abs diff, ok) per step; steps count from 1."""
    params: list = field(default_factory=list)
    """(name, numel, max abs diff, max rel diff, ok) per parameter."""
    first_bad_step: int | None = None
    first_bad_param: str | None = None
    problem: str | None = None
    """A mismatch in structure (missing parameters, step counts) rather than values."""
    grads: list = field(default_factory=list)
    """(name, numel, max abs diff, max abs reference gradient, ok) per first-step gradient compared."""
    first_bad_grad: str | None = None
    grads_unrecorded: list = field(default_factory=list)
    """Parameters whose first-step gradient the reference recorded and the run did not."""
    tied: list = field(default_factory=list)
    """Names of each tied parameter (one list per parameter), from the reference."""
    rtol: float = RTOL
    atol: float = ATOL

    @property
    def max_param_abs(self) -> float:
        return max((p[2] for p in self.params), default=0.0)

    @property
    def max_loss_abs(self) -> float:
        return max((s[3] for s in self.steps), default=0.0)

    def as_dict(self) -> dict:
        return {
            "ok": self.ok, "rtol": self.rtol, "atol": self.atol, "problem": self.problem,
            "first_bad_step": self.first_bad_step, "first_bad_param": self.first_bad_param,
            "first_bad_grad": self.first_bad_grad, "tied": self.tied,
            "max_loss_abs_diff": self.max_loss_abs, "max_param_abs_diff": self.max_param_abs,
            "steps": [dict(zip(("step", "loss", "reference", "abs_diff", "ok"), s)) for s in self.steps],
            "params": [dict(zip(("name", "numel", "max_abs_diff", "max_rel_diff", "ok"), p)) for p in self.params],
            "grads": [dict(zip(("name", "numel", "max_abs_diff", "scale", "ok"), g)) for g in self.grads],
            "grads_unrecorded": self.grads_unrecorded,
        }

    def tie_of(self, name: str | None) -> list[str] | None:
        """The names of the tied parameter `name` is one of, if it is."""
        return next((t for t in self.tied if name in t), None)


def compare(run_dir: Path, ref_dir: Path, rtol: float = RTOL, atol: float = ATOL) -> CheckReport:
    import json

    import torch

    run_m = json.loads((run_dir / "metrics.json").read_text())
    ref_m = json.loads((ref_dir / "metrics.json").read_text())
    report = CheckReport(ok=True, tied=ref_m.get("tied", []), rtol=rtol, atol=atol)
    run_l, ref_l = run_m["losses"], ref_m["losses"]
    for i, (a, b) in enumerate(zip(run_l, ref_l), start=1):
        ok = abs(a - b) <= atol + rtol * abs(b)
        report.steps.append((i, a, b, abs(a - b), ok))
        if not ok and report.first_bad_step is None:
            report.first_bad_step = i
    if len(run_l) != len(ref_l):
        report.problem = f"the run made {len(run_l)} steps, the reference {len(ref_l)}"
    run_p = torch.load(run_dir / "final_params.pt", map_location="cpu", weights_only=True)
    ref_p = torch.load(ref_dir / "final_params.pt", map_location="cpu", weights_only=True)
    missing, extra = sorted(set(ref_p) - set(run_p)), sorted(set(run_p) - set(ref_p))
    if missing or extra:
        report.problem = (f"parameters missing from the run: {missing[:5]}" if missing
                          else f"parameters the reference lacks: {extra[:5]}")
    for name in ref_p:
        if name not in run_p:
            continue
        a, b = run_p[name].float(), ref_p[name].float()
        if a.shape != b.shape:
            report.params.append((name, b.numel(), float("inf"), float("inf"), False))
            report.first_bad_param = report.first_bad_param or name
            continue
        diff = (a - b).abs()
        ok = bool(torch.allclose(a, b, rtol=rtol, atol=atol))
        rel = float((diff / b.abs().clamp_min(1e-12)).max()) if b.numel() else 0.0
        report.params.append((name, b.numel(), float(diff.max()) if b.numel() else 0.0, rel, ok))
        if not ok and report.first_bad_param is None:
            report.first_bad_param = name
    _compare_grads(report, run_dir / "first_grads.pt", ref_dir / "first_grads.pt")
    report.ok = (report.problem is None and report.first_bad_step is None and report.first_bad_param is None
                 and report.first_bad_grad is None)
    return report


def _compare_grads(report: CheckReport, run_file: Path, ref_file: Path) -> None:
    """Each first-step gradient the run recorded against the reference's, relative to its scale.
    (A run gathers split parameters' gradients whole: DTensors of tensor parallel and FSDP2, channel slices.)"""
    import torch

    if not (run_file.exists() and ref_file.exists()):
        return
    run_g = torch.load(run_file, map_location="cpu", weights_only=True)
    ref_g = torch.load(ref_file, map_location="cpu", weights_only=True)
    pairs = [(name, run_g[name].float(), b.float()) for name, b in ref_g.items() if name in run_g]
    report.grads_unrecorded = [name for name in ref_g if name not in run_g]
    top = max((float(b.abs().max()) for _, _, b in pairs if b.numel()), default=0.0)
    floor = max(GRAD_FLOOR * report.rtol * top, report.atol / 1000)
    for name, a, b in pairs:
        if a.shape != b.shape:
            diff, scale = float("inf"), float("inf")
        else:
            diff = float((a - b).abs().max()) if b.numel() else 0.0
            scale = float(b.abs().max()) if b.numel() else 0.0
        ok = diff <= GRAD_RTOL * report.rtol * scale + floor
        report.grads.append((name, b.numel(), diff, scale, ok))
        if not ok and report.first_bad_grad is None:
            report.first_bad_grad = name


PERTURB = 1e-7
"""How much `run --check` nudges the reference's initial weights (relative) to see how far float
rounding alone moves the model: about float32's own rounding (2**-24 ~ 6e-8)."""
DRIFT = 100
"""A failing run whose gaps stay within DRIFT times the nudged reference's is float drift; a
bug (a gradient summed twice, a copy trained on its own) lands orders of magnitude further off
than one rounding-sized nudge does."""


def grad_gap(report: CheckReport) -> float:
    """The largest first-step gradient difference relative to its gradient's scale."""
    return max((g[2] / g[3] if g[3] else g[2] for g in report.grads), default=0.0)


@dataclass(frozen=True)
class Sensitivity:
    """How far the run is from the reference, beside how far a PERTURB nudge of the initial weights
    moves the reference: largest loss and parameter differences, and first-step gradient
    differences relative to their scale."""
    run: tuple[float, float, float]
    nudged: tuple[float, float, float]
    failed: tuple[bool, bool, bool]
    """Which of the three the check failed on: only those are judged (a loss within tolerance
    may still differ by a rounding where the nudge moved it by none)."""
    perturb: float = PERTURB

    @classmethod
    def of(cls, report: CheckReport, nudged: CheckReport, perturb: float = PERTURB) -> Sensitivity:
        """From the run's report and the nudged reference's report against the reference."""
        def gaps(r):  # a nan anywhere is an infinite gap (max() would skip it)
            return (max((s[3] if math.isfinite(s[3]) else math.inf for s in r.steps), default=0.0),
                    max((p[2] if math.isfinite(p[2]) else math.inf for p in r.params), default=0.0), grad_gap(r))
        failed = (report.first_bad_step is not None, report.first_bad_param is not None,
                  report.first_bad_grad is not None)
        return cls(gaps(report), gaps(nudged), failed, perturb)

    @property
    def drift(self) -> bool:
        """Every gap the check failed on within DRIFT times the nudged reference's: the model
        amplifies rounding."""
        return all(a <= DRIFT * b for a, b, f in zip(self.run, self.nudged, self.failed) if f)

    def lines(self) -> list[str]:
        def row(gaps):
            return f"loss {gaps[0]:.2e}, parameters {gaps[1]:.2e}, first-step gradients {gaps[2]:.2e} of their scale"
        return [f"  sensitivity: the reference again, its initial weights nudged by {self.perturb:g} (relative)",
                f"    run vs reference:    {row(self.run)}",
                f"    nudged vs reference: {row(self.nudged)}"]

    def verdict(self) -> str:
        nudge = (f"a {self.perturb:g} nudge of the initial weights moves the reference itself by "
                 f"{self.nudged[0]:.2e} in the loss and {self.nudged[1]:.2e} in the parameters")
        if self.drift:
            return (f"float drift: {nudge}, and the run is off by no more than {DRIFT}x that: the model amplifies "
                    "rounding (BatchNorm, many steps, a high learning rate); compare with a looser --rtol/--atol "
                    "or fewer --steps")
        if not all(map(math.isfinite, self.run)):
            return f"not float drift: the run's values are not finite, though {nudge}"
        worst = max(a / b if b else math.inf for a, b, f in zip(self.run, self.nudged, self.failed)
                    if f and a > DRIFT * b)
        return (f"not float drift: {nudge}; the run is {worst:.1e} times further off" if math.isfinite(worst) else
                f"not float drift: {nudge}; the run is off where the nudge moves nothing")


def sensitivity_hint(report: CheckReport, sens: Sensitivity | None, boundaries: list[str]) -> str:
    """What to look at when the check fails: float drift or not (`sens`, when the losses or parameters
    differ), the tied parameter that differs, the boundaries where several tensors cross."""
    parts = [sens.verdict()] if sens else []
    drift = sens is not None and sens.drift
    bad = next((n for n in (report.first_bad_grad, report.first_bad_param) if report.tie_of(n)), None)
    if bad:
        parts.append(f"{bad!r} is a tied parameter ({' = '.join(report.tie_of(bad) or [])}): every copy must get "
                     "the sum of all copies' gradients and take the same step; a copy trained on its own part drifts")
    if boundaries and not drift:
        parts.append("several tensors cross " + "; ".join(boundaries) + ": each must arrive, and its gradient go "
                     "back, as the plan lists them")
    if not drift and not bad:
        parts.append("a layer with randomness (Dropout) or a mode that changes numerics cannot match "
                     "(--rtol/--atol loosen the tolerance)")
    return "; ".join(parts) + " (see RUN_DIR/reference and the table above)"
