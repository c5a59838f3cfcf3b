"""`placer generate`: the program text for every example spec (no processes started here;
tests/distributed/test_run_modes.py and test_program.py run the programs)."""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.main import main
from placer.codegen.program import generate
from placer.spec.check import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "specs").glob("*.yaml")) + sorted((ROOT / "examples").glob("*/spec.yaml"))


def _lint(text: str) -> str:
    """What `ruff check --select F` (pyflakes: unused and undefined names) says of a program."""
    from ruff.__main__ import find_ruff_bin

    proc = subprocess.run([find_ruff_bin(), "check", "--isolated", "--select", "F", "--output-format", "concise",
                           "--stdin-filename", "program.py", "-"], input=text, capture_output=True, text=True)
    return proc.stdout if proc.returncode else ""


def _imported_modules(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    return names


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem if p.stem != "spec" else p.parent.name)
def test_every_example_spec_generates_a_program(path):
    spec = load_spec(str(path))
    program = generate(spec, filename="prog.py")
    tree = ast.parse(program.text)
    assert _lint(program.text) == ""  # no unused or undefined names
    # formatted: no line over the formatter's 100 columns but comments and strings it cannot break
    long = [line for line in program.text.splitlines() if len(line) > 100 and not line.lstrip().startswith(("#", '"', "f\""))
            and "#" not in line and '"""' not in line]
    assert not long, long[:3]
    imported = _imported_modules(tree)
    assert not any(m == "placer" or m.startswith("placer.") for m in imported), imported
    assert {m.split(".")[0] for m in imported} <= {"torch", "argparse", "collections", "contextlib", "errno", "functools", "hashlib",
                                                   "importlib", "json", "os", "queue", "shutil", "subprocess",
                                                   "sys", "threading", "time", "datetime", "typing", "ctypes", "mmap",
                                                   "signal", "resource", "tempfile", "uuid", "warnings"}
    tops = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert len(tops) == len(set(tops)), "a name is defined twice"
    # one function per segment, and the entry points
    assert sum(t.startswith("stage_") for t in tops) == len(spec.placement)
    assert {"train", "reference", "main", "build_model", "make_optimizer", "batches"} <= set(tops)
    header = program.text.split("\nimport ", 1)[0]
    sha = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    assert spec.name in header and sha in header and f"--nproc-per-node {program.nproc_per_node} " in header
    assert "python prog.py --reference" in header
    assert program.world_size == len(spec.devices)


def _program_namespace(text: str) -> dict:
    ns = {"__name__": "generated_program", "__file__": os.path.join(os.getcwd(), "prog.py")}  # generated here
    exec(compile(text, "<generated>", "exec"), ns)
    return ns


@pytest.mark.parametrize("name", ["mlp_group_transitions", "mlp_data_sync_batchnorm", "transformer_encoder", "tinygpt"])
def test_program_model_has_the_reference_parameter_names(name):
    from placer.model.build import build_module

    spec = load_spec(str(ROOT / "specs" / f"{name}.yaml"))
    program = generate(spec)
    ns = _program_namespace(program.text)
    got = [n for n, _ in ns["build_model"]().named_parameters()]
    want = [n for n, _ in build_module(spec).named_parameters()]
    assert got == want


def test_repeat_layers_are_a_module_list_and_stages_slice_it(tmp_path):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("""placer: 1
name: rep
model:
  layers:
    - {name: inp, op: Linear, args: [4, 8]}
    - {name: block, op: Linear, args: [8, 8], repeat: 4}
    - {name: head, op: Linear, args: [8, 2]}
  input: {shape: [B, 4]}
  target: {shape: [B, 2]}
  loss: MSELoss
devices: [cpu, "cpu:1"]
placement:
  - {layers: inp..block.1, device: cpu}
  - {layers: block.2..head, device: "cpu:1"}
training: {batch_size: 4, steps: 1, optimizer: {op: SGD, lr: 0.1}}
""")
    program = generate(load_spec(str(spec_file)))
    assert "nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])" in program.text
    assert "nn.Sequential(model.inp, *model.block[0:2])" in program.text
    assert "nn.Sequential(*model.block[2:4], model.head)" in program.text
    ns = _program_namespace(program.text)
    model = ns["build_model"]()
    stages = [ns["stage_0"](model), ns["stage_1"](model)]
    x = ns["make_batch"](0)[0]
    import torch

    torch.testing.assert_close(stages[1](stages[0](x)), model(x), rtol=0, atol=0)


