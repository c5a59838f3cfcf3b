"""build_module / placeable_layers / build_graph on the meta device."""
from __future__ import annotations

import os
import textwrap

import pytest
import torch
from torch import nn

from placer.diagnostics import SpecError
from placer.model import build
from placer.spec import check

SPECS = os.path.join(os.path.dirname(__file__), "..", "..", "specs")

MLP = """
placer: 1
name: mlp
model:
  layers:
    - {name: fc1, op: Linear, args: [784, 512]}
    - {name: act1, op: ReLU}
    - {name: block, op: Linear, args: [512, 512], repeat: 2}
    - {name: head, op: Linear, args: [512, 10], kwargs: {bias: true}}
  input: {shape: [B, 784]}
  target: {shape: [B], dtype: int64, high: 10}
  loss: CrossEntropyLoss
devices: [cuda:0, cuda:1]
placement:
  - {layers: fc1..block.0, device: cuda:0}
  - {layers: [block.1, head], device: cuda:1}
training: {batch_size: 32, steps: 1, optimizer: {op: SGD, lr: 0.1}}
"""


def spec_from(text: str, tmp_path, files: dict | None = None):
    for name, src in (files or {}).items():
        (tmp_path / name).write_text(textwrap.dedent(src))
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(text))
    return check.load_spec(str(path))


def module_spec(tmp_path, model_src: str, ref: str, segments: list[str], inp="[B, 8]",
                target="{shape: [B, 4]}", loss="MSELoss", devices="[cuda:0, cuda:1]", batch=4):
    """A module spec over `model.py` (written to tmp_path); segments are flow-style YAML mappings."""
    lines = [
        "placer: 1", "name: m", "model:", f"  module: {ref}", f"  input: {{shape: {inp}}}",
        f"  target: {target}", f"  loss: {loss}", f"devices: {devices}", "placement:",
        *(f"  - {s}" for s in segments),
        f"training: {{batch_size: {batch}, steps: 1, optimizer: {{op: SGD, lr: 0.1}}}}",
    ]
    return spec_from("\n".join(lines) + "\n", tmp_path, {"model.py": model_src})


@pytest.fixture(scope="module")
def tinygpt():
    spec = check.load_spec(os.path.join(SPECS, "tinygpt.yaml"))
    return spec, build.build_graph(spec)


def test_inline_module_names_and_meta(tmp_path):
    spec = spec_from(MLP, tmp_path)
    m = build.build_module(spec)
    paths = [n for n, _ in m.named_modules()][1:]
    assert paths == ["fc1", "act1", "block", "block.0", "block.1", "head"]
    assert isinstance(m.block, nn.ModuleList)
    assert all(p.is_meta for p in m.parameters())
    assert build.placeable_layers(m) == [l.name for l in spec.model.layers]
    assert m(torch.zeros(3, 784, device="meta")).shape == (3, 10)


def test_inline_graph_by_hand(tmp_path):
    g = build.build_graph(spec_from(MLP, tmp_path))
    B = 32
    assert g.traced_with == "inline" and g.names == ["fc1", "act1", "block.0", "block.1", "head"]
    fc1, act1, b0, b1, head = g.layers
    assert fc1.params == 784 * 512 + 512 and fc1.param_bytes == 4 * fc1.params
    assert b0.params == b1.params == 512 * 512 + 512
    assert head.params == 512 * 10 + 10 and act1.params == 0 and act1.op == "ReLU"
    assert g.total_params == fc1.params + 2 * b0.params + head.params
    assert fc1.in_shape == (B, 784) and fc1.out_shape == (B, 512) and head.out_shape == (B, 10)
    assert fc1.out_bytes == B * 512 * 4 and fc1.in_bytes == B * 784 * 4 and head.out_bytes == B * 10 * 4
    assert fc1.flops == 2 * B * 784 * 512 and b0.flops == 2 * B * 512 * 512 and act1.flops == 0
    assert [l.inputs for l in g.layers] == [("input",), ("fc1",), ("act1",), ("block.0",), ("block.1",)]
    # fc1 saves its input; ReLU saves its output, which block.0 also saves: counted once, for ReLU
    assert fc1.saved_bytes == B * 784 * 4 and act1.saved_bytes == B * 512 * 4
    assert b0.saved_bytes == 0 and b0.saves_input and not act1.saves_input
    assert g.output_shape == (B, 10) and g.input_shape == (B, 784) and g.root_params == ()


