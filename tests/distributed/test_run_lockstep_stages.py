"""Module models under schedules where a rank holds several stages, in lockstep
(codegen/runtime/lockstep.py `forward_stage` / `backward_stage`, codegen/loops.py): each
micro-batch's whole forward runs in a thread of its own that waits, before the work of the
rank's next stage, for the schedule's action of that stage; B (zero bubble: I) backpropagates
the stage's part and sends the gradients of what it received.

- Hugging Face GPT-2 under ZBV with the tied ends on one rank (wte in stage 0, lm_head in stage 3,
  both on cpu; the middle two stages on cpu:1): one copy per segment, summed on the rank, each
  stepped once;
- the same V over two data-parallel groups (4 ranks: two replica pipelines);
- Hugging Face Llama in 4 stages on 2 ranks under interleaved 1F1B: rotary cos / sin cross once
  to cpu:1 and serve both of its stages.

Each `placer run --check` matches the one-device reference (losses, every parameter, first-step
gradients; rtol 1e-5, atol 4e-5), the program runs the plan's order, and each device sends per
step what its plan says."""
from __future__ import annotations

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
ONE, DATA = "device: {}", "devices: [{}], parallel: data"
GPT2_V = """devices: [{}]
placement:
  - {{name: front, layers: [transformer.wte..transformer.h.0], {}}}
  - {{name: middle, layers: transformer.h.1, {}}}
  - {{name: norm, layers: transformer.ln_f, {}}}
  - {{name: head, layers: lm_head, {}}}
pipeline: {{microbatches: 4, schedule: zbv_zero_bubble}}
training:
  batch_size: 8"""
LLAMA_INTERLEAVED = """devices: [cpu, cpu:1]
placement:
  - {name: embed, layers: [model.embed_tokens, model.rotary_emb], device: cpu}
  - {name: first, layers: model.layers.0, device: cpu:1}
  - {name: back, layers: model.layers.1, device: cpu}
  - {name: head, layers: [model.norm, lm_head], device: cpu:1}
pipeline: {microbatches: 4, schedule: interleaved_1f1b}
training:
  batch_size: 4"""
V_ORDER = "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3"
RUNS = {  # name: (model spec, placement, the order rank 0 runs)
    "gpt2-tied-zbv": ("hf_gpt2_layerwise", GPT2_V.format(
        "cpu, cpu:1", ONE.format("cpu"), ONE.format("cpu:1"), ONE.format("cpu:1"), ONE.format("cpu")), V_ORDER),
    "gpt2-tied-zbv-data": ("hf_gpt2_layerwise", GPT2_V.format(
        "cpu, cpu:1, cpu:2, cpu:3", DATA.format("cpu, cpu:1"), DATA.format("cpu:2, cpu:3"),
        DATA.format("cpu:2, cpu:3"), DATA.format("cpu, cpu:1")), V_ORDER),
    "llama-interleaved": ("hf_llama_layerwise", LLAMA_INTERLEAVED,
                          "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"),
}


def spec_for(name: str, tmp_path: Path) -> Path:
    base, placement, _ = RUNS[name]
    text = (MODELS / f"{base}.yaml").read_text().replace("hf_tiny.py", str(MODELS / "hf_tiny.py"))
    head, tail = text.split("\ndevices:", 1)
    text = head + "\n" + placement + tail.split("\n  batch_size: 4", 1)[1]
    text = text.replace("n_heads: 2}", "n_heads: 2, tied: true}", 1)  # GPT-2 as it ships: lm_head is wte
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", RUNS)
def test_several_stages_on_a_rank_match_one_device(name, tmp_path):
    spec, run_dir = spec_for(name, tmp_path), tmp_path / "run"
    program, run_p, metrics, _ = h.checked_run(spec, run_dir)
    assert "crossing.forward_stage(stage, mb, model" in program and "cut_model" not in program
    order = re.search(r"order = \{\s*0: \"([^\"]*)\"", program)
    assert order and order.group(1) == RUNS[name][2], order
    if name.startswith("gpt2"):
        torch.testing.assert_close(run_p["lm_head.weight"], run_p["transformer.wte.weight"], rtol=0, atol=0)
    h.assert_sends_what_the_plan_says(name, spec, metrics)
