"""Fixtures of the distributed tests."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

LAYERWISE = '  - {layers: fc1, device: cpu}\n  - {layers: head, device: "cpu:1"}'


@pytest.fixture
def two_cpu_spec(tmp_path: Path):
    """Writes a tiny two-CPU-worker spec (Linear 16 -> 8 [-> ReLU] -> 4, batch 8) whose data comes
    from `data_source` (a Python file defining `make_batches`) into tmp_path; returns its path.
    `placement` defaults to layer-wise; `training` adds lines to the training block."""

    def make(name: str, data_source: str, *, steps: int, timeout_s: int, data_kwargs=None, relu: bool = False,
             placement: str = LAYERWISE, training: str = "", optimizer: str = "{op: SGD, lr: 0.1}") -> Path:
        (tmp_path / f"{name}_data.py").write_text(data_source)
        act = "    - {name: act, op: ReLU}\n" if relu else ""
        kwargs = f", kwargs: {json.dumps(data_kwargs)}" if data_kwargs is not None else ""
        spec = tmp_path / "spec.yaml"
        spec.write_text(f"""placer: 1
name: {name}
model:
  layers:
    - {{name: fc1, op: Linear, args: [16, 8]}}
{act}    - {{name: head, op: Linear, args: [8, 4]}}
  input: {{shape: [B, 16]}}
  target: {{shape: [B], dtype: int64, high: 4}}
  loss: CrossEntropyLoss
devices: [cpu, "cpu:1"]
placement:
{placement}
training:
  batch_size: 8
  steps: {steps}
  optimizer: {optimizer}
{training}  data: {{module: {name}_data.py:make_batches{kwargs}}}
runtime: {{timeout_s: {timeout_s}}}
""")
        return spec

    return make
