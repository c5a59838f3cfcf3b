"""Module models placed layer-wise run without torch.export (placer/codegen/runtime/lockstep.py):
Hugging Face GPT-2 and Llama (tiny configs, random init, no download) over two gloo ranks, copies
direct and via host, placer's GPipe loops, and Llama with its middle segment on a second rank and
both ends on the first (rotary (cos, sin) crosses to the middle only; the last segment reads it on
its own rank).
Each `placer run --check` matches the one-device reference (losses, every parameter, first-step
gradients; rtol 1e-5, atol 4e-5), and each device sends, per step, what its plan says: every
crossing tensor counted once per receiving device."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.main import main

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

MODELS = Path(__file__).resolve().parents[1] / "models"
SANDWICH = """placement:
  - {name: front, layers: [model.embed_tokens, model.rotary_emb], device: cpu}
  - {name: middle, layers: model.layers.0, device: cpu:1}
  - {name: back, layers: [model.layers.1, model.norm, lm_head], device: cpu}
training:"""
RUNS = {  # name: (spec, text replaced in it, the copies the plan has per step: forward, gradient)
    "gpt2-direct": ("hf_gpt2_layerwise", {}, (1, 1)),
    # GPT-2 as it ships (lm_head IS wte) via host: the tie's gradient sum crosses beside the copies
    "gpt2-tied-via-host": ("hf_gpt2_layerwise", {"devices:": "copies: {route: via_host}\ndevices:",
                                                 "n_heads: 2}": "n_heads: 2, tied: true}"}, (1, 1)),
    "llama-direct": ("hf_llama_layerwise", {}, (3, 1)),  # hidden state, cos, sin; a gradient for the first
    "llama-via-host": ("hf_llama_layerwise", {"devices:": "copies: {route: via_host}\ndevices:"}, (3, 1)),
    "llama-sandwich": ("hf_llama_layerwise", {"placement:": SANDWICH, "training:": ""}, (4, 2)),
    # placer's GPipe loops in lockstep: the same crossings, each micro-batch's (cos, sin) whole
    "gpt2-gpipe": ("hf_gpt2_layerwise", {"training:": "pipeline: {microbatches: 2, schedule: gpipe}\ntraining:"},
                   (1, 1)),
    "llama-gpipe": ("hf_llama_layerwise", {"training:": "pipeline: {microbatches: 2, schedule: gpipe}\ntraining:"},
                    (3, 1)),
}


def spec_for(name: str, tmp_path: Path) -> Path:
    base, edits, _ = RUNS[name]
    text = (MODELS / f"{base}.yaml").read_text().replace("hf_tiny.py", str(MODELS / "hf_tiny.py"))
    if "placement:" in edits:  # the whole placement block
        head, tail = text.split("placement:")
        text = head + edits["placement:"] + tail.split("training:")[1]
    else:
        for old, new in edits.items():
            text = text.replace(old, new, 1)
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", RUNS)
def test_layerwise_module_model_matches_one_device(name, tmp_path):
    spec, run_dir = spec_for(name, tmp_path), tmp_path / "run"
    planned = CliRunner().invoke(main, ["plan", str(spec), "--format", "json", "--deep"])
    assert planned.exit_code == 0, planned.output
    copies = [op for op in json.loads(planned.stdout)["communication"]["ops"] if op["kind"] in ("copy", "send")]
    fwd = {(o["attrs"]["of"], o["attrs"]["leaf"], o["dst"][0]) for o in copies if o["phase"] == "fwd"}
    bwd = {(o["attrs"]["of"], o["attrs"]["leaf"], o["src"][0]) for o in copies if o["phase"] == "bwd"}
    assert (len(fwd), len(bwd)) == RUNS[name][2], (fwd, bwd)
    program, run_p, metrics, _ = h.checked_run(spec, run_dir)
    assert "import SplitPoint, pipeline" not in program and "crossing.backward(loss, " in program
    assert ("sum_tied_grads(" in program) == ("tied" in name)
    h.assert_sends_what_the_plan_says(name, spec, metrics)
