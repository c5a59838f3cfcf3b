"""The Python API: placer.load / plan / generate give what the CLI prints and writes."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import placer
from placer.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "mlp_data_allreduce.yaml"


def cli(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_import_placer_does_not_import_torch():
    code = "import sys, placer; assert placer.load and placer.plan and placer.generate; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False", out.stderr


def test_load_returns_the_spec_and_raises_spec_error():
    spec = placer.load(SPEC)
    assert spec.name == "mlp_data_allreduce" and placer.load(str(SPEC), ["training.steps=3"]).training.steps == 3
    with pytest.raises(placer.SpecError) as e:
        placer.load(ROOT / "tests" / "cases" / "invalid" / "hint_ddp" / "spec.yaml")
    assert e.value.diagnostics[0].code == "S004" and "parallel: data" in e.value.diagnostics[0].hint


def test_plan_table_and_json_are_what_the_cli_prints():
    report = placer.plan(str(SPEC))
    assert report is not None and placer.plan(placer.load(SPEC)).table() == report.table()
    assert report.table() + "\n" == cli("plan", "-q", str(SPEC)).stdout
    assert json.loads(report.to_json()) == json.loads(cli("plan", "-q", "--format", "json", str(SPEC)).stdout)
    assert repr(report).startswith("plan mlp_data_allreduce:")


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz not installed")
def test_plan_renders_in_jupyter():
    svg = placer.plan(SPEC)._repr_svg_()
    assert "<svg" in svg and "cuda:1" in svg


def test_without_dot_svg_is_an_error_and_jupyter_falls_back(monkeypatch, tmp_path):
    report = placer.plan(SPEC)
    monkeypatch.setenv("PATH", str(tmp_path))  # graphviz's `dot` is looked up on PATH
    with pytest.raises(placer.PlanError) as e:
        report.svg()
    assert e.value.diagnostics[0].code == "R004"
    assert report._repr_svg_() is None and report.dot().startswith("digraph")


def test_generate_is_the_program_the_cli_writes(tmp_path):
    (tmp_path / "api").mkdir()
    out = tmp_path / "api" / "prog.py"  # as deep as the CLI's: the program finds the spec relative to itself
    text = placer.generate(SPEC, output=str(out))
    assert out.read_text() == text
    (tmp_path / "cli").mkdir()
    assert cli("generate", str(SPEC), "-o", str(tmp_path / "cli" / "prog.py")).exit_code == 0
    assert (tmp_path / "cli" / "prog.py").read_text() == text


def test_example_script_runs():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "python_api.py")], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "plan data_parallel:" in out.stdout and "program:" in out.stdout


def test_the_plan_subpackage_does_not_hide_the_function():
    from placer.plan import ir  # noqa: F401  (imports the subpackage placer.plan)

    assert callable(placer.plan) and placer.plan.__module__ == "placer.api"
