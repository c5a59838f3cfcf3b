"""Bad input that would reach the program is refused before any worker starts, and the
program's fault handling (atomic files, checkpoints, timeouts) is what `generate` writes."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from placer.codegen import program as program_module
from placer.codegen.program import generate
from placer.diagnostics import PlacerError
from placer.spec.check import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))

TINY = """placer: 1
name: tiny
model:
  layers:
    - {name: fc1, op: Linear, args: [4, 2]}
  input: {shape: [B, 4]}
  target: {shape: [B, 2]}
  loss: MSELoss
devices: [cpu]
placement:
  - {layers: fc1, device: cpu}
training:
  batch_size: 4
  steps: 2
  optimizer: OPTIMIZER
"""


def tiny(tmp_path, optimizer="{op: SGD, lr: 0.1}", extra=""):
    path = tmp_path / "spec.yaml"
    path.write_text(TINY.replace("OPTIMIZER", optimizer) + extra)
    return load_spec(str(path))


def first_error(call) -> str:
    with pytest.raises(PlacerError) as e:
        call()
    return e.value.diagnostics[0].format()


@pytest.mark.parametrize("kwargs, where, says", [
    ('{momentum: "fast"}', "15:52", "rejects momentum='fast': TypeError"),
    ("{momentom: 0.9}", "15:52", "rejects momentom=0.9: TypeError"),
    ("{nesterov: true}", "15:52", "rejects nesterov=True: ValueError: Nesterov momentum requires a momentum"),
])
def test_optimizer_kwargs_are_tried_on_a_dummy_parameter(tmp_path, kwargs, where, says):
    spec = tiny(tmp_path, "{op: SGD, lr: 0.1, kwargs: %s}" % kwargs)
    text = first_error(lambda: generate(spec))
    assert f"spec.yaml:{where}: error[G004]: torch.optim.SGD {says}" in text
    if "momentom" in kwargs:
        assert "hint: did you mean 'momentum'?" in text


def test_a_program_that_does_not_parse_is_an_error_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setattr(program_module, "data_source", lambda spec: "def batches(:\n")
    text = first_error(lambda: generate(tiny(tmp_path)))
    assert "error[G005]: the generated program does not parse: " in text and "def batches(:" in text


def _group_calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("new_group", "pipeline_group", "init_process_group"):
                yield name, node


def test_every_process_group_waits_at_most_timeout_s():
    """runtime.timeout_s bounds every group, not only the default one (torch's new_group
    default is 30 minutes, whatever init_process_group was given)."""
    seen = set()
    for path in SPECS:
        text = generate(load_spec(str(path))).text
        for name, call in _group_calls(ast.parse(text)):
            timeout = next((k.value for k in call.keywords if k.arg == "timeout"), None)
            assert timeout is not None, f"{path.stem}: {ast.unparse(call)}"
            if not (name == "new_group" and ast.unparse(timeout) == "timeout"):  # the pasted pipeline_group
                assert ast.unparse(timeout) == "timedelta(seconds=TIMEOUT_S)", f"{path.stem}: {ast.unparse(call)}"
            seen.add(name)
    assert seen == {"new_group", "pipeline_group", "init_process_group"}
