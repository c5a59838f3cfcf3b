"""run --check's sensitivity report: when a run's losses or parameters differ, the reference is
trained again with its initial weights nudged by 1e-7 (the program's --perturb), and the two gaps
tell float drift (the model amplifies rounding) from a bug; the hint names the tied parameter
and the boundaries where several tensors cross."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from placer.codegen.program import generate
from placer.launch.check import ATOL, DRIFT, Sensitivity, compare, sensitivity_hint
from placer.plan.crossings import multi_tensor_boundaries
from placer.spec.check import load_spec

ROOT = Path(__file__).resolve().parents[2]
W = {"fc.weight": torch.linspace(-1, 1, 16).reshape(4, 4), "fc.bias": torch.zeros(4)}
G = {"fc.weight": torch.linspace(-2, 2, 16).reshape(4, 4), "fc.bias": torch.ones(4)}
LLAMA_BOUNDARY = ("cpu -> cpu:1 (3 tensors: model.rotary_emb[0], model.rotary_emb[1], model.layers.0[0])")


def outputs(path: Path, loss_shift=0.0, param_shift=0.0, grad_shift=0.0, tied=()) -> Path:
    path.mkdir()
    (path / "metrics.json").write_text(json.dumps({"losses": [2.0, 1.5 + loss_shift],
                                                   "tied": [list(t) for t in tied]}))
    torch.save({k: v + param_shift for k, v in W.items()}, path / "final_params.pt")
    torch.save({k: v + grad_shift for k, v in G.items()}, path / "first_grads.pt")
    return path


def sensitivity(tmp_path, run: dict, nudged: dict, tied=()):
    ref = outputs(tmp_path / "ref", tied=tied)
    report = compare(outputs(tmp_path / "run", **run), ref)
    return report, Sensitivity.of(report, compare(outputs(tmp_path / "nudged", **nudged), ref))


def test_a_gap_the_nudge_also_makes_is_float_drift(tmp_path):
    """A BatchNorm-heavy model: a 1e-7 nudge moves the reference by a third of what the run is off."""
    report, sens = sensitivity(tmp_path, dict(loss_shift=3e-4, param_shift=1e-3, grad_shift=2e-7),
                               dict(loss_shift=1e-4, param_shift=4e-4, grad_shift=1e-7))
    assert not report.ok and report.first_bad_step == 2 and report.first_bad_param == "fc.weight"
    assert sens.drift and sens.run[1] == report.max_param_abs
    hint = sensitivity_hint(report, sens, [LLAMA_BOUNDARY])
    assert hint.startswith("float drift: a 1e-07 nudge of the initial weights moves the reference itself by 1.00e-04 "
                           "in the loss and 4.00e-04 in the parameters, and the run is off by no more than 100x that")
    assert "Dropout" not in hint and "several tensors" not in hint
    assert "nudged vs reference: loss 1.00e-04, parameters 4.00e-04" in "\n".join(sens.lines())


def test_a_gap_far_beyond_the_nudge_is_a_bug_and_the_hint_names_the_boundaries(tmp_path):
    report, sens = sensitivity(tmp_path, dict(loss_shift=1e-2, param_shift=1e-3),
                               dict(loss_shift=1e-7, param_shift=1e-7, grad_shift=1e-8))
    assert not sens.drift
    hint = sensitivity_hint(report, sens, [LLAMA_BOUNDARY])
    assert hint.startswith("not float drift: a 1e-07 nudge") and "the run is 1.0e+05 times further off" in hint
    assert f"several tensors cross {LLAMA_BOUNDARY}: each must arrive" in hint and "Dropout" in hint


def test_first_step_gradients_count_relative_to_their_scale(tmp_path):
    """Losses and parameters within DRIFT of the nudge's, but a gradient off by far more: no drift."""
    _, sens = sensitivity(tmp_path, dict(loss_shift=1e-4, param_shift=1e-4, grad_shift=1e-2),
                          dict(loss_shift=1e-4, param_shift=1e-4, grad_shift=1e-7))
    assert sens.run[2] == pytest.approx(1e-2) and not sens.drift  # the bias: 1e-2 of a gradient of ones
    assert DRIFT * sens.nudged[0] >= sens.run[0] and sens.failed == (True, True, True)


def test_only_what_failed_is_judged(tmp_path):
    """The parameters drift; the losses agree within tolerance, though the nudge left them bit-equal."""
    report, sens = sensitivity(tmp_path, dict(loss_shift=2e-7, param_shift=1e-3), dict(param_shift=1e-4))
    assert report.first_bad_step is None and sens.nudged[0] == 0 < sens.run[0]
    assert sens.failed == (False, True, False) and sens.drift


