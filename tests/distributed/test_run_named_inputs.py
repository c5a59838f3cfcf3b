"""Models as users train them: several named inputs (`model.inputs`, passed to forward by keyword
and cut row for row with the batch) and the model's own loss (`output: loss`, from `labels`).
T5 and BART as they ship, placed as encoder and decoder segments, as a 1F1B pipeline and with
each stage data parallel; BERT with a padded `attention_mask` data parallel and tensor parallel.
Each passes `run --check` against the one-device run and sends what its plan says."""
from __future__ import annotations

from pathlib import Path

import pytest

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

MODELS = Path(__file__).resolve().parents[1] / "models"
PIPELINE = "pipeline={microbatches: 2, schedule: 1f1b}"
STAGES_DATA = ("devices=[cpu:0, cpu:1, cpu:2, cpu:3]",  # each stage data parallel over two devices
               "placement=[{name: encoder, layers: [encoder.*], devices: [cpu:0, cpu:1], parallel: data}, "
               "{name: decoder, layers: [decoder.*, lm_head, shared], devices: [cpu:2, cpu:3], parallel: data}]",
               PIPELINE)
BERT_TENSOR = ("devices=[cpu:0, cpu:1, cpu:2]",
               "placement=[{name: embed, layers: [bert.embeddings], device: cpu:0}, {name: encoder, layers: "
               "[bert.encoder.layer.*], devices: [cpu:1, cpu:2], parallel: tensor}, {name: head, layers: [cls], "
               "device: cpu:0}]")
RUNS = {
    "t5-layerwise": ("hf_t5_loss", ()),
    "t5-1f1b": ("hf_t5_loss", (PIPELINE,)),
    "t5-pipeline-data": ("hf_t5_loss", STAGES_DATA),
    "bart-layerwise": ("hf_bart_loss", ()),
    "bart-1f1b": ("hf_bart_loss", (PIPELINE,)),
    "bert-mask-data": ("hf_bert_mask", ()),
    "bert-mask-tensor": ("hf_bert_mask", BERT_TENSOR),
}


@pytest.mark.parametrize("case", RUNS)
def test_named_inputs_and_the_models_own_loss_match_one_device(case, tmp_path):
    name, sets = RUNS[case]
    spec = MODELS / f"{name}.yaml"
    checked = h.checked_run(spec, tmp_path / "run", *(a for s in sets for a in ("--set", s)))
    assert "model(**" in checked.program or "seg0(**" in checked.program  # by keyword
    h.assert_sends_what_the_plan_says(case, spec, checked.metrics, sets)
