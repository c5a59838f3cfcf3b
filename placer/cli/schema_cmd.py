"""`placer schema`: the JSON Schema of a spec, for editors and other tools."""
from __future__ import annotations

import click

from placer.cli.console import verbosity_options


@click.command("schema")
@click.option("--path", "show_path", is_flag=True, help="Print where the installed schema file is instead.")
@verbosity_options
def command(show_path):
    """Print the JSON Schema (Draft 2020-12) that every spec's shape must match.

    \b
    Editors that speak the YAML language server complete and explain every key
    when a spec's first line names the schema:
      # yaml-language-server: $schema=<the path `placer schema --path` prints>

    \b
    Examples:
      placer schema > placer-spec.schema.json
      placer schema --path

    It prints its result only, so -q and -v change nothing here.
    """
    from placer.spec import schema

    if show_path:
        click.echo(schema.schema_path())
    else:
        click.echo(open(schema.schema_path(), encoding="utf-8").read().rstrip("\n"))
