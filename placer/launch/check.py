"""`run --check`: compare a parallel run with the one-device reference.

Both runs write `metrics.json` (with per-step `losses`) and `final_params.pt`
(the whole model's parameters under the reference model's names). The
check passes when every step's loss and every final parameter agree within
float32 tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

RTOL = 1e-5
ATOL = 4e-5


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

    @property
    def max_param_abs(self) -> float:
        return max((p[2] for p in self.params), default=0.0)

    @property
    def max_loss_abs(self) -> float:
        return max((s[3] for s in self.steps), default=0.0)

    def as_dict(self) -> dict:
        return {
            "ok": self.ok, "rtol": RTOL, "atol": ATOL, "problem": self.problem,
            "first_bad_step": self.first_bad_step, "first_bad_param": self.first_bad_param,
            "max_loss_abs_diff": self.max_loss_abs, "max_param_abs_diff": self.max_param_abs,
            "steps": [dict(zip(("step", "loss", "reference", "abs_diff", "ok"), s)) for s in self.steps],
            "params": [dict(zip(("name", "numel", "max_abs_diff", "max_rel_diff", "ok"), p)) for p in self.params],
        }


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= ATOL + RTOL * abs(b)


def compare(run_dir: Path, ref_dir: Path) -> CheckReport:
    import json

    import torch

    run_m = json.loads((run_dir / "metrics.json").read_text())
    ref_m = json.loads((ref_dir / "metrics.json").read_text())
    report = CheckReport(ok=True)
    run_l, ref_l = run_m["losses"], ref_m["losses"]
    for i, (a, b) in enumerate(zip(run_l, ref_l), start=1):
        ok = _close(a, b)
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
        ok = bool(torch.allclose(a, b, rtol=RTOL, atol=ATOL))
        rel = float((diff / b.abs().clamp_min(1e-12)).max()) if b.numel() else 0.0
        report.params.append((name, b.numel(), float(diff.max()) if b.numel() else 0.0, rel, ok))
        if not ok and report.first_bad_param is None:
            report.first_bad_param = name
    report.ok = (report.problem is None and report.first_bad_step is None and report.first_bad_param is None)
    return report
