"""A pod's view of `placer generate --k8s`, without a cluster: the ConfigMap's files laid out as
its volume mounts them, and the container's torchrun command run there (CPU workers)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from placer.cli.main import main

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_the_container_command_trains_from_the_configmap_alone(tmp_path):
    manifest = tmp_path / "run.yaml"
    r = CliRunner().invoke(main, ["generate", str(ROOT / "specs" / "mlp_user_data.yaml"), "--k8s", str(manifest),
                                  "--set", "training.steps=2"])
    assert r.exit_code == 0, r.output
    configmap, jobset = yaml.safe_load_all(manifest.read_text())
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    mount, runs = tmp_path / "placer", tmp_path / "runs"
    for item in pod["volumes"][0]["configMap"]["items"]:  # the volume: each key at its path
        (mount / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (mount / item["path"]).write_text(configmap["data"][item["key"]])
    assert (mount / "data" / "mlp_batches.py").exists()
    (container,) = pod["containers"]
    moved = {"/placer/": f"{mount}/", "/runs/": f"{runs}/"}  # the pod's mount points, here
    command = [next((new + arg[len(old):] for old, new in moved.items() if arg.startswith(old)), arg)
               for arg in container["command"]]
    assert command[0] == "torchrun"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *command[1:]], cwd=mount, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = runs / "placer-mlp-user-data"
    assert json.loads((out / "metrics.json").read_text())["steps"] == 2
    assert (out / "final_params.pt").exists()