def test_the_hint_names_the_tied_parameter(tmp_path):
    report, sens = sensitivity(tmp_path, dict(param_shift=1e-2), dict(param_shift=1e-7),
                               tied=[("fc.weight", "fc.bias")])
    hint = sensitivity_hint(report, sens, [])
    assert "'fc.weight' is a tied parameter (fc.weight = fc.bias)" in hint and "Dropout" not in hint


def test_a_non_finite_run_is_no_drift(tmp_path):
    report, sens = sensitivity(tmp_path, dict(loss_shift=float("nan")), dict(loss_shift=1e-7))
    assert not sens.drift and sensitivity_hint(report, sens, []).startswith("not float drift: the run's values")


def test_the_plan_names_boundaries_where_several_tensors_cross():
    """Llama layer-wise: the hidden state and rotary's (cos, sin) cross from cpu to cpu:1."""
    from placer.model.build import checked_graph
    from placer.plan.lower import lower
    from placer.plan.place import place

    spec = load_spec(str(ROOT / "tests/models/hf_llama_layerwise.yaml"))
    graph = checked_graph(spec)
    assert multi_tensor_boundaries(lower(place(spec, graph), spec, graph)) == [LLAMA_BOUNDARY]
    spec = load_spec(str(ROOT / "tests/models/nested_layerwise.yaml"))  # one hidden state per boundary
    graph = checked_graph(spec)
    assert multi_tensor_boundaries(lower(place(spec, graph), spec, graph)) == []


def test_the_program_nudges_its_reference_with_perturb(tmp_path):
    """--perturb 1e-7 moves the reference's losses a little; without it the reference is bit-identical."""
    program = tmp_path / "program.py"
    program.write_text(generate(load_spec(str(ROOT / "specs/mlp_data_allreduce.yaml")), out_dir=str(tmp_path)).text)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}

    def losses(name, *extra):
        subprocess.run([sys.executable, str(program), "--reference", "--simulate", "--out", str(tmp_path / name),
                        *extra], check=True, env=env, capture_output=True, timeout=300)
        return json.loads((tmp_path / name / "metrics.json").read_text())["losses"]

    def params(name):
        return torch.load(tmp_path / name / "final_params.pt")

    plain, again, nudged = losses("a"), losses("b", "--perturb", "0"), losses("c", "--perturb", "1e-7")
    assert plain == again and max(abs(a - b) for a, b in zip(plain, nudged)) < 1e-5
    for name, value in params("a").items():  # most elements moved, by about a rounding
        moved = params("c")[name] - value
        assert (moved != 0).float().mean() > 0.3 and moved.abs().max() < 1e-6, name
        assert torch.equal(params("b")[name], value)


@pytest.mark.parametrize("lr_moved", [1e-3, 1e-8])
def test_an_fsdp2_gradient_off_by_the_group_size_fails_at_any_learning_rate(tmp_path, lr_moved):
    """FSDP2 divides the reduced gradient by its group unless told otherwise: a gradient half the
    reference's moves the parameters by about lr a step, under atol at a small lr, and fails
    --check there too, on the gradient, which first_grads.pt holds gathered whole."""
    ref = outputs(tmp_path / "ref")
    run = outputs(tmp_path / "run", param_shift=lr_moved)
    torch.save({k: v / 2 if k == "fc.weight" else v for k, v in G.items()}, run / "first_grads.pt")
    report = compare(run, ref)
    assert not report.ok and report.first_bad_grad == "fc.weight" and len(report.grads) == len(report.params) == 2
    assert (report.first_bad_param is None) == (lr_moved < ATOL)
    torch.save({k: v * (1 + 1e-6) for k, v in G.items()}, run / "first_grads.pt")  # a sum in another order
    assert compare(run, ref).first_bad_grad is None


def test_a_gradient_the_run_did_not_record_is_said_not_passed_over(tmp_path):
    """A mode that records no first-step gradient for a parameter cannot be judged on it: the
    check says how many it compared of how many, which, and never claims "every" gradient."""
    from placer.cli.run_cmd import check_lines, passed_line

    ref = outputs(tmp_path / "ref")
    run = outputs(tmp_path / "run")
    torch.save({"fc.bias": G["fc.bias"]}, run / "first_grads.pt")
    report = compare(run, ref)
    assert report.ok and report.grads_unrecorded == ["fc.weight"]
    assert "  first-step gradients not recorded by the run: fc.weight" in check_lines(report)
    assert any(line.startswith("  first-step gradients: 1 of 2 compared") for line in check_lines(report))
    assert "every first-step gradient" not in passed_line(report) and "(of 2)" in passed_line(report)
    assert "every first-step gradient match" in passed_line(compare(outputs(tmp_path / "whole"), ref))
