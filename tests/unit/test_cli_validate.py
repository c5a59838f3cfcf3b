"""`placer validate` as a user meets it: exit codes, formats, several files, stdin,
and the promise that plain validate imports neither torch nor user code."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
GOOD = ROOT / "specs" / "mlp_single_device.yaml"
WARN = """\
placer: 1
name: warn
model:
  layers: [{name: fc, op: Linear, args: [4, 2]}]
  input: {shape: [B, 4]}
  target: {shape: [B], dtype: int64, high: 2}
  loss: CrossEntropyLoss
devices: [cpu, cuda:0]
placement: [{layers: fc, device: cpu}]
training: {batch_size: 2, steps: 1, optimizer: {op: SGD}}
"""
BAD = WARN.replace("steps: 1", "steps: 0")


def validate(*args, input=None):
    return CliRunner().invoke(main, ["validate", *map(str, args)], input=input)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "warn.yaml").write_text(WARN)
    (tmp_path / "bad.yaml").write_text(BAD)
    return tmp_path


def test_valid_spec_exits_0_and_says_ok():
    r = validate(GOOD)
    assert r.exit_code == 0
    assert r.stdout == f"{GOOD}: ok (7 layers, 1 segment, 1 device)\n" and r.stderr == ""


def test_quiet_prints_nothing_for_a_valid_spec():
    r = validate("-q", GOOD)
    assert (r.exit_code, r.output) == (0, "")


def test_invalid_spec_exits_1_with_a_located_error(files):
    r = validate(files / "bad.yaml")
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.startswith(f"{files / 'bad.yaml'}:10:34: error[S006]: training.steps: 0 is less than")
    assert "Traceback" not in r.output


@pytest.mark.parametrize("args", [[], ["--format", "xml", "x.yaml"], ["--nope", "x.yaml"]])
def test_usage_errors_exit_2(args):
    r = validate(*args)
    assert r.exit_code == 2 and "Usage:" in r.output


def test_a_directory_is_a_usage_error(tmp_path):
    assert validate(tmp_path).exit_code == 2


def test_missing_file_exits_1(tmp_path):
    r = validate(tmp_path / "nope.yaml")
    assert r.exit_code == 1 and "error[L000]: cannot read spec" in r.stderr


def test_several_files_report_each_and_fail_if_any_fails(files):
    r = validate(GOOD, files / "bad.yaml", files / "warn.yaml")
    assert r.exit_code == 1
    assert f"{GOOD}: ok" in r.stdout and f"{files / 'warn.yaml'}: ok (1 layer, 1 segment, 2 devices, 1 warning)" \
        in r.stdout
    assert "error[S006]" in r.stderr and "warning[W001]: device 'cuda:0' is listed but runs nothing" in r.stderr


def test_dash_reads_stdin():
    r = validate("-", input=GOOD.read_text())
    assert r.exit_code == 0 and r.stdout.startswith("-: ok (7 layers")
    r = validate("-", input=BAD)
    assert r.exit_code == 1 and r.stderr.startswith("<stdin>:10:34: error[S006]")


def test_strict_fails_on_warnings(files):
    assert validate(files / "warn.yaml").exit_code == 0
    r = validate("--strict", files / "warn.yaml")
    assert r.exit_code == 1 and "warning[W001]" in r.stderr and ": ok" not in r.stdout


def test_json_format_is_parseable_and_located(files):
    r = validate("--format", "json", GOOD, files / "bad.yaml", files / "warn.yaml")
    assert r.exit_code == 1
    out = json.loads(r.stdout)
    assert [(o["file"], o["valid"]) for o in out] == [
        (str(GOOD), True), (str(files / "bad.yaml"), False), (str(files / "warn.yaml"), True)]
    d = out[1]["diagnostics"][0]
    assert (d["file"], d["line"], d["col"], d["code"], d["severity"]) == (str(files / "bad.yaml"), 10, 34, "S006",
                                                                          "error")
    assert out[2]["diagnostics"][0]["code"] == "W001"


def test_json_format_for_unloadable_input():
    r = validate("--format", "json", "-", input="a: [1\n")
    out = json.loads(r.stdout)
    assert r.exit_code == 1 and out[0]["diagnostics"][0]["code"] == "L003"


def test_github_format_annotates(files):
    r = validate("--format", "github", files / "bad.yaml", files / "warn.yaml")
    lines = r.stdout.splitlines()
    assert r.exit_code == 1
    assert lines[0].startswith(f"::error file={files / 'bad.yaml'},line=10,col=34,title=placer S006::")
    assert lines[1].startswith(f"::warning file={files / 'warn.yaml'},line=8,col=16,title=placer W001::")


def test_many_errors_show_ten_then_a_count(tmp_path):
    segs = "".join(f"  - {{layers: fc{i}, device: cuda:{i + 10}}}\n" for i in range(13))
    layers = "".join(f"    - {{name: fc{i}, op: Linear, args: [4, 4]}}\n" for i in range(13))
    text = WARN.replace("  layers: [{name: fc, op: Linear, args: [4, 2]}]\n", "  layers:\n" + layers) \
        .replace("placement: [{layers: fc, device: cpu}]\n", "placement:\n" + segs) \
        .replace("target: {shape: [B], dtype: int64, high: 2}", "target: {shape: [B, 4]}") \
        .replace("CrossEntropyLoss", "MSELoss")
    (tmp_path / "many.yaml").write_text(text)
    r = validate(tmp_path / "many.yaml")
    lines = [l for l in r.stderr.splitlines() if not l.startswith("  hint:")]
    assert r.exit_code == 1
    assert len(lines) == 11 and all("error[P012]" in l for l in lines[:10])
    assert lines[-1] == "3 more errors, 2 more warnings"


def test_junk_bytes_never_print_a_traceback(tmp_path):
    (tmp_path / "junk.yaml").write_bytes(bytes(range(256)) * 4)
    r = validate(tmp_path / "junk.yaml")
    assert r.exit_code == 1 and "error[L002]" in r.stderr and "Traceback" not in r.output


# --- what plain validate does not import


PROBE = textwrap.dedent("""\
    import sys
    from placer.cli.main import main
    sys.argv = ["placer", "validate", "-q", *sys.argv[1:]]
    try:
        main()
    except SystemExit as e:
        code = e.code
    print(code, "torch" in sys.modules, any(m == "net" or m.startswith("placer_user") for m in sys.modules))
