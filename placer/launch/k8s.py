"""Kubernetes: a spec's run as a ConfigMap (the program and the spec's files) and a JobSet.

Why a JobSet (jobset.x-k8s.io/v1alpha2, kubernetes-sigs/jobset) and not Kubeflow's PyTorchJob:
it is a Kubernetes SIG API with one small controller of its own, it is what Kubeflow Trainer
v2 itself runs training on (its TrainJob makes JobSets; v1's PyTorchJob operator is in
maintenance), and it gives what torch elastic needs and nothing else: one Indexed Job of N
pods with stable DNS names, so the first pod hosts the rendezvous, and one failure policy for
the whole group. The pods run the generated program with torchrun: the image needs torch
(and the model's packages), never placer. Nothing here prints.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from placer import __version__
from placer.diagnostics import Diagnostic, Loc, RunError
from placer.launch.slurm import job_shape
from placer.spec.types import Spec

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
PORT = 29500
MOUNT = "/placer"  # the ConfigMap: program.py, spec.yaml and the spec's files at their paths
RUNS = "/runs"  # the run's outputs (an emptyDir: replace it with a PersistentVolumeClaim to keep them)
CONFIGMAP_MAX = 1024 * 1024  # Kubernetes refuses larger ConfigMaps
DEFAULT_IMAGE = "pytorch/pytorch:latest"


def dns_name(name: str) -> str:
    """`placer-<spec name>` as a DNS label (lower case, `-`), short enough for the pods' host names."""
    return "placer-" + (re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:32].rstrip("-") or "run")


def spec_files(spec: Spec) -> dict[str, Path]:
    """The files the program reads besides itself, by their path relative to the spec's folder:
    the model's and the data's `file.py`, with the .py files beside each (a file may import
    its neighbours: the program puts its folder on sys.path). R045 for a file outside the
    spec's folder (a ConfigMap item's path cannot climb with `..`) or missing."""
    base = Path(spec.file).resolve().parent
    found: dict[str, Path] = {}
    for target, loc in ((spec.model.module, spec.model.loc), (spec.training.data.module, spec.training.data.loc)):
        where = (target or "").rpartition(":")[0]
        if not where.endswith(".py"):
            continue  # synthetic data, or an importable package the image must hold
        path = (base / where).resolve()
        if not path.is_file() or not path.is_relative_to(base):
            why = "does not exist" if not path.is_file() else f"lies outside the spec's folder {base}"
            raise RunError(Diagnostic("R045", f"{where} {why}, so the ConfigMap cannot hold it", loc,
                                      "keep the spec's files under the spec's folder, or install them in the "
                                      "image and name them as a package (module: pkg.mod:Class)"))
        for p in sorted(path.parent.glob("*.py")):
            found[p.relative_to(base).as_posix()] = p
    return found


def _key(path: str) -> str:
    """A ConfigMap key for a path (keys are [-._a-zA-Z0-9]+; the volume's items put it back at the path)."""
    return path.replace("/", "__")


def manifest(spec: Spec, program_text: str, spec_text: str, *, image: str = DEFAULT_IMAGE) -> str:
    """The ConfigMap and the JobSet as one YAML stream, for `kubectl apply -f`."""
    shape = job_shape(spec)
    name = dns_name(spec.name)
    files = {"program.py": program_text, "spec.yaml": spec_text}
    for rel, path in spec_files(spec).items():
        files[rel] = path.read_text()
    size = sum(len(text.encode()) for text in files.values())
    if size > CONFIGMAP_MAX:
        raise RunError(Diagnostic("R046", f"the ConfigMap would hold {size} bytes (program and spec files); "
                                  f"Kubernetes takes at most {CONFIGMAP_MAX}", Loc(spec.file),
                                  "keep large files (weights, data) out of the spec's folder: mount a volume "
                                  "or build them into the image"))
    labels = {"app.kubernetes.io/name": "placer", "app.kubernetes.io/instance": name}
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels},
                 "data": {_key(rel): text for rel, text in files.items()}}
    if shape.nnodes == 1:
        rendezvous = ["--standalone"]
    else:  # the first pod (job index 0) hosts the c10d rendezvous; JobSet gives it this DNS name
        rendezvous = [f"--nnodes={shape.nnodes}", "--rdzv-backend=c10d", f"--rdzv-id={name}",
                      f"--rdzv-endpoint={name}-node-0-0.{name}:{PORT}"]
    container: dict[str, object] = {
        "name": "trainer", "image": image, "workingDir": MOUNT,
        "command": ["torchrun", *rendezvous, f"--nproc-per-node={shape.per_node}",
                    f"{MOUNT}/program.py", "--out", f"{RUNS}/{name}"],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [{"name": "rendezvous", "containerPort": PORT}],
        "volumeMounts": [{"name": "program", "mountPath": MOUNT, "readOnly": True},
                         {"name": "runs", "mountPath": RUNS}, {"name": "shm", "mountPath": "/dev/shm"}],
    }
    if shape.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": shape.gpus_per_node}}
    pod = {"restartPolicy": "Never", "containers": [container], "volumes": [
        {"name": "program", "configMap": {"name": name, "items": [{"key": _key(rel), "path": rel} for rel in files]}},
        {"name": "runs", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},  # torch's workers share tensors through /dev/shm
    ]}
    jobset = {
        "apiVersion": JOBSET_API, "kind": "JobSet", "metadata": {"name": name, "labels": labels},
        "spec": {
            "network": {"enableDNSHostnames": True},
            "failurePolicy": {"maxRestarts": spec.runtime.max_restarts},
            "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": {
                "parallelism": shape.nnodes, "completions": shape.nnodes, "completionMode": "Indexed",
                "backoffLimit": 0, "template": {"metadata": {"labels": labels}, "spec": pod}}}}],
        },
    }
    gpus = f"{shape.gpus_per_node} GPU(s) (nvidia.com/gpu)" if shape.gpus_per_node else "no GPU (CPU workers)"
    header = [
        f"# Kubernetes run of placer spec {spec.name!r} ({os.path.basename(spec.file)}), written by placer {__version__}.",
        "#   kubectl apply -f THIS_FILE          (needs JobSet: https://jobset.sigs.k8s.io, v0.5 or later)",
        f"#   kubectl logs -f jobs/{name}-node-0   kubectl delete -f THIS_FILE",
        f"# {shape.nnodes} pod(s), one per node of the spec, each with {shape.per_node} worker(s) (one per device) "
        f"and {gpus};",
        f"# torchrun's c10d rendezvous on the first pod. The ConfigMap holds the program and the spec's files, "
        f"mounted at {MOUNT};",
        f"# the run's outputs go to {RUNS}/{name} (an emptyDir: use a PersistentVolumeClaim to keep them).",
    ]
    return "\n".join(header) + "\n" + yaml.dump_all([configmap, jobset], Dumper=_Dumper, sort_keys=False,
                                                    width=120, explicit_start=True)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the program, the spec) as literal blocks, readable as they are; no
    `&id001` anchors for the labels written twice."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, text: str):
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)