def test_tinygpt_graph(tinygpt):
    spec, g = tinygpt
    assert g.traced_with == "fx"
    assert g.names == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "lm_head"]
    V, d, T, B = 256, 64, 64, 8
    assert g.layer("embed").params == V * d and g.layer("lm_head").params == d * V
    block = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    assert g.layer("blocks.0").params == block and g.layer("blocks.0").op == "Block"
    (pos,) = g.root_params
    assert (pos.name, pos.numel, pos.trainable, pos.consumer) == ("pos", T * d, True, "blocks.0")
    assert g.total_params == V * d + 4 * block + 2 * d + d * V + T * d
    assert g.layer("embed").in_shape == (B, T) and g.layer("embed").out_shape == (B, T, d)
    assert g.layer("lm_head").out_shape == g.output_shape == (B, T, V)
    # Linear FLOPs (2 * tokens * 12 d^2) plus causal attention's two matmuls (2 * 2 * B * T^2 * d)
    assert g.layer("blocks.1").flops == 2 * B * T * 12 * d * d + 4 * B * T * T * d
    assert g.layer("blocks.1").inputs == ("blocks.0",) and g.layer("embed").inputs == ("input",)
    assert g.layer("blocks.0").inputs == ("embed",)  # idx.size(1) for pos is a shape use, not data
    assert all(l.saved_bytes > 0 for l in g.layers)
    assert g.layer("blocks.1").saved_bytes == g.layer("blocks.2").saved_bytes


def test_segment_layers(tinygpt):
    spec, g = tinygpt
    assert build.segment_layers(spec, g) == [["embed", "blocks.0"], ["blocks.1", "blocks.2"],
                                             ["blocks.3", "ln_f", "lm_head"]]


def test_segment_layers_unresolved(tmp_path):
    spec = spec_from(MLP, tmp_path)
    g = build.build_graph(spec)
    g2 = type(g)(layers=g.layers[:-1], batch_size=g.batch_size, input_shape=g.input_shape,
                 input_dtype=g.input_dtype)
    with pytest.raises(SpecError) as e:
        build.segment_layers(spec, g2)
    assert e.value.diagnostics[0].code == "P001"


ORDERED = """
import torch
from torch import nn

class Odd(nn.Sequential):
    def forward(self, x):  # not a pure container: placed as one layer
        return super().forward(x) * 2

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 4)            # defined first, runs last
        self.unused = nn.Linear(3, 3)          # never runs: goes last
        self.parts = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Sequential(nn.ReLU(), nn.Linear(8, 8))})
        self.odd = Odd(nn.Linear(8, 8))
        self.tied = nn.Linear(8, 8)
        self.tied.weight = self.parts["a"].weight   # shared: counted once, for parts.a
        self.scale = nn.Parameter(torch.ones(8))
        self.register_buffer("shift", torch.zeros(8))

    def forward(self, x):
        x = self.parts["a"](x)
        x = self.parts["b"](x) * self.scale + self.shift
        x = self.tied(self.odd(x))
        return self.head(x)
"""


