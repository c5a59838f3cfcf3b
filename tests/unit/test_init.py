"""`placer init` writes specs that validate and plan as written; `placer schema` prints the schema."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.main import main
from placer.spec import schema, starter

ROOT = Path(__file__).resolve().parents[2]
NET = ROOT / "tests" / "cases" / "valid" / "module_model" / "models" / "net.py"


def cli(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_starter_validates_and_plans(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = cli("init")
    assert r.exit_code == 0 and "wrote spec.yaml" in r.stdout, r.output
    text = (tmp_path / "spec.yaml").read_text()
    assert text.startswith("# yaml-language-server: $schema=") and "\nname: starter " in text
    # the schema named from the spec's folder, not an absolute path into this install
    where = text.splitlines()[0].split("$schema=")[1]
    assert not Path(where).is_absolute() and (tmp_path / where).resolve() == Path(schema.schema_path()).resolve()
    assert cli("validate", "--strict", "spec.yaml").exit_code == 0
    r = cli("plan", "-q", "spec.yaml")
    assert r.exit_code == 0 and r.stdout.startswith("plan starter:"), r.output


def test_refuses_to_overwrite_without_force(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.yaml").write_text("mine\n")
    r = cli("init")
    assert r.exit_code == 1 and r.stderr == "error: spec.yaml exists; pass --force to overwrite it, or -o another file\n"
    assert (tmp_path / "spec.yaml").read_text() == "mine\n"
    assert cli("init", "--force", "--devices", "cpu").exit_code == 0
    assert "devices: [cpu]" in (tmp_path / "spec.yaml").read_text()


def test_init_model_class_validates_deep_and_plans(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(NET.parent, tmp_path / "models")
    r = cli("init", "--model", "models/net.py:Net", "--kwargs", "{width: 16}", "--devices", "cpu,cuda:0",
            "-o", "out/net.yaml")
    assert r.exit_code == 0, r.output
    text = (tmp_path / "out" / "net.yaml").read_text()
    assert "module: ../models/net.py:Net" in text and "kwargs: {width: 16}" in text
    assert "layers: body.0..body.1, device: cpu" in text and "layers: head, device: cuda:0" in text
    r = cli("validate", "--deep", "--strict", "out/net.yaml")
    assert r.exit_code == 0, r.output
    r = cli("plan", "--deep", "-q", "out/net.yaml")
    assert r.exit_code == 0 and "batch 32" in r.stdout, r.output


FACTORY = """import torch.nn as nn

def make(depth=3, width=8):
    layers = [nn.Linear(6, width)] + [nn.Linear(width, width) for _ in range(depth)]
    return nn.Sequential(*layers, nn.Linear(width, 3))
"""


def test_init_model_factory_balances_over_devices(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.py").write_text(FACTORY)
    r = cli("init", "--model", "tiny.py:make", "--devices", "cuda:0,cuda:1,cuda:2", "-o", "tiny.yaml")
    assert r.exit_code == 0, r.output
    text = (tmp_path / "tiny.yaml").read_text()
    assert "input: {shape: [B, 6]}" in text and "high: 3}" in text
    assert text.count("device: cuda:") == 3
    assert cli("validate", "--deep", "--strict", "tiny.yaml").exit_code == 0
    assert cli("plan", "--deep", "-q", "tiny.yaml").exit_code == 0


def test_init_model_errors_name_the_option(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.py").write_text(FACTORY)
    r = cli("init", "--model", "tiny.py:mak")
    assert r.exit_code == 1 and r.stderr.startswith("--model tiny.py:mak: error[M003]"), r.output
    assert not (tmp_path / "spec.yaml").exists()
    assert "RUNS YOUR MODEL CODE" in cli("init", "--help").stdout


@pytest.mark.parametrize("params, k, runs", [
    ([10, 0, 10, 0, 10, 0], 3, [(0, 2), (2, 4), (4, 6)]),
    ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),
    ([5, 5], 4, [(0, 1), (1, 2)]),
    ([0, 0, 0], 2, [(0, 2), (2, 3)]),
])
def test_balance_is_contiguous_and_keeps_activations_with_their_layer(params, k, runs):
    assert starter.balance(params, k) == runs


def test_schema_command():
    r = cli("schema")
    assert r.exit_code == 0 and json.loads(r.stdout) == schema.schema()
    r = cli("schema", "--path")
    assert Path(r.stdout.strip()).is_file() and r.stdout.strip() == schema.schema_path()


@pytest.mark.parametrize("factory,first,sizes", [
    ("make_llama", "model.layers.0", "shape: [B, 64]"),   # its 64 positions
    ("make_bert", "bert.encoder.layer.0", "shape: [B, 8]"),  # its config's max_position_embeddings: 8
    ("make_moe", "model.layers.0", "shape: [B, 64]"),
])
def test_init_model_on_hugging_face_models_validates_deep_and_splits_over_blocks(tmp_path, monkeypatch, factory,
                                                                                 first, sizes):
    """A ModelOutput takes `output: logits` (M008 before), the sequence fits the config's positions
    (M006 before), and the placement splits the blocks, not the top-level children (Llama 85% /
    15% before: `model` | `lm_head`)."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    tiny = ROOT / "tests" / "models" / "hf_tiny.py"
    r = cli("init", "--model", f"{tiny}:{factory}", "--devices", "cpu:0,cpu:1", "-o", "hf.yaml")
    assert r.exit_code == 0, r.output
    text = (tmp_path / "hf.yaml").read_text()
    assert "output: logits" in text and sizes in text and first in text
    r = cli("validate", "--deep", "hf.yaml")
    assert r.exit_code == 0, r.output
