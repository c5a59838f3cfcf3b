"""`placer plan`: the table, JSON keys, plan text, diagrams, and errors without tracebacks."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")

from placer.cli.main import main  # noqa: E402
from placer.plan.text import format_plan, parse_plan  # noqa: E402

SPECS = Path(__file__).resolve().parents[2] / "specs"


def run(*args):
    return CliRunner().invoke(main, ["plan", *map(str, args)])


def test_table_lists_devices_memory_communication_and_balance():
    r = run(SPECS / "mlp_group_transitions.yaml")
    assert r.exit_code == 0, r.output
    out = r.output
    assert out.startswith("plan mlp_group_transitions: 8,682 parameters, 3 segments on 3 devices, batch 16\n")
    for line in ("memory per device", "communication per step", "balance: busiest cuda:0 at 1.08x the mean"):
        assert line in out
    # the cpu row: fc1 + head = 2,442 params, 9.5 KiB of weights and as much of gradients
    assert any(l.split()[:4] == ["cpu", "2,442", "9.5", "KiB"] for l in out.splitlines())
    assert "all_reduce grads  middle      bwd    cuda:0,cuda:1" in out


def test_json_keys_are_stable():
    r = run("--format", "json", SPECS / "mlp_pipeline_1f1b.yaml")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert list(doc) == ["format", "name", "batch_size", "model_params", "optimizer", "pipeline", "segments",
                         "devices", "totals", "communication", "balance", "notes"]
    assert doc["format"] == "placer-plan/1"
    assert set(doc["devices"][0]) == {"device", "rank", "params", "param_bytes", "buffer_bytes", "grad_bytes",
                                      "optimizer_bytes", "activation_bytes", "step_bytes", "data_bytes", "comm_bytes", "act_grad_bytes",
                                      "boundary_bytes", "backward_bytes", "total_bytes", "flops", "sent_bytes",
                                      "payload_bytes", "recv_bytes"}
    assert doc["pipeline"]["schedule"] == "1f1b" and doc["pipeline"]["microbatches"] == 4
    assert 0 < doc["pipeline"]["bubble"] < 1
    sends = [o for o in doc["communication"]["ops"] if o["kind"] == "send"]
    assert len(sends) == 2 * 4 and {o["microbatch"] for o in sends} == {0, 1, 2, 3}
    assert doc["communication"]["total_bytes"] == sum(p["bytes"] for p in doc["communication"]["pairs"])
    assert doc["totals"]["total_bytes"] == sum(d["total_bytes"] for d in doc["devices"])


def test_plan_text_round_trips():
    r = run("--plan-text", SPECS / "mlp_tensor.yaml")
    assert r.exit_code == 0
    plan = parse_plan(r.stdout)
    assert plan.name == "mlp_tensor" and format_plan(plan) == r.stdout


def test_diagrams_and_schedule_chart(tmp_path):
    dot, chart = tmp_path / "out" / "placement.dot", tmp_path / "schedule.txt"
    r = run("--dot", dot, "--schedule", chart, SPECS / "mlp_pipeline_gpipe.yaml")
    assert r.exit_code == 0, r.output
    assert dot.read_text().startswith("digraph placement {")
    assert chart.read_text().startswith("gpipe")
    assert f"placer: wrote {dot}" in r.stderr


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz not installed")
def test_schedule_chart_is_drawn_in_the_format_its_suffix_names(tmp_path):
    """`--schedule x.png` once wrote ASCII text into x.png and exited 0."""
    png, pdf = tmp_path / "s.png", tmp_path / "s.pdf"
    r = run("-q", "--schedule", png, SPECS / "mlp_pipeline_1f1b.yaml")
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert run("-q", "--schedule", pdf, SPECS / "mlp_pipeline_1f1b.yaml").exit_code == 0
    assert pdf.read_bytes()[:5] == b"%PDF-"


def test_schedule_chart_refuses_a_suffix_it_cannot_draw(tmp_path):
    r = run("-q", "--schedule", tmp_path / "s.jpeg", SPECS / "mlp_pipeline_1f1b.yaml")
    assert r.exit_code == 1 and "error[R005]" in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "s.jpeg").exists()


@pytest.mark.parametrize("flag, name", [("--svg", "g.svg"), ("--png", "g.png"), ("--schedule", "s.png")])
def test_missing_graphviz_is_an_error_when_a_picture_was_asked_for(tmp_path, monkeypatch, flag, name):
    """Even under -q: exit 1 with R004 and how to install graphviz, not exit 0 without the picture."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    r = run("-q", flag, tmp_path / name, SPECS / "mlp_pipeline_1f1b.yaml")
    assert r.exit_code == 1 and "error[R004]" in r.stderr and "install graphviz" in r.stderr
    assert "Traceback" not in r.output and not (tmp_path / name).exists()


def test_schedule_without_pipeline_says_so(tmp_path):
    r = run("--schedule", tmp_path / "s.svg", SPECS / "mlp_single_device.yaml")
    assert r.exit_code == 0 and "no pipeline" in r.stderr and not (tmp_path / "s.svg").exists()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_invalid_spec_exits_1_with_diagnostics(tmp_path, fmt):
    bad = tmp_path / "bad.yaml"
    bad.write_text((SPECS / "mlp_layerwise_direct.yaml").read_text().replace("device: cuda:1", "device: cuda:7"))
    r = run("--format", fmt, bad)
    assert r.exit_code == 1
    assert "Traceback" not in r.output
    if fmt == "json":
        assert json.loads(r.stdout)["diagnostics"][0]["code"] == "P012"
    else:
        assert "error[P012]: segment 'back' is placed on unknown device 'cuda:7'" in r.stderr


def test_unwritable_output_is_an_error_not_a_traceback(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = run("--dot", blocker / "x.dot", SPECS / "mlp_single_device.yaml")
    assert r.exit_code == 1 and "error[R002]" in r.stderr and "Traceback" not in r.output


def test_module_models_need_deep():
    # SPEC.md: a model module's code runs only in `plan --deep`, generate and run
    r = run(SPECS / "tinygpt.yaml")
    assert r.exit_code == 1 and "error[P071]" in r.stderr and "pass --deep" in r.stderr
    r = run("--deep", SPECS / "tinygpt.yaml")
    assert r.exit_code == 0 and r.stdout.startswith("plan tinygpt: 236,928 parameters")
    assert "placer: building models/tinygpt.py:TinyGPT on the meta device" in r.stderr


def test_plan_prints_the_warnings_validate_prints(tmp_path):
    """One CLI policy: validate, plan, generate and run show a spec's warnings alike."""
    spec = tmp_path / "spec.yaml"
    spec.write_text((SPECS / "mlp_layerwise_direct.yaml").read_text().replace(
        "devices: [cuda:0, cuda:1]", "devices: [cuda:0, cuda:1, cuda:2]"))
    r = run(spec)
    assert r.exit_code == 0 and "warning[W001]" in r.stderr and "cuda:2" in r.stderr