def test_execution_order_containers_and_sharing(tmp_path):
    spec = module_spec(tmp_path, ORDERED, "model.py:Net", [
        "{layers: [parts.a, parts.b.0], device: cuda:0}",
        "{layers: [parts.b.1, odd, tied, head, unused], device: cuda:1}"])
    m = build.build_module(spec)
    assert build.placeable_layers(m) == ["head", "unused", "parts.a", "parts.b.0", "parts.b.1", "odd", "tied"]
    g = build.build_graph(spec, m)
    assert g.names == ["parts.a", "parts.b.0", "parts.b.1", "odd", "tied", "head", "unused"]
    assert g.layer("parts.a").params == 8 * 8 + 8
    assert g.layer("tied").params == 8 and g.layer("tied").shared_params == 64
    assert g.layer("unused").in_shape is None and g.layer("unused").params == 3 * 3 + 3
    assert g.layer("odd").op == "Odd" and g.layer("parts.b.0").op == "ReLU"
    roots = {r.name: r for r in g.root_params}
    assert roots["scale"].trainable and not roots["shift"].trainable
    # used between parts.b.1 and odd: they go with the layer that consumes the result
    assert roots["scale"].consumer == roots["shift"].consumer == "odd"
    assert g.total_params == sum(p.numel() for p in m.parameters())
    assert check.resolve_segments(spec, g.names)[1] == []


def test_encoder_traces_with_hooks():
    spec = check.load_spec(os.path.join(SPECS, "transformer_encoder.yaml"))
    g = build.build_graph(spec)
    assert g.traced_with == "hooks"
    assert g.names == ["inp", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    enc = g.layer("layers.2")
    assert enc.op == "TransformerEncoderLayer" and enc.in_shape == enc.out_shape == (8, 16, 64)
    assert enc.flops > 0 and enc.saved_bytes > 0 and enc.inputs is None
    assert g.layer("head").in_shape == (8, 64) and g.output_shape == (8, 10)
    ref = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, device="meta")
    assert enc.params == sum(p.numel() for p in ref.parameters())


def test_gpt_1b_builds_on_meta():
    spec = check.load_spec(os.path.join(SPECS, "gpt_1b.yaml"))
    m = build.build_module(spec)
    assert all(p.is_meta for p in m.parameters())
    g = build.build_graph(spec, m)
    assert abs(g.total_params - 1e9) < 0.1e9
    assert len(g.names) == 19 and g.names[0] == "embed" and g.names[-1] == "lm_head"
    assert g.layer("lm_head").out_shape == (32, 1024, 50304)
    assert len(build.segment_layers(spec, g)) == 8


def test_loss_inputs(tmp_path, tinygpt):
    spec, _ = tinygpt
    out, tgt = build.loss_inputs(spec, torch.zeros(2, 5, 7), torch.zeros(2, 5, dtype=torch.long))
    assert out.shape == (10, 7) and tgt.shape == (10,)
    out, tgt = build.loss_inputs(spec, torch.zeros(2, 5, 7), torch.zeros(2, 5, 7))
    assert out.shape == tgt.shape == (10, 7)
    out, tgt = build.loss_inputs(spec, torch.zeros(6, 1), torch.zeros(6))  # regression: [B, 1] vs [B]
    assert out.shape == tgt.shape == (6,)
    inline = spec_from(MLP, tmp_path)
    out, tgt = build.loss_inputs(inline, torch.zeros(2, 5, 7), torch.zeros(2, 5, dtype=torch.long))
    assert out.shape == (2, 5, 7)


def test_build_on_cpu_runs_for_real(tmp_path):
    m = build.build_module(spec_from(MLP, tmp_path), device="cpu")
    assert not any(p.is_meta for p in m.parameters())
    assert m(torch.ones(2, 784)).shape == (2, 10)


def test_module_errors_are_located(tmp_path):
    spec = module_spec(tmp_path, "from torch import nn\nclass Net(nn.Module):\n    pass\n", "model.py:Nett",
                       ["{layers: x, device: cuda:0}"], devices="[cuda:0]")
    with pytest.raises(SpecError) as e:
        build.build_module(spec)
    d = e.value.diagnostics[0]
    assert d.code == "M003" and "did you mean 'Net'" in d.hint
    assert (d.loc.line, d.loc.col) == (spec.doc.loc(("model", "module")).line, spec.doc.loc(("model", "module")).col)
    spec = module_spec(tmp_path, "from torch import nn\nclass Net(nn.Module):\n    pass\n", "model.py:Net",
                       ["{layers: x, device: cuda:0}"], devices="[cuda:0]")
    with pytest.raises(SpecError) as e:
        build.build_graph(spec)
    assert e.value.diagnostics[0].code == "M009"
