"""Pipeline x data for module models in lockstep (placer/plan/crossings.py, codegen/runtime/lockstep.py):
each segment data parallel over 2 of 4 CPU workers, so two replica pipelines (the first rank of
every segment, and the second) each run the whole model's forward on half the batch, send what
crosses to their own peers only, and after the lockstep backward each segment's group all-reduces
its gradients.

- Hugging Face GPT-2 with wte and lm_head tied across the two stages, under GPipe and 1F1B: the
  tie's all-reduce spans every copy (both replicas of both stages), the groups' leave it out;
- Hugging Face Llama under 1F1B: rotary cos / sin cross with the hidden state, and are not cut
  by the replicas (their dim 0 is not the batch).

Each `placer run --check` matches the one-device reference (losses, every parameter, first-step
gradients; rtol 1e-5, atol 4e-5), no crossing goes from one pipeline to the other, and each
device sends per step what its plan says."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

pytestmark = pytest.mark.distributed

MODELS = Path(__file__).resolve().parents[1] / "models"
PLACEMENT = """devices: [cpu, cpu:1, cpu:2, cpu:3]
placement:
  - {{name: front, layers: [{}], devices: [cpu, cpu:1], parallel: data}}
  - {{name: back, layers: [{}], devices: [cpu:2, cpu:3], parallel: data}}
pipeline: {{microbatches: 2, schedule: {}}}
training:
  batch_size: 8"""
GPT2 = ("hf_gpt2_layerwise", "transformer.wte..transformer.h.0", "transformer.h.1, transformer.ln_f, lm_head")
LLAMA = ("hf_llama_layerwise", "model.embed_tokens, model.rotary_emb, model.layers.0",
         "model.layers.1, model.norm, lm_head")
RUNS = {  # name: (model spec, front layers, back layers, schedule, tied)
    "gpt2-tied-gpipe": (*GPT2, "gpipe", True),
    "gpt2-tied-1f1b": (*GPT2, "1f1b", True),
    "llama-1f1b": (*LLAMA, "1f1b", False),
}


def spec_for(name: str, tmp_path: Path) -> Path:
    base, front, back, schedule, tied = RUNS[name]
    text = (MODELS / f"{base}.yaml").read_text().replace("hf_tiny.py", str(MODELS / "hf_tiny.py"))
    head, tail = text.split("\ndevices:", 1)
    text = head + "\n" + PLACEMENT.format(front, back, schedule) + tail.split("\n  batch_size: 4", 1)[1]
    if tied:
        text = text.replace("n_heads: 2}", "n_heads: 2, tied: true}", 1)
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", RUNS)
def test_pipeline_of_data_segments_matches_one_device(name, tmp_path):
    spec, run_dir = spec_for(name, tmp_path), tmp_path / "run"
    program, run_p, metrics, _ = h.checked_run(spec, run_dir)
    assert "PIPELINES = [[0, 2], [1, 3]]" in program and "Lockstep(" in program
    assert "ddp_sum(" not in program  # the groups all-reduce after the lockstep backward
    crossings = ast.literal_eval(re.search(r"CROSSINGS = (\[.*?\])\n", program, re.S).group(1))
    assert crossings and {(src, dst) for _, _, src, dst, _, _ in crossings} == {(0, 2), (1, 3)}
    if name.startswith("llama"):  # the hidden state and rotary cos, sin cross in each pipeline
        assert len(crossings) == 6
    if RUNS[name][4]:
        torch.testing.assert_close(run_p["lm_head.weight"], run_p["transformer.wte.weight"], rtol=0, atol=0)
    h.assert_sends_what_the_plan_says(name, spec, metrics)
