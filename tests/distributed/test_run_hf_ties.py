"""A Hugging Face GPT-2 (tiny config, random init, never downloaded) whose `lm_head.weight` IS
`wte.weight`, placed with the embedding on one CPU worker and the tied head on another:
layer-wise, GPipe and 1F1B each pass `placer run --check`, which compares both copies and
the first step's gradients with the one-device run and the bytes with the plan. And the same
program with the tie sync taken out fails the check at lr 1e-5, where the parameters alone
cannot tell (Adam moves each by about lr a step, under atol)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from placer.cli.main import main
from placer.codegen.program import generate
from placer.launch.check import ATOL, compare
from placer.spec.check import load_spec

try:
    from ._harness import assert_sends_what_the_plan_says
except ImportError:  # run as a top-level module
    from _harness import assert_sends_what_the_plan_says

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "tests/cases/valid/hf_gpt2_tied/spec.yaml"
PLACEMENTS = {
    "layerwise": (),
    "gpipe": ("--set", "pipeline={microbatches: 2, schedule: gpipe}"),
    "1f1b": ("--set", "pipeline={microbatches: 2, schedule: 1f1b}"),
}


@pytest.mark.parametrize("how", PLACEMENTS)
def test_tied_gpt2_matches_one_device(how, tmp_path):
    run_dir = tmp_path / "run"
    extra = PLACEMENTS[how]
    result = CliRunner().invoke(main, ["run", str(SPEC), "--check", "--run-dir", str(run_dir), *extra])
    assert result.exit_code == 0, result.output + (run_dir / "run.log").read_text()
    check = json.loads((run_dir / "check.json").read_text())
    assert check["ok"] and check["tied"] == [["wte.weight", "lm_head.weight"]]
    # each copy compared: rank 0's under wte.weight, rank 1's under lm_head.weight; every gradient too
    assert {"wte.weight", "lm_head.weight"} <= {p["name"] for p in check["params"]}
    assert {g["name"] for g in check["grads"]} == {p["name"] for p in check["params"]}
    final = torch.load(run_dir / "final_params.pt")
    torch.testing.assert_close(final["wte.weight"], final["lm_head.weight"], rtol=0, atol=0)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    spec = tmp_path / "spec.yaml"  # the plan of what ran, overrides included
    spec.write_text(SPEC.read_text().replace("../../../../specs", str(ROOT / "specs")) + (
        f"pipeline: {extra[1].split('=', 1)[1]}\n" if extra else ""))
    assert_sends_what_the_plan_says(how, spec, metrics)


def python(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=400,
                         env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]


def test_without_the_tie_sync_the_check_fails_at_a_tiny_learning_rate(tmp_path):
    """What placer did before: each stage trains its own copy. At lr 1e-5 the losses and even
    both copies stay within tolerance of the reference; the first-step gradient does not."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.read_text().replace("../../../../specs", str(ROOT / "specs")).replace("lr: 0.001",
                                                                                               "lr: 0.00001"))
    text = generate(load_spec(str(spec)), out_dir=str(tmp_path)).text
    assert text.count("sum_tied_grads(list(") == 1
    program = tmp_path / "program.py"
    program.write_text(text.replace("sum_tied_grads(list(", "(lambda *untied: None)(list("))
    python(program, "--simulate", "--grads", "--out", tmp_path / "run", cwd=tmp_path)
    python(program, "--reference", "--simulate", "--grads", "--out", tmp_path / "ref", cwd=tmp_path)
    report = compare(tmp_path / "run", tmp_path / "ref")
    assert report.first_bad_step is None and report.first_bad_param is None  # what the old check saw
    final = torch.load(tmp_path / "run" / "final_params.pt")
    drift = float((final["wte.weight"] - final["lm_head.weight"]).abs().max())
    assert 0 < drift < ATOL  # the copies did train apart
    assert not report.ok and report.first_bad_grad in ("wte.weight", "lm_head.weight")
    bad = next(g for g in report.grads if g[0] == report.first_bad_grad)
    assert bad[2] > 0.01 * bad[3]  # off by a share of its own scale, not by float noise


T5_SPEC = ROOT / "tests/models/hf_t5.yaml"
T5_NAMES = ["t5.shared.weight", "t5.encoder.embed_tokens.weight", "t5.decoder.embed_tokens.weight",
            "t5.lm_head.weight"]
T5_PLACEMENTS = {
    "layerwise": (),
    "1f1b": ("--set", "pipeline={microbatches: 2, schedule: 1f1b}"),
    "pipeline-data": ("--set", "pipeline={microbatches: 2, schedule: 1f1b}"),  # each stage data parallel over 2
    "tensor": (),  # the whole model in one tensor segment over 2: the relative position bias split with its heads
}


def t5_spec(how, tmp_path) -> Path:
    if how not in ("pipeline-data", "tensor"):
        return T5_SPEC
    spec = tmp_path / "spec.yaml"
    if how == "tensor":
        text = T5_SPEC.read_text().replace("hf_tiny.py", str(T5_SPEC.parent / "hf_tiny.py"))
        start, end = text.index("placement:"), text.index("training:")
        spec.write_text(text[:start] + "placement:\n  - name: all\n    layers: [t5.encoder.*, t5.decoder.*, t5.lm_head, "
                        "t5.shared]\n    devices: [cpu:0, cpu:1]\n    parallel: tensor\n" + text[end:])
        return spec
    spec.write_text(T5_SPEC.read_text().replace("[cpu:0, cpu:1]", "[cpu:0, cpu:1, cpu:2, cpu:3]")
                    .replace("device: cpu:0", "devices: [cpu:0, cpu:1]\n    parallel: data")
                    .replace("device: cpu:1", "devices: [cpu:2, cpu:3]\n    parallel: data")
                    .replace("hf_tiny.py", str(T5_SPEC.parent / "hf_tiny.py")))
    return spec


@pytest.mark.parametrize("how", T5_PLACEMENTS)
def test_t5s_four_tied_names_train_as_one_parameter(how, tmp_path):
    """T5 ties shared, encoder.embed_tokens, decoder.embed_tokens and lm_head: the decoder's segment
    uses it under three names, which must be one copy there (before, lm_head kept the encoder's
    copy on the decoder's rank and its gradient was never summed: R021 by 2e-2)."""
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(main, ["run", str(t5_spec(how, tmp_path)), "--check", "--run-dir", str(run_dir),
                                       *T5_PLACEMENTS[how]])
    assert result.exit_code == 0, result.output + (run_dir / "run.log").read_text()
    check = json.loads((run_dir / "check.json").read_text())
    assert check["ok"] and check["tied"] == [T5_NAMES]
    assert set(T5_NAMES) <= {g["name"] for g in check["grads"]}
    final = torch.load(run_dir / "final_params.pt")
    for name in T5_NAMES[1:]:
        torch.testing.assert_close(final[name], final[T5_NAMES[0]], rtol=0, atol=0)
    if how == "tensor":  # one segment: nothing to sum, and the bias split with the heads (R020 before)
        assert "head_tables(holder, heads)" in (run_dir / "program.py").read_text()
    spec = t5_spec(how, tmp_path)
    assert_sends_what_the_plan_says(how, spec, json.loads((run_dir / "metrics.json").read_text()),
                                    sets=[a for a in T5_PLACEMENTS[how] if a != "--set"])
