"""`placer suggest`: search for the placement, and write it as a spec (placer/search/)."""
from __future__ import annotations

import json
import sys

import click

from placer import units
from placer.cli.console import echo, verbosity_options
from placer.cli.options import set_option
from placer.estimate.hardware import CHOICES

JSON_FORMAT = "placer-suggest/1"


@click.command("suggest")
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Write the suggested spec here (default: print it).")
@click.option("--hardware", type=click.Choice(CHOICES), default="cpu", show_default=True,
              help="The profile a device is scored on where its `devices` entry names no `hardware`: `cpu` is "
              "this machine, measured (once, about 20 s, then cached), the GPUs their data sheets.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text: the spec (or, with -o, a summary); json: every candidate kept, fastest first.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@set_option
@verbosity_options
def command(spec_path, output, hardware, fmt, force, overrides):
    """Find a placement for SPEC: the fastest predicted plan that fits every stated memory.

    SPEC has the model, the devices and the training section, and `placement: auto` or no
    placement. The search cuts the layers into contiguous stages (a dynamic programme
    over layer ranges), tries per stage one device, data parallelism (with shard none,
    optimizer, full), tensor and tensor x data parallelism, pipelines (gpipe, 1f1b; a few
    micro-batch counts) and recompute; prunes every plan whose memory estimate exceeds a
    device's `memory`; and scores the rest with the step-time model of `placer plan
    --hardware`, each device on its own `hardware`. The same inputs give the same plan.

    The written spec is SPEC with the placement filled in, and a comment header saying the
    predicted step time, each device's memory against its capacity, what bounds the step
    and the next best plans. `plan`, `generate` and `run` of a `placement: auto` spec run
    the same search themselves.

    \b
    Examples:
      placer suggest spec.yaml -o placed.yaml
      placer suggest spec.yaml --hardware h100 --format json > candidates.json
    \b
    Devices may state what they hold and are (docs/spec.md):
      devices: [{name: cuda:0, memory: 80GiB, hardware: h100}, {name: cuda:1, memory: 24GiB, hardware: l4}, cpu]

    A module model (`model.module`) is built on the meta device: this RUNS THE USER'S MODEL
    CODE. Progress goes to stderr; -q leaves it out.
    """
    import os

    from placer.cli.main import fail, load_and_warn, write_or_exit
    from placer.deps import require_torch
    from placer.diagnostics import PlacerError

    require_torch("placer suggest")
    from placer.search import suggest

    def say(msg: str) -> None:
        echo(f"placer: {msg}", err=True)

    if output and os.path.exists(output) and not force:
        click.echo(f"error: {output} exists (pass --force to overwrite it)", err=True)
        sys.exit(1)
    try:
        spec = load_and_warn(spec_path, overrides)
        if not spec.auto:
            say("the spec has a placement: searching as if it were `placement: auto`")
            import dataclasses

            spec = dataclasses.replace(spec, placement=(), pipeline=None, auto=True)
        s = suggest(spec, hardware, say)
    except PlacerError as e:
        fail(e, fmt)
    say(f"scored {s.evaluated} candidates in {s.seconds:.1f} s ({s.pruned} over a stated memory)")
    if output:
        from placer.search import relocate

        write_or_exit(output, relocate(s.text, spec, os.path.dirname(os.path.abspath(output))))
    if fmt == "json":
        click.echo(json.dumps({"format": JSON_FORMAT, "name": spec.name, "output": output,
                               "hardware": s.hardware, "capacities": s.caps, "evaluated": s.evaluated,
                               "pruned": s.pruned, "seconds": round(s.seconds, 3),
                               "candidates": [c.as_dict() for c in s.kept]}, indent=2))
    elif output:
        click.echo(f"wrote {output}: {s.best.describe()}, predicted {units.seconds(s.best.step_s)} a step")
        echo("".join(line[2:] + "\n" for line in s.text.splitlines() if line.startswith("#  ")), err=False)
    else:
        click.echo(s.text, nl=False)
    sys.exit(0)
