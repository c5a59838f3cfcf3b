"""`python -m placer`: the `placer` command (a Slurm job's script runs the interpreter that wrote it)."""
from placer.cli.main import main

main(prog_name="placer")
