"""`placer generate`: write the standalone torch program for a spec."""
from __future__ import annotations

import json
import os
import time

import click

from placer.cli.console import DETAIL, echo, verbosity_options
from placer.cli.options import set_option
from placer.cli.run_slurm import sbatch_options
from placer.diagnostics import PlacerError


@click.command("generate")
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Where to write the program (default: <spec name>_program.py here).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="json: {program, world_size, devices, command} on stdout.")
@click.option("--sbatch", "sbatch", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write the Slurm job script for SPEC to FILE instead of the program (submit it with "
                   "`sbatch FILE`; takes --partition, --time, --account, --sbatch-option). Its nodes run "
                   "`placer run --in-job`, so placer must be installed where the job runs.")
@click.option("--k8s", "k8s", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write a Kubernetes manifest for SPEC to FILE instead of the program: a ConfigMap (the "
                   "program, the spec and its files) and a JobSet of one pod per node running the program "
                   "with torchrun (`kubectl apply -f FILE`; needs the JobSet controller).")
@click.option("--image", default=None, metavar="IMAGE",
              help="--k8s: the container image; it must hold torch and the model's packages, not placer "
                   "(default pytorch/pytorch:latest).")
@sbatch_options
@set_option
@verbosity_options
def command(spec_path, output, fmt, overrides, sbatch, k8s, image, slurm):
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
      placer generate spec.yaml --sbatch job.sbatch --partition gpu --time 1:00:00
      sbatch job.sbatch                          # one Slurm job (docs/cluster.md)
      placer generate spec.yaml --k8s run.yaml --image ghcr.io/me/train:1
      kubectl apply -f run.yaml                  # a JobSet on Kubernetes

    -q prints only the line that says what was written; -v adds how long generating took.
    """
    from placer.cli.main import fail, load_and_warn, write_or_exit
    from placer.deps import require_torch

    require_torch("placer generate")
    from placer.codegen.program import generate

    if sbatch and k8s:
        raise click.UsageError("--sbatch and --k8s each write one file: pass one of them")
    if image and not k8s:
        raise click.UsageError("--image goes with --k8s FILE")
    t0 = time.perf_counter()
    try:
        spec = load_and_warn(spec_path, overrides)
        if spec.auto and (sbatch or k8s):  # each node would search on its own machine, and might choose apart
            raise click.UsageError("--sbatch and --k8s take a written placement: `placer suggest SPEC -o "
                                   "placed.yaml`, then generate placed.yaml")
        from placer.search import resolve

        spec, _ = resolve(spec, lambda msg: echo(f"placer: {msg}", err=True))
        output = output or f"{spec.name}_program.py"  # --sbatch: generated all the same, to fail here, not in the job
        # --k8s: the program sits at the spec's folder's place in the ConfigMap's volume
        where = os.path.dirname(os.path.abspath(spec_path if k8s else output))
        program = generate(spec, filename="program.py" if k8s else os.path.basename(output), out_dir=where)
    except PlacerError as e:
        fail(e, fmt)
    if sbatch:
        _write_sbatch(spec, spec_path, sbatch, slurm, overrides, fmt)
        return
    if k8s:
        _write_k8s(spec, spec_path, k8s, program, image, overrides, fmt)
        return
    write_or_exit(output, program.text)
    command_line = program.command(output)
    if fmt == "json":
        click.echo(json.dumps({"program": output, "world_size": program.world_size,
                               "devices": list(program.devices), "command": command_line}, indent=2))
        return
    click.echo(f"wrote {output} ({program.world_size} workers, one per device)")
    echo(f"run it: {command_line}")
    echo(f"    or: python {output}   (starts its own workers; --simulate runs them all on CPU)")
    echo(f"generated in {time.perf_counter() - t0:.2f} s ({len(program.text.splitlines())} lines)", level=DETAIL)


def _write_sbatch(spec, spec_path: str, path: str, slurm, overrides, fmt: str) -> None:
    from placer.cli.main import fail, write_or_exit
    from placer.launch import slurm as jobs

    try:
        text = jobs.script(spec, spec_path=spec_path, run_dir=None, options=slurm,
                           placer_args=tuple(a for o in overrides for a in ("--set", o)))
        shape = jobs.job_shape(spec)
    except PlacerError as e:
        fail(e, fmt)
    write_or_exit(path, text)
    if fmt == "json":
        click.echo(json.dumps({"sbatch": path, "nodes": shape.nnodes, "workers_per_node": shape.per_node,
                               "gpus_per_node": shape.gpus_per_node, "command": f"sbatch {path}"}, indent=2))
        return
    click.echo(f"wrote {path} (a Slurm job: {shape.nnodes} node(s) x {shape.per_node} worker(s)"
               f"{f', {shape.gpus_per_node} GPU(s) per node' if shape.gpus_per_node else ''})")
    echo(f"submit it: sbatch {path}   (its run directory: runs/{spec.name}-<job id>, or $PLACER_RUN_DIR)")


def _write_k8s(spec, spec_path: str, path: str, program, image: str | None, overrides, fmt: str) -> None:
    from pathlib import Path

    from placer.cli.main import fail, write_or_exit
    from placer.launch import k8s
    from placer.launch.resume import effective_spec

    try:
        _, spec_text = effective_spec(spec.doc, Path(spec_path).read_bytes(), overrides)
        text = k8s.manifest(spec, program.text, spec_text, image=image or k8s.DEFAULT_IMAGE)
        shape = k8s.job_shape(spec)
    except PlacerError as e:
        fail(e, fmt)
    write_or_exit(path, text)
    name = k8s.dns_name(spec.name)
    if fmt == "json":
        click.echo(json.dumps({"k8s": path, "name": name, "kind": "JobSet", "api_version": k8s.JOBSET_API,
                               "pods": shape.nnodes, "workers_per_pod": shape.per_node,
                               "gpus_per_pod": shape.gpus_per_node, "command": f"kubectl apply -f {path}"}, indent=2))
        return
    click.echo(f"wrote {path} (ConfigMap and JobSet {name}: {shape.nnodes} pod(s) x {shape.per_node} worker(s)"
               f"{f', {shape.gpus_per_node} nvidia.com/gpu each' if shape.gpus_per_node else ''})")
    echo(f"run it: kubectl apply -f {path}   (then: kubectl logs -f jobs/{name}-node-0)")
