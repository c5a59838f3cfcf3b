"""`model.inputs` (several named inputs, passed to forward by keyword) and `output: loss` (the
model's own loss): what the schema and the checks accept and refuse, and the program's batch."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from placer.cli.main import main
from placer.codegen.program import generate
from placer.spec.check import load_spec

TWO = '''
import torch
from torch import nn


class Two(nn.Module):
    """forward(a, b): b scales a before the first layer."""

    def __init__(self, d=8):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, a, b):
        return self.l3(self.l2(self.l1(a * b)))
'''
MODEL = '''placer: 1
name: two
model:
  module: two.py:Two
  inputs:
    a: {shape: [B, 8]}
    b: {shape: [B, 8]}
  target: {shape: [B, 8]}
  loss: MSELoss
'''
TRAIN = "training: {batch_size: 4, steps: 1, optimizer: {op: SGD, lr: 0.1}}\n"
LAYERWISE = "devices: [cpu:0, cpu:1]\nplacement:\n  - {layers: [l1], device: cpu:0}\n  - {layers: [l2, l3], device: cpu:1}\n"


def validate(tmp_path, text, *extra):
    (tmp_path / "two.py").write_text(TWO)
    (tmp_path / "spec.yaml").write_text(text)
    return CliRunner().invoke(main, ["validate", *extra, str(tmp_path / "spec.yaml")])


def test_several_inputs_validate_and_the_program_passes_them_by_keyword(tmp_path):
    r = validate(tmp_path, MODEL + LAYERWISE + TRAIN, "--deep")
    assert r.exit_code == 0, r.output
    text = "".join(generate(load_spec(str(tmp_path / "spec.yaml")), out_dir=str(tmp_path)).text.split())
    assert "Inputs({'a':make_tensor(gen,(BATCH_SIZE,8)),'b':make_tensor(gen,(BATCH_SIZE,8))})" in text.replace('"', "'")
    assert "out=model(**x.to(device))" in text


@pytest.mark.parametrize("change,code,words", [
    (("  inputs:\n", "  input: {shape: [B, 8]}\n  inputs:\n"), "S008", "'input' in model cannot be used"),
    (("b: {shape: [B, 8]}", "b: {shape: [8, B]}"), "P055", "model.inputs.b has shape [8, 'B']"),
    (("  loss: MSELoss\n", "  output: loss\n  loss: MSELoss\n"), "S008", "'loss' in model cannot be used"),
    (("  loss: MSELoss\n", ""), "S002", "missing required key 'loss'"),
])
def test_what_the_schema_and_the_checks_refuse(tmp_path, change, code, words):
    r = validate(tmp_path, (MODEL + LAYERWISE + TRAIN).replace(*change))
    assert r.exit_code == 1 and f"error[{code}]" in r.output and words in r.output, r.output


def test_own_loss_needs_a_loss_from_forward(tmp_path):
    """output: loss on a model whose forward returns no loss (HF without labels), or one that
    is not one number."""
    text = MODEL.replace("  target: {shape: [B, 8]}\n  loss: MSELoss\n", "  output: loss\n")
    r = validate(tmp_path, text + LAYERWISE + TRAIN, "--deep")
    assert r.exit_code == 1 and "error[M011]" in r.output and "`labels`" in r.output, r.output
    (tmp_path / "two.py").write_text(TWO.replace("return self.l3(", "return {'loss': self.l3(").replace(
        "(a * b)))", "(a * b)))}"))
    (tmp_path / "spec.yaml").write_text(text + LAYERWISE + TRAIN)
    r = CliRunner().invoke(main, ["validate", "--deep", str(tmp_path / "spec.yaml")])
    assert r.exit_code == 1 and "error[M012]" in r.output and "shape [4, 8]" in r.output, r.output


def test_several_inputs_where_torch_cuts_the_model_are_refused(tmp_path):
    """Groups of different sizes do not run in lockstep: torch's pipelining feeds one tensor."""
    cut = ("devices: [cpu:0, cpu:1, cpu:2]\nplacement:\n  - {layers: [l1], device: cpu:0}\n"
           "  - {layers: [l2, l3], devices: [cpu:1, cpu:2], parallel: data}\n")
    r = validate(tmp_path, MODEL + cut + TRAIN, "--deep")
    assert r.exit_code == 1 and "error[P095]" in r.output, r.output
