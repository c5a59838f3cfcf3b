"""Every example spec and every case under tests/cases, checked through `placer validate`.

Cases are picked up from the folders: `tests/cases/valid/<name>/spec.yaml` must
validate cleanly; `tests/cases/invalid/<name>/spec.yaml` must fail with the
first output line equal to `expected.txt`. Invalid cases run from their own
folder with the file name `spec.yaml`, so expected lines read
`spec.yaml:LINE:COL: error[CODE]: message`.

To accept new output after a deliberate message change: PLACER_ACCEPT=1 pytest tests/unit/test_specs.py
(then review the diff of the expected.txt files).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
VALID = sorted((ROOT / "tests" / "cases" / "valid").glob("*/spec.yaml"))
INVALID = sorted(p.parent for p in (ROOT / "tests" / "cases" / "invalid").glob("*/spec.yaml"))
ACCEPT = os.environ.get("PLACER_ACCEPT") == "1"
LINE = re.compile(r"^spec\.yaml:\d+:\d+: error\[[LSPM]\d{3}\]: \S.*$")


def _validate(*args: str):
    return CliRunner().invoke(main, ["validate", *args], catch_exceptions=False)


def test_cases_and_specs_are_found():
    assert len(SPECS) >= 25 and len(VALID) >= 5 and len(INVALID) >= 35


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_example_spec_validates_without_warnings(path):
    result = _validate("--strict", str(path))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{path}: ok (")
    assert path.read_text("utf-8").startswith(
        "# yaml-language-server: $schema=../schemas/placer-spec.schema.json\n"), "schema header missing"


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.parent.name)
def test_valid_case(path, monkeypatch):
    monkeypatch.chdir(path.parent)
    result = _validate("--strict", "spec.yaml")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("case", INVALID, ids=lambda p: p.name)
def test_invalid_case(case, monkeypatch):
    monkeypatch.chdir(case)
    result = _validate("spec.yaml")
    first = (result.stderr.splitlines() or [""])[0]
    expected_file = case / "expected.txt"
    if ACCEPT:
        expected_file.write_text(first + "\n", "utf-8")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert LINE.match(first), first
    assert first == expected_file.read_text("utf-8").strip()


def test_invalid_cases_cover_every_stage():
    """The cases exercise the loader (L), the schema (S) and the semantic checks (P)."""
    codes = {(c / "expected.txt").read_text("utf-8").split("error[")[1][:4] for c in INVALID}
    assert {c[0] for c in codes} >= {"L", "S", "P"}
    assert len(codes) >= 40, sorted(codes)


def test_every_error_code_in_the_source_is_documented():
    """docs/errors.md lists every code placer can report, and only those."""
    used = {}
    for path in sorted((ROOT / "placer").rglob("*.py")):
        for code in re.findall(r"""["']([A-Z]\d{3})["']""", path.read_text("utf-8")):
            used.setdefault(code, path.relative_to(ROOT))
    rows = re.findall(r"^\| ([A-Z]\d{3}) \|", (ROOT / "docs" / "errors.md").read_text("utf-8"), re.M)
    assert len(rows) == len(set(rows)), f"codes documented twice (one code, two meanings?): " \
        f"{sorted(c for c in set(rows) if rows.count(c) > 1)}"
    documented = set(rows)
    missing = {c: str(p) for c, p in used.items() if c not in documented}
    assert not missing, f"codes missing from docs/errors.md: {missing}"
    assert not documented - set(used), f"docs/errors.md lists codes no source uses: {documented - set(used)}"