def test_devices_are_in_rank_order_node_by_node(tmp_path):
    text = (ROOT / "specs" / "mlp_multi_node.yaml").read_text().replace(
        "devices: [node0/cuda:0, node0/cuda:1, node1/cuda:0, node1/cuda:1]",
        "devices: [node1/cuda:0, node0/cuda:0, node1/cuda:1, node0/cuda:1]")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(text)
    program = generate(load_spec(str(spec_file)))
    assert program.devices == ("node0/cuda:0", "node0/cuda:1", "node1/cuda:0", "node1/cuda:1")
    assert program.nnodes == 2 and program.nproc_per_node == 2
    assert 'DEVICES = ["node0/cuda:0", "node0/cuda:1", "node1/cuda:0", "node1/cuda:1"]' in program.text
    assert "--nnodes 2 --node-rank K" in program.text


def test_generate_cli_writes_the_program(tmp_path):
    out = tmp_path / "p.py"
    r = CliRunner().invoke(main, ["generate", str(ROOT / "specs" / "mlp_data_param_server_cpu.yaml"), "-o", str(out),
                                  "--format", "json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info == {"program": str(out), "world_size": 3, "devices": ["cpu", "cuda:0", "cuda:1"],
                    "command": f"torchrun --nproc-per-node 3 {out}"}
    text = out.read_text()
    assert "param_server_step(" in text and "DistributedDataParallel" not in text


def test_generate_cli_reports_an_unsupported_stage_without_traceback(tmp_path):
    spec_file = tmp_path / "spec.yaml"
    text = (ROOT / "specs" / "mlp_pipeline_data_stages.yaml").read_text()
    # a 2-D stage (data replicas of a split) under 1F1B: placer's own loops in its order
    spec_file.write_text(text.replace("parallel: data\npipeline", "parallel: {mode: channel, data: 2}\npipeline").replace(
        "devices: [cuda:2, cuda:3]", "devices: [cuda:2, cuda:3, cuda:4, cuda:5]").replace(
        "devices: [cuda:0, cuda:1, cuda:2, cuda:3]", "devices: [cuda:0, cuda:1, cuda:2, cuda:3, cuda:4, cuda:5]"))
    r = CliRunner().invoke(main, ["validate", str(spec_file)])
    assert r.exit_code == 0 and "warning" not in r.output, r.output
    r = CliRunner().invoke(main, ["generate", str(spec_file), "-o", str(tmp_path / "p.py")])
    assert r.exit_code == 0, r.output
    program = (tmp_path / "p.py").read_text()
    assert "order = {" in program and "Replicas([2, 3, 4, 5], 2)" in program
    # FSDP2 x TP on a stage tensor parallelism cannot split (three Linears in a row) is refused
    # before any program is written
    spec_file.write_text(spec_file.read_text().replace("{mode: channel, data: 2}", "{mode: tensor, data: 2, shard: full}"))
    r = CliRunner().invoke(main, ["generate", str(spec_file), "-o", str(tmp_path / "q.py")])
    assert r.exit_code == 1 and "error[P028]" in r.stderr and "Traceback" not in r.output, r.output
    assert not (tmp_path / "q.py").exists()
    # a data stage that syncs by broadcast: placer's own loops run it in 1F1B's order
    spec_file.write_text(text.replace("parallel: data\n  - name: stage1", "parallel: {mode: data, sync: broadcast}\n"
                                      "  - name: stage1"))
    r = CliRunner().invoke(main, ["generate", str(spec_file), "-o", str(tmp_path / "p.py")])
    assert r.exit_code == 0, r.output
    program = (tmp_path / "p.py").read_text()
    assert "order = {" in program and "make_pipeline_schedule" not in program


# what each mode's program calls: the pasted piece that does the mode's communication
MODE_CALLS = {
    "cnn_channel": ["seg0 = ChannelSplit(stage, g0, [0, 1])", "relayout(h0, Replicate([0, 1]), Replicate([0])",
                    "channel_unshard(seg0)"],
    "mlp_tensor": ['tensor_parallelize(stage, g0, [("0", "2"), ("3", "5")], device.type)', "GATHERED.update(whole)"],
    "cnn_spatial": ["SpatialSplit(stage, g0, [0, 1], dim=2, size=16)", "local_slice(x, [0, 1], rank, 2)",
                    "relayout(h0, Shard(2, [0, 1]), Replicate([0])", "all_reduce_grads(seg0.parameters(), g0"],
    "cnn_spatial_dense": ["out = relayout(h0, Shard(2, [0, 1]), Replicate([0]), [4, 2, 8, 8],",
                          "loss = compute_loss(out, y.to(device))", "torch.autograd.backward(h0, d0)"],
    "mlp_data_shard_optimizer": ["zero_optimizer(seg0.parameters(), g0, torch.optim.", "ddp_sum("],
    "mlp_data_shard_full": ["fully_shard_segment(stage, g0, device.type)"],
    "mlp_data_sync_batchnorm": ["sync_batchnorm(stage, g"],
    "mlp_pipeline_data_stages": ["PIPELINES = [[0, 2], [1, 3]]", 'make_pipeline_schedule("1f1b", stages, 4',
                                 "x = pipeline_local_batch(x, 4, 2, j)", "all_reduce_grads(seg1.parameters(), g1"],
    "mlp_pipeline_interleaved_1f1b": ["PIPELINES = [[0, 1]]", 'make_pipeline_schedule("interleaved_1f1b", stages, 4'],
    "mlp_pipeline_dualpipev": ['make_pipeline_schedule("dualpipev"'],
    "mlp_pipeline_tensor_stages": ["PIPELINES = [[0, 2], [1, 3]]", "seg0 = ChannelSplit(stage, g0, [0, 1])",
                                   'tensor_parallelize(stage, g1, [("0", "2")], device.type)',
                                   "total = (loss if j == 0 else torch.zeros(())).float().cpu()"],
    "mlp_pipeline_gpipe_mixed": ["xs, ys, saved = x.chunk(4), y.chunk(4), []", "a1, a2, h0, h1, h2, loss = saved[mb]",
                                 "relayout(h0, Shard(0, [0, 1]), Replicate([2, 3]), [4, 64],",
                                 "all_reduce_grads(seg0.parameters(), g0"],
}


@pytest.mark.parametrize("name", sorted(MODE_CALLS))
def test_each_mode_program_calls_its_pieces(name):
    text = generate(load_spec(str(ROOT / "specs" / f"{name}.yaml"))).text
    def flat(code):  # the formatter breaks long calls over lines, with a trailing comma
        return re.sub(r",([\])])", r"\1", "".join(code.split()))

    for call in MODE_CALLS[name]:
        assert flat(call) in flat(text), call
    if "PIPELINES" in text:  # stages send through torch's schedules, not our point-to-point copies
        assert "redistribute(" not in text and "DistributedDataParallel" not in text
    if "saved[mb]" in text:  # micro-batch loops: DDP would all-reduce once per backward
        assert "ddp_sum(" not in text.split("def train")[1]


def test_split_stages_beside_others_run_as_placers_loops_in_the_schedules_order(tmp_path):
    """A tensor stage between two single devices under 1F1B: no W005, and the program runs each
    rank's actions with GPipe's copies (relayout) into and out of the split stage, the send halves
    posted (`pending=sends`) and told apart by tag."""
    spec_file = tmp_path / "spec.yaml"
    text = (ROOT / "specs" / "mlp_pipeline_gpipe_mixed.yaml").read_text()
    for old, new in (("schedule: gpipe", "schedule: 1f1b"), ("cuda:0, cuda:1, cuda:2", "cuda:0, cuda:2"),
                     ("devices: [cuda:0, cuda:1], parallel: data", "device: cuda:0")):
        text = text.replace(old, new)
    spec_file.write_text(text)  # one device, a tensor stage over 2, one device
    r = CliRunner().invoke(main, ["validate", "--strict", str(spec_file)])
    assert r.exit_code == 0 and "W005" not in r.output, r.output
    program = generate(load_spec(str(spec_file))).text
    flat = re.sub(r",([\])])", r"\1", "".join(program.split()))
    assert "for action in order:" in program and "make_pipeline_schedule" not in program
    assert '1: "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3"' in program  # the tensor pair's ranks run one order
    assert '2: "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3"' in program
    for call in ("relayout(h,Replicate([0]),Replicate([1,2]),[4,64],", "pending=sends,tag=8+mb)",
                 "a=relayout(None,Replicate([0]),Replicate([1,2]),[4,64],",
                 "relayout_grad(a.grad,Replicate([0]),Replicate([1,2]),[4,64],", "tensor_parallelize("):
        assert call in flat, call
