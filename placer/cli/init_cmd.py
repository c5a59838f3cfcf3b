"""`placer init`: write a commented starter spec."""
from __future__ import annotations

import os
import sys

import click

from placer.cli.console import echo, verbosity_options
from placer.diagnostics import PlacerError


def _devices(ctx, param, value: str) -> list[str]:
    devices = [d.strip() for d in value.split(",") if d.strip()]
    if not devices:
        raise click.BadParameter("name at least one device, e.g. cuda:0,cuda:1", ctx, param)
    return devices


def _kwargs(ctx, param, value: str | None) -> dict:
    import yaml

    try:
        kwargs = yaml.safe_load(value) if value else {}
    except yaml.YAMLError as e:
        raise click.BadParameter(f"not YAML: {str(e).splitlines()[0]}", ctx, param) from None
    if not isinstance(kwargs, dict):
        raise click.BadParameter("write a mapping, e.g. '{width: 256, depth: 4}'", ctx, param)
    return kwargs


@click.command("init")
@click.option("-o", "--output", default="spec.yaml", show_default=True, type=click.Path(dir_okay=False,
              allow_dash=True), help="Where to write the spec ('-': standard output).")
@click.option("--model", "model_ref", metavar="REF",
              help="Your model: models/net.py:Net (a file, relative to here), or pkg.mod:make_model; a class or "
                   "a function returning an nn.Module. This IMPORTS AND RUNS YOUR MODEL CODE (on the meta "
                   "device: no weights are allocated) and needs PyTorch.")
@click.option("--kwargs", "model_kwargs", metavar="YAML", callback=_kwargs,
              help="Arguments for the model's class or function, a YAML mapping: '{width: 256}'.")
@click.option("--devices", default="cuda:0,cuda:1", show_default=True, callback=_devices,
              help="Comma-separated devices; the layers are spread over them, balanced by parameter count.")
@click.option("--name", help="The spec's name (default: from the output file, or the model).")
@click.option("--force", is_flag=True, help="Overwrite the output file if it exists.")
@verbosity_options
def command(output, model_ref, model_kwargs, devices, name, force):
    """Write a commented starter spec that validates as written, for you to edit.

    Without --model: a small inline MLP (torch.nn layers only, no user code). With
    --model REF: your model's placeable layers (its child modules; ModuleList and
    Sequential are expanded) in a placement balanced over --devices by parameter
    count, and input, target and loss guessed from its first and last layers
    (comments mark what to check).

    \b
    Examples:
      placer init -o spec.yaml && placer validate spec.yaml
      placer init --model models/net.py:Net --kwargs '{width: 256}' --devices cpu,cuda:0 -o net.yaml
      placer init --model torchvision.models:resnet18 --devices cuda:0,cuda:1,cuda:2,cuda:3

    -q leaves out the notes on what to check; the last line says what was written.
    """
    from placer.cli.main import fail, write_or_exit
    from placer.spec import starter

    if output != "-" and os.path.exists(output) and not force:
        click.echo(f"error: {output} exists; pass --force to overwrite it, or -o another file", err=True)
        sys.exit(1)
    stem = os.path.splitext(os.path.basename(output))[0]
    try:
        if output != "-":  # the model file is found relative to the spec's folder: it must exist
            os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        if model_ref:
            from placer.deps import require_torch

            require_torch("placer init --model")
            from placer.model.starter import module_model

            model = module_model(model_ref, output if output != "-" else "spec.yaml", model_kwargs)
            default = model_ref.rpartition(":")[2].lower()
        else:
            model, default = starter.inline_model(), "starter"
        name = starter.spec_name(name or (stem if output != "-" and stem != "spec" else default))
        text = starter.render(name, model, devices, os.path.dirname(output) or "." if output != "-" else None)
    except PlacerError as e:
        fail(e)
    if output == "-":
        click.echo(text, nl=False)
        return
    write_or_exit(output, text)
    for note in model.notes:
        echo(f"note: {note}", err=True)
    click.echo(f"wrote {output}; next: placer validate {output}" + (" --deep" if model_ref else ""))
