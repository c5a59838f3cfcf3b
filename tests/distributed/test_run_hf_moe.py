"""Mixture-of-experts models as Hugging Face ships them (tiny configs, random init, no download):
Mixtral, Qwen2-MoE (a shared expert) and a DeepSeek-V3-style config (latent attention, a dense
first layer). Their experts run as a grouped matmul whose meta kernel takes bfloat16 only, so
`validate --deep` failed with M006 on a float32 model that trains on a CPU; placer traces it as
one matmul of its shape. Each runs layer-wise and as a 1F1B pipeline under `run --check`, and
sends what its plan says; Mixtral data parallel too."""
from __future__ import annotations

from pathlib import Path

import pytest

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

SPEC = Path(__file__).resolve().parents[1] / "models" / "hf_moe.yaml"
PLACEMENTS = {
    "layerwise": (),
    "1f1b": ("pipeline={microbatches: 2, schedule: 1f1b}",),
    "data": ("placement=[{name: all, layers: [model, lm_head], devices: [cpu:0, cpu:1], parallel: data}]",),
}
RUNS = [(f, how) for f in ("mixtral", "qwen2_moe", "deepseek_v3") for how in ("layerwise", "1f1b")] + [
    ("mixtral", "data")]


@pytest.mark.parametrize("family,how", RUNS, ids=[f"{f}-{h}" for f, h in RUNS])
def test_moe_models_match_one_device(family, how, tmp_path):
    sets = (f"model.kwargs.family={family}", *PLACEMENTS[how])
    _, _, metrics, out = h.checked_run(SPEC, tmp_path / "run", *(a for s in sets for a in ("--set", s)))
    h.assert_sends_what_the_plan_says(f"moe-{how}", SPEC, metrics, sets)
