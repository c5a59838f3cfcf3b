"""Training options on module models placed one device per segment, which run in lockstep
(codegen/runtime/lockstep.py: every rank runs the whole forward): `precision: bf16` (the forward
and the loss under autocast; a crossing leaves as its traced float32, as between inline
segments), `accumulate` (the lockstep step once per micro-step, gradients adding up in .grad),
`recompute` (each of the segment's layers under torch.utils.checkpoint on its rank), with the
global-norm clip and an LR schedule beside them; layer-wise, GPipe and 1F1B; Hugging Face GPT-2
(wte / lm_head tied across the two ends) and Llama (rotary cos / sin cross, once per micro-step).

Each `placer run --check` passes against the one-device reference with the same options. Without
a pipeline the run's parameters equal that reference's within float32's tolerance (rtol 1e-5,
atol 4e-5; a run without autocast is further off than that); a pipeline's micro-batches round in
bfloat16 otherwise than the whole batch, so there bf16's stated tolerance holds. Each device
sends per step what its plan says."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from placer.cli.main import main

try:
    from ._harness import assert_sends_what_the_plan_says
except ImportError:  # run as a top-level module
    from _harness import assert_sends_what_the_plan_says

pytestmark = pytest.mark.distributed

MODELS = Path(__file__).resolve().parents[2] / "tests" / "models"
ALL = """seed: 0
  precision: bf16
  accumulate: 2
  clip_grad_norm: 0.01
  lr_schedule: {op: LinearLR, kwargs: {start_factor: 0.25, total_iters: 4}}"""
RUNS = {  # name: (spec, {text: its replacement}, recomputed segments, micro-steps)
    "gpt2-tied-layerwise-every-option": (MODELS / "hf_gpt2_layerwise.yaml", {
        "seed: 0": ALL, "device: cpu}": "device: cpu, recompute: true}",
        "n_heads: 2}": "n_heads: 2, tied: true}"}, 1, 2),
    "llama-layerwise": (MODELS / "hf_llama_layerwise.yaml", {
        "seed: 0": "seed: 0\n  precision: bf16\n  accumulate: 2", "device: cpu:1}": "device: cpu:1, recompute: true}"},
        1, 2),
    "gpt2-gpipe": (MODELS / "hf_gpt2_layerwise.yaml", {
        "seed: 0": "seed: 0\n  precision: bf16", "device: cpu}": "device: cpu, recompute: true}",
        "device: cpu:1}": "device: cpu:1, recompute: true}",
        "training:": "pipeline: {microbatches: 2, schedule: gpipe}\ntraining:"}, 2, 1),
    "llama-interleaved": (MODELS / "hf_llama_layerwise.yaml", {  # stages on a rank: forwards in threads
        "seed: 0": "seed: 0\n  precision: bf16", "device: cpu}": "device: cpu, recompute: true}",
        "placement:\n  - {name: front, layers: [model.embed_tokens, model.rotary_emb, model.layers.0], device: cpu, "
        "recompute: true}\n  - {name: back, layers: [model.layers.1, model.norm, lm_head], device: cpu:1}":
        "placement:\n  - {name: embed, layers: [model.embed_tokens, model.rotary_emb], device: cpu}\n"
        "  - {name: first, layers: model.layers.0, device: cpu:1}\n"
        "  - {name: back, layers: model.layers.1, device: cpu, recompute: true}\n"
        "  - {name: head, layers: [model.norm, lm_head], device: cpu:1}",
        "training:": "pipeline: {microbatches: 4, schedule: interleaved_1f1b}\ntraining:"}, 1, 1),
    "llama-1f1b": (MODELS / "hf_llama_layerwise.yaml", {
        "seed: 0": "seed: 0\n  precision: bf16", "device: cpu}": "device: cpu, recompute: true}",
        "training:": "pipeline: {microbatches: 2, schedule: 1f1b}\ntraining:"}, 1, 1),
}


@pytest.mark.parametrize("name", RUNS)
def test_lockstep_runs_the_training_options_as_one_device_does(name, tmp_path):
    pytest.importorskip("transformers")
    base, edits, recomputed, micro = RUNS[name]
    text = base.read_text().replace("hf_tiny.py", str(MODELS / "hf_tiny.py"))
    for old, new in edits.items():
        assert old in text, old
        text = text.replace(old, new, 1)
    spec, run_dir = tmp_path / "spec.yaml", tmp_path / "run"
    spec.write_text(text)
    result = CliRunner().invoke(main, ["run", str(spec), "--check", "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output + (run_dir / "run.log").read_text()
    assert "check passed" in result.stdout and "(rtol 0.02, atol 0.002)" in result.stdout  # bf16's stated tolerance
    program = (run_dir / "program.py").read_text()
    assert "crossing = Lockstep(" in program
    assert ("sum_tied_grads(" in program) == ("tied" in name)  # a "tied" run keeps a real tie
    assert program.count("with torch.autocast(device.type, dtype=torch.bfloat16):  # precision bf16") >= 2
    assert program.count("recompute_layers(") - 1 == recomputed  # (and its def)
    assert (f"for micro in range({micro}):" in program) == (micro > 1)
    run_p = torch.load(run_dir / "final_params.pt")
    ref_p = torch.load(run_dir / "reference" / "final_params.pt")
    assert set(run_p) == set(ref_p) and len(ref_p) >= 20
    losses = [json.loads((d / "metrics.json").read_text())["losses"] for d in (run_dir, run_dir / "reference")]
    assert abs(losses[0][0] - losses[1][0]) < 1e-6, losses  # the first forward is row by row: as in bf16 one device
    exact = "pipeline" not in text  # (a pipeline's micro-batches round in bfloat16 unlike the whole batch)
    for key, value in ref_p.items():
        torch.testing.assert_close(run_p[key], value, rtol=1e-5 if exact else 2e-2, atol=4e-5 if exact else 2e-3,
                                   msg=lambda m: f"{key}: {m}")
    if "clip_grad_norm" in text:  # the clip bites at every step, on the norm one device sees
        lines = [json.loads(line) for line in (run_dir / "progress.jsonl").read_text().splitlines()]
        ref = [json.loads(line) for line in (run_dir / "reference" / "progress.jsonl").read_text().splitlines()]
        got, want = ([r["grad_norm"] for r in rows if "grad_norm" in r] for rows in (lines, ref))
        assert len(got) == len(want) == 3 and all(n > 0.1 for n in want), want
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    assert_sends_what_the_plan_says(name, spec, json.loads((run_dir / "metrics.json").read_text()))
