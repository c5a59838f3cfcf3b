"""`placer generate`: write the standalone torch program for a spec."""
from __future__ import annotations

import json
import os
import sys
import time

import click

from placer.cli.console import DETAIL, echo, verbosity_options
from placer.cli.options import set_option
from placer.diagnostics import PlacerError


@click.command("generate")
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Where to write the program (default: <spec name>_program.py here).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="json: {program, world_size, devices, command} on stdout.")
@set_option
@verbosity_options
def command(spec_path, output, fmt, overrides):
    """Write a standalone, readable torch training program for SPEC.

    The program imports torch and the spec's own model / data files only (never placer),
    has one function per segment, and shows every copy, split, merge and gradient sync as
    a plain call. Parallel modes use torch's own machinery where it fits (DDP, ZeRO,
    FSDP2, DTensor tensor parallel, torch.distributed.pipelining schedules) and pasted,
    readable pieces elsewhere (channel and spatial splits, halo exchange, copies).
    This imports torch and, for `model.module` specs, RUNS THE USER'S MODEL CODE (to
    trace shapes).

    \b
    Examples:
      placer generate specs/mlp_group_transitions.yaml -o program.py
      torchrun --nproc-per-node 3 program.py     # one worker per device
      python program.py                          # starts its own workers
      python program.py --reference              # the whole model in one process

    -q prints only the line that says what was written; -v adds how long generating took.
    """
    from placer.cli.main import fail, load_and_warn
    from placer.deps import require_torch

    require_torch("placer generate")
    from placer.codegen.program import generate

    t0 = time.perf_counter()
    try:
        spec = load_and_warn(spec_path, overrides)
        from placer.search import resolve

        spec, _ = resolve(spec, lambda msg: echo(f"placer: {msg}", err=True))
        output = output or f"{spec.name}_program.py"
        program = generate(spec, filename=os.path.basename(output), out_dir=os.path.dirname(os.path.abspath(output)))
    except PlacerError as e:
        fail(e, fmt)
    try:
        with open(output, "w") as f:
            f.write(program.text)
    except OSError as e:
        click.echo(f"error: cannot write {output}: {e.strerror}", err=True)
        sys.exit(1)
    command_line = program.command(output)
    if fmt == "json":
        click.echo(json.dumps({"program": output, "world_size": program.world_size,
                               "devices": list(program.devices), "command": command_line}, indent=2))
        return
    click.echo(f"wrote {output} ({program.world_size} workers, one per device)")
    echo(f"run it: {command_line}")
    echo(f"    or: python {output}   (starts its own workers; --simulate runs them all on CPU)")
    echo(f"generated in {time.perf_counter() - t0:.2f} s ({len(program.text.splitlines())} lines)", level=DETAIL)
