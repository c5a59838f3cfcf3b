"""P004 shows the model order around a segment's gap: T5's `shared` is registered first but never
called, so it is ordered last, and a segment `[t5.shared, t5.encoder.*]` is not contiguous; the
message says where each lies. And `t5.encoder.*` opens the layer `t5.encoder` (a glob's fixed part
opens the layer it names), which was P001 "matches no layer"."""
from __future__ import annotations

from pathlib import Path

import pytest

from placer.diagnostics import PlacerError
from placer.model.build import deep_check
from placer.spec.check import load_spec

pytest.importorskip("transformers")
MODELS = Path(__file__).resolve().parents[1] / "models"


def test_p004_names_the_layers_around_the_gap(tmp_path):
    text = (MODELS / "hf_t5.yaml").read_text().replace("hf_tiny.py", str(MODELS / "hf_tiny.py"))
    start, end = text.index("placement:"), text.index("training:")
    spec = tmp_path / "spec.yaml"
    spec.write_text(text[:start] + "placement:\n"
                    "  - {name: enc, layers: [t5.shared, t5.encoder.*], device: cpu:0}\n"
                    "  - {name: dec, layers: [t5.decoder.*, t5.lm_head], device: cpu:1}\n" + text[end:])
    try:
        diags = deep_check(load_spec(str(spec)))
    except PlacerError as e:
        diags = e.diagnostics
    codes = [d.code for d in diags]
    assert "P001" not in codes  # the globs open t5.encoder and t5.decoder
    (p004,) = [d for d in diags if d.code == "P004"]
    assert "'t5.encoder.final_layer_norm' comes before 't5.decoder." in p004.message
    assert p004.message.endswith("then 't5.shared'") and "never calls come last" in p004.hint
