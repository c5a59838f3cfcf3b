"""`placer generate --k8s`: the manifest validates against the published schemas (tests/schemas/),
strictly (no field the schema does not list), and holds what the pods need."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from placer.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "tests" / "schemas"


def strict(schema):
    """A CRD's structural schema, closed as `kubectl apply --validate=strict` closes it: an
    object that lists its properties takes no others (unless it preserves unknown fields)."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node and \
                    not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)
    close(schema)
    return schema


@pytest.fixture(scope="module")
def validators():
    jobset = strict(json.loads((SCHEMAS / "jobset.x-k8s.io_v1alpha2.json").read_text()))
    configmap = json.loads((SCHEMAS / "configmap-v1.json").read_text())
    return {"JobSet": jsonschema.Draft7Validator(jobset), "ConfigMap": jsonschema.Draft7Validator(configmap)}


def manifest(tmp_path: Path, spec: str, *args: str) -> list[dict]:
    out = tmp_path / "run.yaml"
    r = CliRunner().invoke(main, ["generate", spec, "--k8s", str(out), *args])
    assert r.exit_code == 0, r.output
    assert out.read_text().startswith("# Kubernetes run of placer spec")
    return list(yaml.safe_load_all(out.read_text()))


def errors(validator, doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_a_module_model_on_three_gpus(tmp_path, validators):
    configmap, jobset = manifest(tmp_path, str(ROOT / "specs" / "tinygpt.yaml"), "--image", "ghcr.io/me/train:1")
    assert errors(validators["ConfigMap"], configmap) == []
    assert errors(validators["JobSet"], jobset) == []
    assert all(re.fullmatch(r"[-._a-zA-Z0-9]+", key) for key in configmap["data"])
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    items = {i["path"]: i["key"] for i in pod["volumes"][0]["configMap"]["items"]}
    assert {"program.py", "spec.yaml", "models/tinygpt.py"} <= set(items)
    assert set(items.values()) == set(configmap["data"])
    program = configmap["data"]["program.py"]
    assert 'SPEC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".")' in program
    assert configmap["data"][items["models/tinygpt.py"]] == (ROOT / "specs/models/tinygpt.py").read_text()
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/me/train:1"
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 3}}
    assert container["command"][:3] == ["torchrun", "--standalone", "--nproc-per-node=3"]


def test_two_nodes_meet_at_the_first_pod(tmp_path, validators):
    _, jobset = manifest(tmp_path, str(ROOT / "specs" / "mlp_multi_node.yaml"))
    assert errors(validators["JobSet"], jobset) == []
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (2, 2, "Indexed")
    command = job["template"]["spec"]["containers"][0]["command"]
    assert "--nnodes=2" in command and "--nproc-per-node=2" in command and "--rdzv-backend=c10d" in command
    assert "--rdzv-endpoint=placer-mlp-multi-node-node-0-0.placer-mlp-multi-node:29500" in command
    assert jobset["spec"]["network"] == {"enableDNSHostnames": True}


def test_cpu_workers_ask_for_no_gpu_and_the_json_says_what_was_written(tmp_path, validators):
    out = tmp_path / "cpu.yaml"
    r = CliRunner().invoke(main, ["generate", str(ROOT / "specs" / "mlp_cpu_workers.yaml"), "--k8s", str(out),
                                  "--set", "runtime.simulate=always", "--format", "json"])
    assert r.exit_code == 0, r.output
    said = json.loads(r.stdout)
    assert said["kind"] == "JobSet" and said["gpus_per_pod"] == 0 and said["command"] == f"kubectl apply -f {out}"
    configmap, jobset = yaml.safe_load_all(out.read_text())
    assert "simulate: always" in configmap["data"]["spec.yaml"]
    assert "resources" not in jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]
    assert errors(validators["JobSet"], jobset) == []


def test_the_strict_schema_refuses_a_misspelt_field(tmp_path, validators):
    _, jobset = manifest(tmp_path, str(ROOT / "specs" / "mlp_multi_node.yaml"))
    jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    assert any("'comand' was unexpected" in e for e in errors(validators["JobSet"], jobset))


def test_a_file_outside_the_spec_folder_is_r045(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "net.py").write_text("import torch.nn as nn\n\n\ndef make():\n    return nn.Sequential(nn.Linear(4, 2))\n")
    (tmp_path / "specs").mkdir()
    spec = tmp_path / "specs" / "s.yaml"
    spec.write_text("""placer: 1
name: outside
model:
  module: ../models/net.py:make
  input: {shape: [B, 4]}
  target: {shape: [B, 2]}
  loss: MSELoss
devices: [cpu]
placement:
  - {layers: "*", device: cpu}
training:
  batch_size: 2
  steps: 1
  optimizer: {op: SGD, lr: 0.1}
""")
    r = CliRunner().invoke(main, ["generate", str(spec), "--k8s", str(tmp_path / "k.yaml")])
    assert r.exit_code == 1, r.output
    assert "error[R045]: ../models/net.py lies outside the spec's folder" in r.stderr
    assert not (tmp_path / "k.yaml").exists()
