"""How the command line talks: -q / -v on every command, colour only where it belongs (a
terminal, no NO_COLOR), and `placer run`'s progress (rich's bar on a terminal, plain lines
elsewhere)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.console import RunConsole
from placer.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
GOOD = ROOT / "specs" / "mlp_single_device.yaml"
BAD = ROOT / "tests" / "cases" / "invalid" / "bad_device_name" / "spec.yaml"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def cli(*args, color=False, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], color=color, env=env)


@pytest.mark.parametrize("name", sorted(main.commands))
def test_every_command_takes_quiet_and_verbose(name):
    text = cli(name, "--help").output
    assert "-q, --quiet" in text and "-v, --verbose" in text


def test_quiet_and_verbose_together_are_a_usage_error():
    r = cli("validate", "-q", "-v", GOOD)
    assert r.exit_code == 2 and "-q and -v contradict each other" in r.stderr


def test_errors_are_coloured_on_a_terminal_and_plain_under_no_color():
    coloured = cli("validate", BAD, color=True, env={"NO_COLOR": ""})
    assert coloured.exit_code == 1 and ANSI.search(coloured.stderr)
    assert "error[" in ANSI.sub("", coloured.stderr)
    plain = cli("validate", BAD, color=True, env={"NO_COLOR": "1"})
    assert plain.exit_code == 1 and not ANSI.search(plain.stderr) and "error[" in plain.stderr
    assert ANSI.sub("", coloured.stderr) == plain.stderr
    # not a terminal: click strips the colour whatever NO_COLOR says
    assert not ANSI.search(cli("validate", BAD, env={"NO_COLOR": ""}).stderr)


def test_generate_quiet_says_only_what_it_wrote_and_verbose_adds_the_time(tmp_path):
    out = tmp_path / "p.py"
    quiet = cli("generate", GOOD, "-o", out, "-q")
    assert quiet.exit_code == 0 and quiet.output.splitlines() == [f"wrote {out} (1 workers, one per device)"]
    normal = cli("generate", GOOD, "-o", out)
    assert "run it:" in normal.output and "generated in" not in normal.output
    assert "generated in" in cli("generate", GOOD, "-o", out, "-v").output


def test_validate_and_plan_verbose_say_how_long_they_took():
    r = cli("validate", "-v", GOOD)
    assert r.exit_code == 0 and re.search(r"checked in \d+ ms", r.stderr)
    assert "checked in" not in cli("validate", GOOD).stderr
    r = cli("plan", "-v", GOOD)
    assert r.exit_code == 0 and "placer: planned in" in r.stderr
    assert "planned in" not in cli("plan", GOOD).stderr


def records(steps=4):
    return [{"step": s, "steps": steps, "loss": 1.0 / s, "samples_per_s": 64.0, "elapsed_s": 0.5 * s}
            for s in range(1, steps + 1)]


def test_progress_off_a_terminal_is_plain_lines_with_elapsed_time_and_eta(capsys):
    console = RunConsole(quiet=False, tty=False)
    for r in records():
        console.progress(r)
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "step 1/4  loss 1.000000  2.00 steps/s  64 samples/s  elapsed 0:00  eta 0:01"
    assert not ANSI.search(err) and "\r" not in err
    assert console.log[-1].startswith("step 4/4  loss 0.250000")


def test_progress_on_a_terminal_is_a_bar_with_elapsed_eta_rate_and_loss(capsys, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws for a terminal
    monkeypatch.delenv("NO_COLOR", raising=False)
    console = RunConsole(quiet=False, tty=True)
    for r in records():
        console.progress(r)
    err = ANSI.sub("", capsys.readouterr().err)
    assert "4/4" in err and "2.00 steps/s" in err and "loss 0.250000" in err and "eta" in err
    assert re.search(r"0:00:0\d", err)  # the elapsed time
    assert console.bar is None  # the last step closes the bar


def test_quiet_shows_no_progress(capsys):
    console = RunConsole(quiet=False, level=-1, tty=False)
    for r in records():
        console.progress(r)
    assert capsys.readouterr().err == "" and len(console.log) == 4  # run.log keeps them