""")


def test_plain_validate_imports_neither_torch_nor_user_code(tmp_path):
    marker = tmp_path / "imported.txt"
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "net.py").write_text(
        f"open({str(marker)!r}, 'w').write('user code ran')\nimport torch.nn as nn\n\n"
        "class Net(nn.Module):\n    pass\n")
    (tmp_path / "spec.yaml").write_text(WARN.replace(
        "  layers: [{name: fc, op: Linear, args: [4, 2]}]\n", "  module: models/net.py:Net\n").replace(
        "devices: [cpu, cuda:0]", "devices: [cpu]"))
    specs = [str(p) for p in sorted((ROOT / "specs").glob("*.yaml"))]
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "spec.yaml"), *specs],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.stdout.split() == ["0", "False", "False"], out.stdout + out.stderr
    assert not marker.exists(), "plain validate ran the user's model file"


def test_pre_commit_hook_runs_placer_validate_on_spec_folders():
    import re

    import yaml

    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    hook = next(h for h in hooks if h["id"] == "placer-validate")
    assert hook["entry"] == "placer validate" and hook["language"] == "python"
    files = re.compile(hook["files"])
    assert files.search("specs/mlp.yaml") and files.search("team/specs/big/gpt.yml")
    assert not files.search(".github/workflows/ci.yaml") and not files.search("specs/models/net.py")
    r = CliRunner().invoke(main, hook["entry"].split()[1:] + hook.get("args", []) +
                           [str(p) for p in sorted((ROOT / "specs").glob("*.yaml"))])
    assert (r.exit_code, r.output) == (0, "")
