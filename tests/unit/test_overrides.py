"""`--set KEY=VALUE` overrides (validate, plan, generate, run), `run --max-restarts`, and hints for
launcher flags placer does not take."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.main import main
from placer.diagnostics import SpecError
from placer.spec import check, load

ROOT = Path(__file__).resolve().parents[2]
SPEC = str(ROOT / "specs" / "mlp_data_allreduce.yaml")


def cli(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_values_are_yaml_and_checked_like_the_file():
    doc = load.load_file(SPEC, ["training.batch_size=64", "training.optimizer.lr=1e-3", "runtime.max_restarts=2",
                                "placement.0.name=middle"])
    spec, diags = check.validate_document(doc)
    assert not [d for d in diags if d.severity == "error"]
    assert (spec.training.batch_size, spec.training.optimizer.lr, spec.runtime.max_restarts) == (64, 1e-3, 2)
    assert spec.placement[0].name == "middle"
    assert load.load_file(SPEC).data["training"]["batch_size"] != 64  # the file is not changed


@pytest.mark.parametrize("override, first", [
    ("training.batch_size=abc", '--set training.batch_size=abc: error[S003]: training.batch_size must be an '
                                'integer, not "abc"'),
    ("training.batch_sz=3", "--set training.batch_sz=3: error[S001]: unknown key 'batch_sz' in training"),
    ("devices.7=cpu", "--set devices.7=cpu: error[L013]: devices has 4 items; there is no item 7"),
    ("name.x=1", "--set name.x=1: error[L013]: name is a string: it has no entry 'x'"),
    ("training.batch_size=[", "--set training.batch_size=[: error[L003]: YAML syntax: did not find expected "
                              "node content"),
    ("name=!!python/object:os.system x", "--set name=!!python/object:os.system x: error[L004]: YAML tag "
                                         "'!!python/object:os.system' is not allowed"),
])
def test_errors_name_the_override(override, first):
    r = cli("validate", SPEC, "--set", override)
    assert r.exit_code == 1 and r.stderr.splitlines()[0] == first, r.output


def test_a_quoted_boolean_hint_under_set():
    r = cli("validate", SPEC, "--set", "name=no")
    assert 'quote it' in r.stderr, r.stderr


def test_set_must_be_key_value():
    r = CliRunner().invoke(main, ["plan", SPEC, "--set", "nokey"])
    assert r.exit_code == 2 and "is not KEY=VALUE" in r.output


@pytest.mark.parametrize("command", ["validate", "plan", "generate", "run"])
def test_every_command_takes_set(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = cli(command, SPEC, "--set", "training.steps=0")
    assert r.exit_code == 1 and "--set training.steps=0: error[S006]" in r.stderr, r.output


def test_plan_uses_the_override():
    r = cli("plan", SPEC, "-q", "--set", "training.batch_size=64")
    assert r.exit_code == 0 and "batch 64" in r.stdout.splitlines()[0], r.output


def test_max_restarts_is_an_alias_of_set(monkeypatch):
    import placer.cli.run_cmd as run_cmd

    seen = {}

    def fake_run(spec_path, console, **kw):
        seen.update(kw)
        seen["spec"] = check.load_spec(spec_path, kw["overrides"])
        return {"ok": True}

    monkeypatch.setattr(run_cmd, "run", fake_run)
    r = cli("run", SPEC, "--max-restarts", "3", "--set", "training.steps=2")
    assert r.exit_code == 0, r.output
    assert seen["overrides"] == ("training.steps=2", "runtime.max_restarts=3")
    assert seen["spec"].runtime.max_restarts == 3 and seen["spec"].training.steps == 2


@pytest.mark.parametrize("command, flag, says", [
    ("run", "--nproc-per-node=2", "one worker (rank) per device listed in `devices:`"),
    ("run", "--nproc_per_node", "one worker (rank) per device listed in `devices:`"),
    ("generate", "--nnodes", "`nodeK/` device prefixes"),
    ("run", "--master-addr", "--rdzv-endpoint HOST:PORT"),
    ("plan", "--max-restarts", "runtime.max_restarts"),
    ("run", "--batch-size", "--set training.batch_size=64"),
])
def test_launcher_flags_get_a_hint(command, flag, says):
    r = CliRunner().invoke(main, [command, SPEC, flag, "2"])
    assert r.exit_code == 2, r.output
    assert "No such option" in r.output and "hint: " in r.output and says in r.output, r.output


def test_other_unknown_options_keep_clicks_suggestion():
    r = CliRunner().invoke(main, ["run", SPEC, "--max-restart", "2"])
    assert r.exit_code == 2 and "Did you mean '--max-restarts'?" in r.output and "hint:" not in r.output


def test_spec_error_from_override_is_a_spec_error():
    with pytest.raises(SpecError) as e:
        check.load_spec(SPEC, ["training.steps=-1"])
    assert str(e.value.diagnostics[0].loc) == "--set training.steps=-1"
