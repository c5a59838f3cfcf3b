"""The `placer` command line. The only module that prints."""
from __future__ import annotations

import json
import sys
import time

import click

from placer import __version__, units
from placer.cli.console import echo, paint, verbosity, verbosity_options
from placer.cli.options import launcher_hint, set_option
from placer.deps import INSTALL, MissingDependency, is_missing_torch
from placer.diagnostics import Diagnostic, PlacerError, format_report

FORMATS = click.Choice(["text", "json", "github"])


class PlacerGroup(click.Group):
    """The `placer` group: a missing torch is one line naming the install command, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.NoSuchOption as e:  # torchrun habits: say where placer decides what the flag would
            hint = launcher_hint(e.option_name)
            if hint:
                e.message += f"\n  hint: {hint}"
                e.possibilities = None
            raise
        except ModuleNotFoundError as e:
            if not is_missing_torch(e):
                raise
            # Commands say it themselves (require_torch); this catches an import they did not foresee.
            what = str(e) if isinstance(e, MissingDependency) else \
                f"placer {ctx.invoked_subcommand} needs PyTorch: {INSTALL}"
            click.echo(f"error: {what}", err=True)
            ctx.exit(1)


@click.group(cls=PlacerGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="placer")
def main():
    """Place every layer of a PyTorch model on devices, from one YAML spec.

    \b
    placer validate spec.yaml   check the spec (schema + semantic rules), file:line:col errors
    placer plan spec.yaml       per-device memory, copies, collectives, comm bytes, diagrams
    placer generate spec.yaml   a readable standalone torch program
    placer run spec.yaml        generate and launch it (simulated on CPU workers if devices are missing)
    placer suggest spec.yaml    find the placement: the fastest plan that fits (writes the spec)
    placer init -o spec.yaml    a commented starter spec (--model REF: your model's layers, placed)
    placer schema               the JSON Schema of a spec (--path: where the installed file is)

    The spec language is described in docs/spec.md; error codes in docs/errors.md.
    Exit codes: 0 ok, 1 invalid spec or failed run, 2 usage error.
    """


def emit_diagnostics(diags: list[Diagnostic], fmt: str, file=None) -> None:
    """Print diagnostics: best first, then a count of the rest (text)."""
    if diags:
        report = format_report(diags, fmt, max_shown=None if fmt != "text" else 10)
        click.echo(paint(report) if fmt == "text" else report, file=file)


def load_and_warn(spec_path: str, overrides=(), say=None):
    """The checked spec for plan, generate and run, its warnings printed as validate prints them
    (`say`: where each goes; stderr by default). SpecError if it has errors."""
    from placer.spec.check import load_checked

    spec, warnings = load_checked(spec_path, overrides)
    if say is None:
        emit_diagnostics(warnings, "text", file=sys.stderr)
    else:
        for w in warnings:
            say(w.format())
    return spec


def fail(err: PlacerError, fmt: str = "text"):
    """Report a user-caused error and exit 1 (no traceback)."""
    if fmt == "json":
        click.echo(json.dumps({"ok": False, "diagnostics": [d.as_dict() for d in err.diagnostics]}, indent=2))
    else:
        emit_diagnostics(err.diagnostics, fmt, file=sys.stderr)
    sys.exit(1)


def write_or_exit(path: str, text: str) -> None:
    """Write `text` to `path`, or say why not in one line and exit 1 (no traceback)."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        click.echo(f"error: cannot write {path}: {e.strerror or e}", err=True)
        sys.exit(1)


@main.command()
@click.argument("specs", nargs=-1, required=True, type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--deep", is_flag=True,
              help="Also build the model on the meta device and check layer names and shapes. "
                   "This imports torch and, for `model.module` specs, RUNS THE USER'S MODEL CODE.")
@click.option("--format", "fmt", type=FORMATS, default="text", show_default=True,
              help="text for people, json for machines, github for workflow annotations.")
@click.option("--strict", is_flag=True, help="Treat warnings as errors.")
@set_option
@verbosity_options
def validate(specs, deep, fmt, strict, overrides):
    """Check spec files: schema, names, devices, coverage, batch arithmetic.

    Plain validate never imports torch or user code, so it is fast and safe to
    run in CI and in pre-commit hooks. Use '-' to read a spec from stdin.
    -q prints errors only (nothing for valid specs); -v adds how long each spec took.

    \b
    Examples:
      placer validate specs/*.yaml
      placer validate --format github specs/*.yaml     # annotations in GitHub Actions
      cat spec.yaml | placer validate -
      placer validate spec.yaml --set training.batch_size=64
    """
    from placer.deps import require_torch
    from placer.spec import check as checks
    from placer.spec import load

    if deep:
        require_torch("placer validate --deep")
    results, failed = [], False
    for path in specs:
        t0 = time.perf_counter()
        try:
            spec, diags = checks.validate_document(load.load_file(path, overrides))
            if spec is not None and deep and not any(d.severity == "error" for d in diags):
                from placer.model import build

                found = build.deep_check(spec)
                if any(d.code == "P086" for d in found):  # the built model's error says what W007 warned
                    diags = [d for d in diags if d.code != "W007"]
                diags += found
        except PlacerError as e:
            spec, diags = None, e.diagnostics
        errors = [d for d in diags if d.severity == "error" or strict]
        failed |= bool(errors)
        results.append((path, spec, diags, not errors, time.perf_counter() - t0))
    if fmt == "json":
        click.echo(json.dumps([{"file": p, "valid": ok, "diagnostics": [d.as_dict() for d in ds]}
                               for p, _, ds, ok, _ in results], indent=2))
    else:
        quiet = verbosity() < 0
        for path, spec, diags, ok, seconds in results:
            emit_diagnostics(diags, fmt, file=sys.stderr if fmt == "text" else None)
            if ok and not quiet and fmt == "text":
                what = (units.count(len(spec.model.layers), "layer") if spec.model.inline
                        else f"module {spec.model.module}")
                warned = f", {units.count(len(diags), 'warning')}" if diags else ""
                click.echo(f"{path}: ok ({what}, {'placement auto' if spec.auto else units.count(len(spec.placement), 'segment')}, "
                           f"{units.count(len(spec.devices), 'device')}{warned})")
            if fmt == "text":
                echo(f"{path}: checked in {seconds * 1000:.0f} ms{' (--deep)' if deep else ''}", level=1, err=True)
    sys.exit(1 if failed else 0)


def _register_optional_commands():
    """Commands of later stages live in their own modules."""
    import importlib

    for mod in ("placer.cli.plan_cmd", "placer.cli.generate_cmd", "placer.cli.run_cmd", "placer.cli.init_cmd", "placer.cli.suggest_cmd",
                "placer.cli.schema_cmd"):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        main.add_command(m.command)


_register_optional_commands()

if __name__ == "__main__":
    main()
