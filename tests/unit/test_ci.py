"""CI (`.ci/run`) runs exactly the README's test command, and that command lints and type-checks."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"run the tests[^\n]*\n\n```bash\n([^\n]+)\n```", readme)
    assert m, "README.md has no test command block"
    command = m.group(1)
    for step in ("ruff check placer tests", "mypy placer", "python -m pytest -q"):
        assert step in command, f"README's test command does not run {step!r}"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci, f".ci/run does not run the README's test command: {command}"


def test_test_files_have_unique_names():
    """`python -m pytest -q` collects tests/unit and tests/distributed together (no packages):
    two test files of one name stop the whole run at collection."""
    names = [p.name for p in Path(__file__).resolve().parents[1].rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)
