"""Suggested placements run and match the one-device reference: `placer suggest -o OUT` on the cases
of tests/cases/suggest (an inline MLP under a memory cap, the same at a batch where tensor
parallelism wins, TinyGPT from its model file, a tiny Hugging Face Llama), then `placer run --check
OUT` on two gloo ranks; and `placer run --check` of a `placement: auto` spec itself, which runs the
placement the search chose and keeps it in RUN_DIR/spec.yaml."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from placer.cli.main import main

pytestmark = pytest.mark.distributed

CASES = Path(__file__).resolve().parents[1] / "cases" / "suggest"

RUNS = {  # case: (spec, --set overrides, a mode the suggestion must use)
    "mlp_capped": ("mlp_capped.yaml", [], "none"),
    "mlp_tensor": ("mlp_capped.yaml", ["training.batch_size=512"], "tensor"),
    "tinygpt": ("tinygpt_auto.yaml", [], "none"),
    "hf_llama": ("hf_llama_auto.yaml", [], "none"),
}


def invoke(*args):
    return CliRunner().invoke(main, [*map(str, args)])


@pytest.mark.parametrize("case", RUNS)
def test_the_suggested_spec_passes_run_check(case, tmp_path):
    spec, overrides, mode = RUNS[case]
    if case.startswith("hf_"):
        pytest.importorskip("transformers")
    out = tmp_path / "placed.yaml"
    sets = [a for o in overrides for a in ("--set", o)]
    r = invoke("suggest", CASES / spec, "-o", out, *sets)
    assert r.exit_code == 0, r.output
    placed = yaml.safe_load(out.read_text())["placement"]
    assert len({d for s in placed for d in s.get("devices", [s.get("device")])}) == 2, placed  # both ranks work
    modes = {p if isinstance(p, str) else p["mode"] for p in (s.get("parallel", "none") for s in placed)}
    assert mode in modes, placed
    r = invoke("run", out, "--check", "--run-dir", tmp_path / "run")
    assert r.exit_code == 0, r.output
    assert "check passed" in r.output


def test_run_of_an_auto_spec_runs_the_placement_it_chose(tmp_path):
    r = invoke("run", CASES / "mlp_capped.yaml", "--check", "--run-dir", tmp_path / "run")
    assert r.exit_code == 0, r.output
    assert "placement auto: chose 2 devices, 2 stages" in r.output and "check passed" in r.output
    kept = yaml.safe_load((tmp_path / "run" / "spec.yaml").read_text())
    assert kept["placement"] != "auto" and len(kept["placement"]) == 2
