"""Pipelines as placer's own micro-batch loops (placer/codegen/loops.py), each rank in the order
torch's schedule runs it, for what torch's schedules cannot run:

- examples/uneven_1f1b: a 3-stage 1F1B pipeline whose middle stage is data parallel over 2 ranks
  (different data degrees), and the same with the middle stage's weights broadcast from its root
  and every copy via host memory;
- 4 stages alternating one device and a data-parallel pair, under interleaved 1F1B (round-robin)
  and ZBV zero bubble (a V: the pair holds the two middle stages; I runs the whole backward);
  interleaved with precision bf16 (autocast, checked under run --check's bf16 tolerance);
- Hugging Face GPT-2 (tied wte / lm_head on the two ends) over 3 ranks and Llama (rotary cos / sin
  cross) over 2, in lockstep: F runs the whole model on a micro-batch, B the rank's own backward.

Each `placer run --check` matches the one-device reference (losses, every parameter, first-step
gradients; rtol 1e-5, atol 4e-5), the program runs the plan's order and no other (not torch's
schedules, not GPipe's loops), and each device sends per step what its plan says."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "models"
EXAMPLE = ROOT / "examples" / "uneven_1f1b" / "spec.yaml"
GPT2_3 = """placement:
  - {name: front, layers: [transformer.wte..transformer.h.0], device: cpu}
  - {name: middle, layers: transformer.h.1, device: cpu:1}
  - {name: back, layers: [transformer.ln_f, lm_head], device: cpu:2}
devices: [cpu, cpu:1, cpu:2]
pipeline: {microbatches: 4, schedule: 1f1b}
training:"""
ONE, TWO = "device: cpu", "devices: [cpu:1, cpu:2], parallel: data"
FOUR = """devices: [cpu, cpu:1, cpu:2]
placement:
  - {{layers: inp..block.0, {}}}
  - {{layers: block.1, {}}}
  - {{layers: block.2, {}}}
  - {{layers: block.3..head, {}}}
pipeline: {{microbatches: 4, schedule: {}}}
training:"""
ONE_F_ONE_B = "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3"
RUNS = {  # name: (spec, text replaced in it, the order the first rank runs)
    "uneven": (EXAMPLE, {}, ONE_F_ONE_B),
    "uneven-broadcast-via-host": (EXAMPLE, {
        "parallel: data}": "parallel: {mode: data, sync: broadcast}}", "devices:": "copies: {route: via_host}\ndevices:"},
        ONE_F_ONE_B),
    # the data stage's other syncs and shards: ZeRO-1 and FSDP2 under Adam, a parameter server on the last stage's device
    "uneven-zero-adam": (EXAMPLE, {"parallel: data}": "parallel: {mode: data, shard: optimizer}}",
                                   "{op: SGD, lr: 0.05}": "{op: Adam, lr: 0.01}"}, ONE_F_ONE_B),
    "uneven-fsdp-adam": (EXAMPLE, {"parallel: data}": "parallel: {mode: data, shard: full}}",
                                   "{op: SGD, lr: 0.05}": "{op: Adam, lr: 0.01}"}, ONE_F_ONE_B),
    "uneven-server": (EXAMPLE, {"parallel: data}": "parallel: {mode: data, sync: parameter_server, server: 'cpu:3'}}"},
                      ONE_F_ONE_B),
    "interleaved-uneven": (EXAMPLE, {"placement:": FOUR.format(ONE, TWO, ONE, TWO, "interleaved_1f1b")},
                           "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"),
    "interleaved-uneven-bf16": (EXAMPLE, {"placement:": FOUR.format(ONE, TWO, ONE, TWO, "interleaved_1f1b"),
                                          "seed: 0": "seed: 0\n  precision: bf16"},
                                "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"),
    "zbv-uneven": (EXAMPLE, {"placement:": FOUR.format(ONE, TWO, TWO, ONE, "zbv_zero_bubble")},
                   "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3"),
    "gpt2-tied-3-ranks": (MODELS / "hf_gpt2_layerwise.yaml", {"placement:": GPT2_3,
                                                           "n_heads: 2}": "n_heads: 2, tied: true}"}, ONE_F_ONE_B),
    "llama": (MODELS / "hf_llama_layerwise.yaml", {"training:": "pipeline: {microbatches: 2, schedule: 1f1b}\n"
                                                                "training:"}, "0F0 0F1 0B0 0B1"),
}


def spec_for(name: str, tmp_path: Path) -> Path:
    base, edits, _ = RUNS[name]
    text = base.read_text().replace("hf_tiny.py", str(MODELS / "hf_tiny.py"))
    for old, new in edits.items():
        if old == "placement:":  # the whole placement block, devices and pipeline with it
            head, tail = text.split("\ndevices:", 1)
            text = head + "\n" + new + tail.split("\ntraining:", 1)[1]
        else:
            assert old in text, old
            text = text.replace(old, new, 1)
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", RUNS)
def test_own_1f1b_matches_one_device(name, tmp_path):
    spec, run_dir = spec_for(name, tmp_path), tmp_path / "run"
    bf16 = "precision: bf16" in spec.read_text()  # (run --check states and applies its looser tolerance)
    program, _, metrics, _ = h.checked_run(spec, run_dir, rtol=2e-2 if bf16 else 1e-5, atol=2e-3 if bf16 else 4e-5)
    assert "make_pipeline_schedule" not in program and "for action in order:" in program
    assert ("sum_tied_grads(" in program) == ("tied" in name)  # a "tied" run keeps a real tie
    assert "for mb in range" not in program  # not GPipe's loops
    order = re.search(r"order = \{\s*0: \"([^\"]*)\"", program)
    assert order and order.group(1) == RUNS[name][2], order
    if bf16:
        assert program.count("torch.autocast(") >= 5  # every stage's forward and the loss
    h.assert_sends_what_the_plan_says(name, spec, metrics)
