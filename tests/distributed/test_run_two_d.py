"""2-D segments under `placer run --check`: tensor x data (`parallel: {mode: tensor, data: D}`)
trains exactly as one device does (rtol 1e-5, atol 4e-5), and every device sends what the plan
says, whether the 2-D segment sits between one-device segments (its input arrives through the
replicas' first devices) or holds the whole model (each replica takes its rows of the batch and
computes the loss on them)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.test_run_modes import ATOL, ROOT, RTOL, STEPS, assert_sends_what_the_plan_says, run_check

pytestmark = pytest.mark.distributed

SPECS = [("specs/mlp_tensor_data.yaml", 4), ("tests/cases/valid/tensor_data_whole_model/spec.yaml", 6),
         ("tests/models/tinygpt_tensor_data.yaml", 4)]  # the shipped TinyGPT: DTensor blocks in each replica


@pytest.mark.parametrize("spec,workers", SPECS, ids=[Path(s).parent.name if s.endswith("spec.yaml") else Path(s).stem
                                                     for s, _ in SPECS])
def test_tensor_x_data_matches_one_device_and_sends_what_the_plan_says(spec, workers, tmp_path):
    run_dir = tmp_path / "run"
    result = run_check(spec, run_dir)
    assert result.exit_code == 0, result.output + (run_dir / "run.log").read_text()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == workers
    run_p = torch.load(run_dir / "final_params.pt")
    ref_p = torch.load(run_dir / "reference" / "final_params.pt")
    assert set(run_p) == set(ref_p)
    for name, value in ref_p.items():
        torch.testing.assert_close(run_p[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    assert len(metrics["losses"]) == STEPS
    program = (run_dir / "program.py").read_text()
    assert "all_reduce_slices(seg" in program  # the replicas' gradients are summed, not left apart
    assert_sends_what_the_plan_says(Path(spec).stem, ROOT / spec, metrics)
