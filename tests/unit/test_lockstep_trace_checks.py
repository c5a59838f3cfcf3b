"""What lockstep takes of a module model's forward, checked by `validate --deep` on a second trace
before any worker starts. P088: its stand-ins and the plan's micro-batch copies cut dim 0 of a
layer's output where it equals the batch size, and no other dim; traced again on the rows one
forward sees, a leaf that rule would get wrong is refused. P089: a rank holding several stages
runs each stage's work in the schedule's action for it, so layers must be called in segment order."""
from __future__ import annotations

from placer.model import build
from placer.spec import check

MODEL = '''import torch
from torch import nn


class SeqFirst(nn.Module):
    """An encoder whose hidden state is [seq, batch, d] between its layers (batch_first=False)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):  # x: [batch, seq, 4]
        h = self.inp(x.transpose(0, 1))
        return self.out(self.mid(h)).transpose(0, 1).mean(1)
'''

SPEC = """placer: 1
name: rows
model:
  module: seqfirst.py:SeqFirst
  input: {shape: [B, SEQ, 4]}
  target: {shape: [B, 3]}
  loss: MSELoss
devices: [cpu, cpu:1]
placement:
  - {layers: [inp, mid], device: cpu}
  - {layers: out, device: cpu:1}
pipeline: {microbatches: 2, schedule: gpipe}
training: {batch_size: 4, steps: 1, optimizer: {op: SGD, lr: 0.1}}
"""


def deep(tmp_path, seq: int, pipeline: bool = True):
    (tmp_path / "seqfirst.py").write_text(MODEL)
    text = SPEC.replace("SEQ", str(seq))
    path = tmp_path / "spec.yaml"
    path.write_text(text if pipeline else text.replace("pipeline: {microbatches: 2, schedule: gpipe}\n", ""))
    spec, _ = check.load_checked(str(path))
    return [d for d in build.deep_check(spec) if d.severity == "error"]


def test_a_leaf_whose_batch_is_not_dim_0_is_refused_where_micro_batches_cut_it(tmp_path):
    (d,) = deep(tmp_path, seq=6)  # [6, 4, 8]: the batch in dim 1
    assert d.code == "P088" and "output 0 of layer 'inp'" in d.message and "[6, 4, 8] on the batch of 4 and [6, 2, 8]" in d.message
    assert deep(tmp_path, seq=6, pipeline=False) == []  # one forward on the whole batch: nothing is cut


def test_a_dim_0_that_only_equals_the_batch_size_is_refused(tmp_path):
    (d,) = deep(tmp_path, seq=4)  # [4, 4, 8]: dim 0 is the sequence, as long as the batch
    assert d.code == "P088" and "not [2, 4, 8]" in d.message, d.message


REUSED = '''import torch
from torch import nn


class Reused(nn.Module):
    """Four Linears, the first called again after the second (a shared module)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        return self.d(self.c(self.a(self.b(self.a(x)))))
'''

INTERLEAVED = """placer: 1
name: reused
model:
  module: reused.py:Reused
  input: {shape: [B, 4]}
  target: {shape: [B, 4]}
  loss: MSELoss
devices: [cpu, cpu:1]
placement:
  - {layers: a, device: cpu}
  - {layers: b, device: cpu:1}
  - {layers: c, device: cpu}
  - {layers: d, device: cpu:1}
pipeline: {microbatches: 2, schedule: interleaved_1f1b}
training: {batch_size: 4, steps: 1, optimizer: {op: SGD, lr: 0.1}}
"""


def test_a_layer_called_again_after_a_later_stage_is_refused_where_a_rank_holds_several(tmp_path):
    """The stage gate of a rank holding several stages takes the layers to be called in segment
    order (P089); with one stage a rank (1F1B: each F is the whole forward) P089 does not apply."""
    (tmp_path / "reused.py").write_text(REUSED)
    path = tmp_path / "spec.yaml"
    path.write_text(INTERLEAVED)
    (d,) = [d for d in build.deep_check(check.load_checked(str(path))[0]) if d.severity == "error"]
    assert d.code == "P089" and "layer 'a' of segment 's0' is called again after the layers of segment 's1'" in d.message
    one = INTERLEAVED.replace("schedule: interleaved_1f1b", "schedule: 1f1b").replace(
        "  - {layers: c, device: cpu}\n  - {layers: d, device: cpu:1}\n", "").replace("layers: b,", "layers: b..d,")
    path.write_text(one)
    assert [d for d in build.deep_check(check.load_checked(str(path))[0]) if d.severity == "error"] == []
