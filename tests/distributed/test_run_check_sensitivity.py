"""run --check's sensitivity report on real runs over two gloo ranks. DDP at a tolerance tighter
than float32 fails on rounding alone (the all-reduce adds the halves' gradients in another order):
the reference nudged by 1e-7 moves as far, and the hint says float drift. Dropout under DDP draws
other masks than the one-device run: off by millions of times the nudge, the hint says it is not."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from placer.cli.main import main

pytestmark = pytest.mark.distributed

SPEC = """placer: 1
name: sensitivity
model:
  layers:
    - {name: fc1, op: Linear, args: [32, 64]}
    - {name: act1, op: ReLU}
    - {name: drop, op: Dropout, args: [P]}
    - {name: head, op: Linear, args: [64, 10]}
  input: {shape: [B, 32]}
  target: {shape: [B], dtype: int64, high: 10}
  loss: CrossEntropyLoss
devices: [cpu:0, cpu:1]
placement:
  - {layers: fc1..head, devices: [cpu:0, cpu:1], parallel: data}
training:
  batch_size: 16
  steps: 3
  optimizer: {op: SGD, lr: 0.05}
  seed: 0
"""

CASES = {  # dropout p, extra options, float drift?
    "rounding": ("0.0", ["--rtol", "1e-12", "--atol", "0"], True),
    "dropout": ("0.2", [], False),
}


@pytest.mark.parametrize("case", CASES)
def test_a_failed_check_says_whether_the_reference_moves_as_far(case, tmp_path):
    p, options, drift = CASES[case]
    spec, run_dir = tmp_path / "spec.yaml", tmp_path / "run"
    spec.write_text(SPEC.replace("[P]", f"[{p}]"))
    result = CliRunner().invoke(main, ["run", str(spec), "--check", "--run-dir", str(run_dir), *options])
    assert result.exit_code == 1, result.output
    check = json.loads((run_dir / "check.json").read_text())
    sens = check["sensitivity"]
    assert not check["ok"] and sens["drift"] is drift and sens["perturb"] == 1e-7
    assert (run_dir / "reference_nudged" / "final_params.pt").exists()
    nudged_loss, nudged_params = sens["nudged"][:2]
    assert 0 < nudged_params < 1e-6 and nudged_loss < 1e-5  # a rounding's worth, after 3 steps
    assert "nudged vs reference: loss" in result.output
    if drift:
        assert "hint: float drift: a 1e-07 nudge" in result.output and "Dropout" not in result.output
    else:
        assert "hint: not float drift" in result.output and "(Dropout)" in result.output
        assert sens["run"][0] > 1e3 * nudged_loss
