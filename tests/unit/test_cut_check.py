"""A cut that torch's pipelining cannot make is refused by validate --deep and generate (P099),
never first by the workers (issue 11 item 5): for a module model that does not run in lockstep,
the checks make the program's own cut (runtime/cut.py cut_pipe) on the meta model. Lockstep
specs never pay for it."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402

from placer.cli.main import main  # noqa: E402
from placer.codegen.program import generate  # noqa: E402
from placer.codegen.runtime import cut  # noqa: E402
from placer.diagnostics import PlacerError  # noqa: E402
from placer.model.build import deep_check  # noqa: E402
from placer.spec.check import load_spec  # noqa: E402

MODELS = Path(__file__).resolve().parents[1] / "models"

NET = '''
import torch
import torch.nn as nn


class Gate(nn.Module):
    """Drops a cache when fed another tensor than last time: a branch on the input's storage,
    which runs on the meta device but not under torch.export's fake tensors."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.key = None

    def forward(self, x):
        if x.data_ptr() != self.key:
            self.key = None
        return self.lin(x)


class Branch(nn.Module):
    """Data-dependent control flow."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) if x.sum() > 0 else x


class Scaled(nn.Module):
    """A plain tensor attribute, not a buffer: export lifts it out as a constant of the stage."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = torch.ones(8)

    def forward(self, x):
        return self.lin(x) * self.scale.to(x.device)


class Net(nn.Module):
    def __init__(self, middle="Gate"):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.gate = globals()[middle]()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.gate(self.body(x)))
'''

CUT = """\
  - {name: front, layers: [body, gate], device: cpu}
  - {name: back, layers: head, devices: [cpu:1, cpu:2], parallel: data}"""
LOCKSTEP = """\
  - {name: front, layers: [body, gate], device: cpu}
  - {name: back, layers: head, device: cpu:1}"""


def spec_file(tmp_path: Path, middle: str, placement: str = CUT) -> Path:
    (tmp_path / "net.py").write_text(textwrap.dedent(NET))
    path = tmp_path / "spec.yaml"
    path.write_text(f"""placer: 1
name: cut_check
model:
  module: net.py:Net
  kwargs: {{middle: {middle}}}
  input: {{shape: [B, 4]}}
  target: {{shape: [B], dtype: int64, high: 2}}
  loss: CrossEntropyLoss
devices: [cpu, cpu:1, cpu:2]
placement:
{placement}
training: {{batch_size: 4, steps: 2, optimizer: {{op: SGD, lr: 0.1}}}}
""")
    return path


def test_a_cut_torch_export_cannot_trace_is_refused_by_validate_deep_and_generate_naming_the_layer(tmp_path):
    path = spec_file(tmp_path, "Gate")
    result = CliRunner().invoke(main, ["validate", str(path), "--deep"])
    assert result.exit_code == 1, result.output
    assert "spec.yaml:11:5: error[P099]" in result.output  # the segment holding the layer
    assert "before 'head' (segment 'back')" in result.output
    assert "its trace (torch.export) fails in layer 'gate' of segment 'front'" in result.output
    assert "Cannot access data pointer of Tensor" in result.output and "Traceback" not in result.output
    assert "lockstep" in result.output  # the hint
    with pytest.raises(PlacerError) as e:
        generate(load_spec(str(path)), out_dir=str(tmp_path))
    assert [d.code for d in e.value.diagnostics] == ["P099"] and "layer 'gate'" in e.value.diagnostics[0].message


def test_a_stage_constant_the_seed_cannot_fill_is_refused(tmp_path):
    """What materialize_cut would refuse on every rank: a lifted constant neither empty nor a
    model tensor."""
    diags = [d for d in deep_check(load_spec(str(spec_file(tmp_path, "Scaled")))) if d.severity == "error"]
    assert [d.code for d in diags] == ["P099"]
    assert "segment 'front' holds tensor 'gate.scale'" in diags[0].message and "buffer" in diags[0].hint


def test_data_dependent_control_flow_is_refused_with_the_layer_named_before_the_cut(tmp_path):
    """The meta trace meets it first (M006, naming the layer), on the cut path as in lockstep."""
    path = spec_file(tmp_path, "Branch")
    result = CliRunner().invoke(main, ["validate", str(path), "--deep"])
    assert result.exit_code == 1 and "error[M006]" in result.output and "in layer 'gate'" in result.output
    with pytest.raises(PlacerError) as e:
        generate(load_spec(str(path)), out_dir=str(tmp_path))
    assert [d.code for d in e.value.diagnostics] == ["M006"]


def test_the_shipped_cut_llama_still_validates_and_its_program_cuts_with_the_shared_function(tmp_path):
    text = (MODELS / "hf_llama_cut.yaml").read_text().replace("hf_tiny.py", str(MODELS / "hf_tiny.py"))
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    assert not [d for d in deep_check(load_spec(str(path))) if d.severity == "error"]
    program = generate(load_spec(str(path)), out_dir=str(tmp_path)).text
    assert 'CUT_BEFORE = ["model.norm"]' in program and "def cut_pipe(model, example, starts):" in program
    assert "    return model, cut_pipe(model, example, CUT_BEFORE)" in program


def test_lockstep_specs_never_make_the_cut(tmp_path, monkeypatch):
    """One device per segment runs in lockstep (the model's own code, uncut): the same model
    passes, and the split is never attempted."""
    def refuse(*args):
        raise AssertionError("the cut was made for a lockstep spec")

    monkeypatch.setattr(cut, "cut_pipe", refuse)
    path = spec_file(tmp_path, "Gate", LOCKSTEP)
    assert not [d for d in deep_check(load_spec(str(path))) if d.severity == "error"]
    assert "cut_pipe" not in generate(load_spec(str(path)), out_dir=str(tmp_path)).text
