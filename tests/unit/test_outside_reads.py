"""P098: in lockstep a placed layer's parameters live on its segment's devices only (meta
elsewhere) and train there, while every rank runs the parent's forward. `validate --deep`
refuses a forward whose glue (or another layer) reads such a value outside the layer's call,
before any worker starts; a read of its dtype or shape, or through the layer's call, is fine."""
from __future__ import annotations

import pytest

from placer.model import build
from placer.spec import check

MODEL = '''import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        h = self.mid(self.embed(x)).to(self.embed.weight.dtype)  # a dtype read: fine
        return GLUE
'''

SPEC = """placer: 1
name: reads
model:
  module: net.py:Net
  input: {shape: [B, 8]}
  target: {shape: [B, 8]}
  loss: MSELoss
devices: [cpu, cpu:1]
placement:
  - {name: front, layers: [embed], device: cpu}
  - {name: back, layers: [mid, out], device: cpu:1}
training: {batch_size: 4, steps: 1, optimizer: {op: SGD, lr: 0.1}}
"""


def deep(tmp_path, glue: str, spec: str = SPEC):
    (tmp_path / "net.py").write_text(MODEL.replace("GLUE", glue))
    path = tmp_path / "spec.yaml"
    path.write_text(spec)
    loaded, _ = check.load_checked(str(path))
    return [d for d in build.deep_check(loaded) if d.severity == "error"]


@pytest.mark.parametrize("glue", ["h @ self.embed.weight", "self.out(h) + self.embed.bias[:8]"])
def test_glue_reading_a_layer_placed_elsewhere_is_refused(tmp_path, glue):
    (d,) = deep(tmp_path, glue)
    assert d.code == "P098" and "of layer 'embed' (segment 'front')" in d.message, d.message
    assert "the model's own forward (its glue)" in d.message


def test_reads_through_the_layer_or_on_one_segment_pass(tmp_path):
    assert deep(tmp_path, "self.out(h)") == []
    one = SPEC.replace("""  - {name: front, layers: [embed], device: cpu}
  - {name: back, layers: [mid, out], device: cpu:1}""", "  - {layers: [embed, mid, out], devices: [cpu, cpu:1], parallel: data}")
    assert "parallel: data" in one and deep(tmp_path, "h @ self.embed.weight", one) == []  # each rank holds all
