"""P088: lockstep's stand-ins and the plan's micro-batch copies cut dim 0 of a crossing leaf where
it equals the batch size, and no other dim. `validate --deep` traces the model again on the rows
one forward sees and refuses a leaf that rule would get wrong, before any worker starts."""
from __future__ import annotations

import torch  # noqa: F401  (the model file imports it)

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
