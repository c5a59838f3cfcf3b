"""`placer validate --deep`: build on meta, then checks that need the real layers."""
from __future__ import annotations

import os
import shutil

import pytest
from click.testing import CliRunner

from placer.cli.main import main
from placer.diagnostics import SpecError
from placer.model import build
from placer.modes import tensor
from placer.spec import check, load

SPECS = os.path.join(os.path.dirname(__file__), "..", "..", "specs")

GPT = """placer: 1
name: g
model:
  module: tinygpt.py:TinyGPT
  kwargs: {vocab: 64, d_model: 16, n_layers: 2, seq: 8, n_heads: 2}
  input: {shape: [B, 8], dtype: int64, high: 64}
  target: {shape: [B, 8], dtype: int64, high: 64}
  loss: CrossEntropyLoss
devices: [cuda:0, cuda:1]
placement:
  - {layers: [embed, blocks.0], device: cuda:0}
  - {layers: [blocks.1, ln_f, lm_head], device: cuda:1}
training: {batch_size: 4, steps: 1, optimizer: {op: SGD, lr: 0.1}}
"""

INLINE = """placer: 1
name: i
model:
  layers:
    - {name: fc1, op: Linear, args: [8, 16]}
    - {name: unflat, op: Unflatten, args: [1, [4, 4]]}
    - {name: fc2, op: Linear, args: [5, 3]}
    - {name: flat, op: Flatten}
  input: {shape: [B, 8]}
  target: {shape: [B, 12]}
  loss: MSELoss
devices: [cpu]
placement:
  - {layers: fc1..flat, device: cpu}
training: {batch_size: 4, steps: 1, optimizer: {op: SGD, lr: 0.1}}
"""


def write(tmp_path, text: str, **files) -> str:
    for name, src in files.items():
        (tmp_path / name).write_text(src)
    shutil.copy(os.path.join(SPECS, "models", "tinygpt.py"), tmp_path / "tinygpt.py")
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return str(path)


def deep(path: str):
    """(plain diagnostics, deep diagnostics) for a spec file."""
    spec, diags = check.validate_document(load.load_file(path))
    assert spec is not None and not [d for d in diags if d.severity == "error"], diags
    return spec, build.deep_check(spec)


def line_of(path: str, needle: str) -> int:
    return next(i for i, l in enumerate(open(path).read().splitlines(), 1) if needle in l)


@pytest.mark.parametrize("name", ["tinygpt.yaml", "transformer_encoder.yaml", "mlp_layerwise_direct.yaml"])
def test_specs_pass_deep(name):
    _, diags = deep(os.path.join(SPECS, name))
    assert diags == []


def test_misnamed_selector_in_module_spec(tmp_path):
    path = write(tmp_path, GPT.replace("[blocks.1, ln_f", "[block.1, ln_f"))
    _, diags = deep(path)  # plain validate cannot know the module's names
    (d,) = diags
    assert d.code == "P001" and "block.1" in d.message and "did you mean 'blocks.1'" in d.hint
    assert d.loc.line == line_of(path, "block.1, ln_f")


def test_uncovered_module_layer(tmp_path):
    _, diags = deep(write(tmp_path, GPT.replace("[blocks.1, ln_f, lm_head]", "[blocks.1, ln_f]")))
    assert [d.code for d in diags] == ["P003"] and "lm_head" in diags[0].message


def test_inline_shape_mismatch_located_at_layer(tmp_path):
    path = write(tmp_path, INLINE)
    _, diags = deep(path)  # the static chain stops at Unflatten; the meta forward does not
    (d,) = diags
    assert d.code == "M006" and "'fc2'" in d.message and "[5, 3]" in d.message
    assert d.loc.line == line_of(path, "name: fc2")


def test_loss_mismatch(tmp_path):
    path = write(tmp_path, INLINE.replace("[5, 3]", "[4, 3]").replace("[B, 12]", "[B, 13]"))
    (d,) = deep(path)[1]
    assert d.code == "M007" and "[4, 12]" in d.message and "[4, 13]" in d.message
    assert d.loc.line == line_of(path, "loss: MSELoss")
    (w,) = deep(write(tmp_path, INLINE.replace("[5, 3]", "[4, 3]").replace("[B, 12]", "[B, 1]")))[1]
    assert w.code == "W004" and w.severity == "warning"


@pytest.mark.parametrize("src, code, text", [
    ("import torch\nx = 1\nraise RuntimeError('boom at import')\n", "M002",
     "RuntimeError: boom at import (at bad.py:3)"),
    ("def f(:\n    pass\n", "M002", "SyntaxError"),
    ("import no_such_module_xyz\n", "M002", "No module named 'no_such_module_xyz'"),
    ("from torch import nn\nclass Other(nn.Module):\n    pass\n", "M003", "has no class 'TinyGPT'"),
    ("TinyGPT = 3\n", "M003", "not an nn.Module subclass"),
])
def test_broken_module_file_is_located(tmp_path, src, code, text):
    path = write(tmp_path, GPT.replace("tinygpt.py:TinyGPT", "bad.py:TinyGPT"), **{"bad.py": src})
    (d,) = deep(path)[1]
    assert d.code == code and text in d.message
    assert "Traceback" not in d.message and "\n" not in d.message
    assert (d.loc.line, d.loc.col) == (line_of(path, "module:"), 11)


def test_constructor_and_forward_errors(tmp_path):
    (d,) = deep(write(tmp_path, GPT.replace("n_heads: 2", "n_heads: 3")))[1]
    assert d.code == "M004" and "not divisible by n_heads 3 (at tinygpt.py:" in d.message
    (d,) = deep(write(tmp_path, GPT.replace("n_heads: 2}", "n_heads: 2, depth: 1}")))[1]
    assert d.code == "M004" and "unexpected keyword argument 'depth'" in d.message
    (d,) = deep(write(tmp_path, GPT.replace("shape: [B, 8], dtype: int64, high: 64}\n  target",
                                            "shape: [B, 9], dtype: int64, high: 64}\n  target")))[1]
    assert d.code == "M006" and "[4, 9] int64" in d.message


def test_sibling_import_and_package_ref(tmp_path):
    helper = "from torch import nn\ndef mlp(d):\n    return nn.Sequential(nn.Linear(d, d), nn.ReLU())\n"
    model = ("from torch import nn\nfrom helper import mlp\nclass Net(nn.Module):\n"
             "    def __init__(self):\n        super().__init__()\n        self.body = mlp(8)\n"
             "        self.out = nn.Linear(8, 4)\n    def forward(self, x):\n        return self.out(self.body(x))\n")
    text = GPT.replace("tinygpt.py:TinyGPT", "sub/net.py:Net").replace(
        "  kwargs: {vocab: 64, d_model: 16, n_layers: 2, seq: 8, n_heads: 2}\n", "").replace(
        "[B, 8], dtype: int64, high: 64}", "[B, 8]}").replace("CrossEntropyLoss", "MSELoss").replace(
        "[embed, blocks.0]", "body.0..body.1").replace("[blocks.1, ln_f, lm_head]", "out")
    text = text.replace("target: {shape: [B, 8]}", "target: {shape: [B, 4]}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper.py").write_text(helper)
    (tmp_path / "sub" / "net.py").write_text(model)
    path = write(tmp_path, text)
    assert deep(path)[1] == []
    (d,) = deep(write(tmp_path, text.replace("sub/net.py:Net", "no_such_pkg_xyz.net:Net")))[1]
    assert d.code == "M001"


def test_a_split_mode_the_program_cannot_run_on_a_module_model_is_an_error(tmp_path):
    """Plain validate's W007 becomes P086 once the model is built: plan --deep must not show it."""
    text = GPT.replace("{layers: [blocks.1, ln_f, lm_head], device: cuda:1}",
                       "{layers: [blocks.1, ln_f, lm_head], devices: [cuda:1, cuda:0], parallel: tensor}")
    path = write(tmp_path, text)
    (d,) = deep(path)[1]
    assert d.code == "P086" and "beside segment 's0' on its device 'cuda:0'" in d.message
    assert d.loc.line == line_of(path, "parallel: tensor")
    # on devices of its own, beside one-device segments, it runs in lockstep
    assert deep(write(tmp_path, text.replace("[cuda:1, cuda:0]", "[cuda:1, cuda:2]").replace(
        "[cuda:0, cuda:1]", "[cuda:0, cuda:1, cuda:2]")))[1] == []


WHOLE_TENSOR = "  - {layers: [embed, blocks.*, ln_f, lm_head], devices: [cuda:0, cuda:1], parallel: tensor}\n"

LONE = """from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(2))
        self.lm_head = nn.Linear(16, 64)

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)
"""


def whole_tensor(text: str) -> str:
    head, _, _ = text.partition("placement:\n")
    return head + "placement:\n" + WHOLE_TENSOR + "training: {batch_size: 4, steps: 1, optimizer: {op: SGD, lr: 0.1}}\n"


def test_tensor_splits_each_block_of_a_module_model(tmp_path):
    path = write(tmp_path, whole_tensor(GPT))
    assert deep(path)[1] == []
    spec = check.load_spec(path)
    graph = build.build_graph(spec)
    assert [g for l in graph.layers for g in tensor.groups(l)] == [
        (("attn.q", "attn.k", "attn.v"), "attn.proj"), (("mlp.fc",), "mlp.proj")] * 2
    assert ("attn", "n_heads", 2) in graph.layer("blocks.0").heads


def test_tensor_refuses_a_lone_linear_in_a_block(tmp_path):
    path = write(tmp_path, whole_tensor(GPT).replace("tinygpt.py:TinyGPT", "lone.py:Net")
                 .replace("  kwargs: {vocab: 64, d_model: 16, n_layers: 2, seq: 8, n_heads: 2}\n", "")
                 .replace("blocks.*, ln_f, lm_head", "blocks.*, lm_head"), **{"lone.py": LONE})
    (d,) = deep(path)[1]
    assert d.code == "P028" and "Linear blocks.0.fc has no partner" in d.message
    assert d.loc.line == line_of(path, "parallel: tensor")


def test_tensor_refuses_gpt2_conv1d():
    """transformers' Conv1D (GPT-2's c_attn: q, k, v fused, weight [in, out]) is named, with why."""
    hf = os.path.join(os.path.dirname(__file__), "..", "models", "hf_gpt2.yaml")
    r = CliRunner().invoke(main, ["validate", "--deep", hf, "--set", "placement.0.parallel=tensor"])
    assert r.exit_code == 1 and r.output.count("error[") == 1, r.output
    assert "error[P084]: segment 'all': layer 'transformer.h.0' holds Conv1D 'attn.c_attn' (and 3 more)" in r.output
    assert "fuses q, k and v" in r.output


def test_tensor_refuses_heads_the_degree_does_not_divide(tmp_path):
    path = write(tmp_path, whole_tensor(GPT).replace("n_heads: 2", "n_heads: 1"))
    (d,) = deep(path)[1]
    assert d.code == "P085" and "n_heads of blocks.0.attn is 1" in d.message and "2 devices" in d.message


def test_inline_name_clash(tmp_path):
    path = write(tmp_path, INLINE.replace("name: unflat", "name: forward"))
    (d,) = deep(path)[1]
    assert d.code == "M010" and d.loc.line == line_of(path, "name: forward")


def test_build_module_missing_file(tmp_path):
    path = write(tmp_path, GPT)
    spec = check.load_spec(path)
    os.remove(tmp_path / "tinygpt.py")
    with pytest.raises(SpecError) as e:
        build.build_module(spec)
    assert e.value.diagnostics[0].code == "M001"


def test_cli_deep_reports_without_traceback(tmp_path):
    good = write(tmp_path, GPT)
    bad = tmp_path / "bad.yaml"
    bad.write_text(GPT.replace("shape: [B, 8], dtype: int64, high: 64}\n  target",
                               "shape: [B, 8, 2], dtype: int64, high: 64}\n  target"))
    r = CliRunner().invoke(main, ["validate", "--deep", good])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["validate", "--deep", str(bad)])
    assert r.exit_code == 1 and "error[M006]" in r.output and "Traceback" not in r.output


FACTORY = """import tinygpt

def make_gpt(**kwargs):
    return tinygpt.TinyGPT(**kwargs)

def not_a_model(**kwargs):
    return 3
"""


def test_a_factory_function_is_a_model(tmp_path):
    """SPEC.md: `module` names any callable that returns an nn.Module, called with `kwargs`."""
    path = write(tmp_path, GPT.replace("tinygpt.py:TinyGPT", "factory.py:make_gpt"), **{"factory.py": FACTORY})
    assert deep(path)[1] == []
    (d,) = deep(write(tmp_path, GPT.replace("tinygpt.py:TinyGPT", "factory.py:not_a_model"),
                      **{"factory.py": FACTORY}))[1]
    assert d.code == "M004" and "returned a value of type int, not an nn.Module" in d.message


@pytest.mark.parametrize("command", [["plan", "--deep"], ["generate", "-o", "{tmp}/program.py"]])
def test_plan_and_generate_refuse_what_validate_deep_refuses(tmp_path, command):
    text = GPT.replace("{layers: [blocks.1, ln_f, lm_head], device: cuda:1}",
                       "{layers: [blocks.1, ln_f, lm_head], devices: [cuda:1, cuda:0], parallel: tensor}")
    path = write(tmp_path, text)
    validated = CliRunner().invoke(main, ["validate", "--deep", path])
    assert validated.exit_code == 1 and "error[P086]" in validated.output
    out = CliRunner().invoke(main, [c.format(tmp=tmp_path) for c in command] + [path])
    assert out.exit_code == 1, out.output
    assert f"{path}:{line_of(path, 'parallel: tensor')}" in out.output and "error[P086]" in out.output
    assert "plan g:" not in out.output and not (tmp_path / "program.py").exists()


RESNET_STEM = """placer: 1
name: resnet_stem
model:
  module: ../../models/resnet_tv.py:ResNet18
  input: {shape: [B, 3, 32, 32]}
  target: {shape: [B], dtype: int64, high: 10}
  loss: CrossEntropyLoss
devices: [cpu, cpu:1, cpu:2]
placement:
  - {name: stem, layers: [conv1, bn1, relu, maxpool], devices: [cpu, cpu:1], parallel: MODE}
  - {name: body, layers: [layer1, layer2, layer3, layer4, avgpool, fc], device: cpu:2}
training: {batch_size: 4, steps: 2, optimizer: {op: SGD, lr: 0.1}, seed: 0}
"""


def resnet_spec(tmp_path, mode: str, body: str = "") -> str:
    spec = tmp_path / "a" / "b" / "spec.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "models").mkdir(exist_ok=True)
    shutil.copy(os.path.join(os.path.dirname(__file__), "..", "models", "resnet_tv.py"), tmp_path / "models")
    spec.write_text(RESNET_STEM.replace("MODE", mode) + body)
    return str(spec)


def test_channel_runs_a_resnet_stem_as_the_chain_it_is(tmp_path):
    spec = resnet_spec(tmp_path, "channel")
    r = CliRunner().invoke(main, ["validate", "--deep", spec])
    assert r.exit_code == 0, r.output
    program = build_program(spec, tmp_path)
    # in lockstep: the model's forward runs the split chain (conv1's call), the others hand it on
    assert 'nn.Sequential(*(model.get_submodule(name) for name in ["conv1", "bn1", "relu", "maxpool"]))' in program
    assert "ChannelSplit(stage, g0, [0, 1])" in program
    assert 'run_as_chain(model, ["conv1", "bn1", "relu", "maxpool"], seg0)' in program


def build_program(spec: str, tmp_path) -> str:
    out = tmp_path / "program.py"
    r = CliRunner().invoke(main, ["generate", spec, "-o", str(out)])
    assert r.exit_code == 0, r.output
    return " ".join(out.read_text().split()).replace("( ", "(").replace(" )", ")")


def test_channel_refuses_a_module_segment_that_is_not_a_chain(tmp_path):
    """TinyGPT's blocks.0 reads embed's output plus the root's pos (glue): no chain (P087)."""
    text = GPT.replace("{layers: [embed, blocks.0], device: cuda:0}",
                       "{layers: [embed, blocks.0], devices: [cuda:0, cuda:2], parallel: channel}")
    path = write(tmp_path, text.replace("[cuda:0, cuda:1]", "[cuda:0, cuda:1, cuda:2]"))
    found = deep(path)[1]  # and P082: pos, read by that glue, would belong to the split, which drops it
    assert sorted(d.code for d in found) == ["P082", "P087"], found
    d = next(d for d in found if d.code == "P087")
    assert "layer 'blocks.0' reads the parent's glue" in d.message
    assert d.loc.line == line_of(path, "blocks.0], devices")


def test_spatial_and_a_last_channel_segment_of_a_module_model_run_in_lockstep_only(tmp_path):
    """On devices of their own beside one-device segments, the model's forward runs the split
    chain; where that cannot be (a device shared), validate --deep and plan --deep say so (P086)."""
    spec = resnet_spec(tmp_path, "spatial")
    r = CliRunner().invoke(main, ["validate", "--deep", spec])
    assert r.exit_code == 0, r.output
    program = build_program(spec, tmp_path)
    assert "SpatialSplit(stage, g0, [0, 1], dim=2, size=32)" in program
    assert 'run_as_chain(model, ["conv1", "bn1", "relu", "maxpool"], SpatialWhole(seg0))' in program
    text = open(spec).read()
    open(spec, "w").write(text.replace("device: cpu:2}", "device: cpu}"))
    r = CliRunner().invoke(main, ["validate", "--deep", spec])
    assert r.exit_code == 1 and r.output.count("error[P086]") == 1 and "W007" not in r.output, r.output
    assert "mode 'spatial' of a module model beside segment 'body' on its device 'cpu'" in r.output
    assert f"{spec}:{line_of(spec, 'name: stem')}" in r.output
    planned = CliRunner().invoke(main, ["plan", "--deep", spec])
    assert planned.exit_code == 1 and "error[P086]" in planned.output and "plan resnet_stem" not in planned.output
    fine = CliRunner().invoke(main, ["validate", "--deep", spec, "--set", "placement.0.parallel=data"])
    assert fine.exit_code == 0, fine.output  # the torchvision layout's names place as print(model) shows them
    open(spec, "w").write(text)
    text = open(spec).read().replace("devices: [cpu, cpu:1], parallel: spatial", "device: cpu")
    text = text.replace("avgpool, fc], device: cpu:2}", "avgpool], device: cpu:2}\n  - {name: head, layers: fc, "
                        "devices: [cpu, cpu:1], parallel: channel}")
    open(spec, "w").write(text)  # last, on the stem's device: not in lockstep, the model's glue lost
    last = CliRunner().invoke(main, ["validate", "--deep", spec])
    assert last.exit_code == 1 and "error[P086]" in last.output, last.output
    assert "as the last segment beside segment 'stem' on its device 'cpu'" in last.output, last.output
    open(spec, "w").write(text.replace("[cpu, cpu:1], parallel: channel", "[cpu:1, cpu:3], parallel: channel").replace(
        "devices: [cpu, cpu:1, cpu:2]", "devices: [cpu, cpu:1, cpu:2, cpu:3]"))
    fine = CliRunner().invoke(main, ["validate", "--deep", spec])  # on devices of its own: lockstep runs it
    assert fine.exit_code == 0, fine.output


def test_a_split_group_is_refused_beside_replica_pipelines_or_with_replicas_of_its_own(tmp_path):
    """Lockstep runs a split-mode group beside one-device segments (one pipeline, every rank of
    the group on the whole batch), and data segments as replica pipelines (each on its rows):
    not both at once; P086 says so before planning. A 2-D tensor group beside others runs (its
    rows cut where the hidden state arrives, or from the batch as the first segment; FSDP2 x TP too)."""
    four = GPT.replace("devices: [cuda:0, cuda:1]\n", "devices: [cuda:0, cuda:1, cuda:2, cuda:3, cuda:4]\n")
    beside_data = four.replace("{layers: [embed, blocks.0], device: cuda:0}",
                               "{layers: [embed, blocks.0], devices: [cuda:0, cuda:1], parallel: data}").replace(
        "{layers: [blocks.1, ln_f, lm_head], device: cuda:1}",
        "{layers: [blocks.1, ln_f, lm_head], devices: [cuda:2, cuda:3], parallel: tensor}")
    (d,) = deep(write(tmp_path, beside_data))[1]
    assert d.code == "P086" and "beside segment 's0' of mode 'data' over several devices" in d.message, d
    two_d = four.replace("{layers: [blocks.1, ln_f, lm_head], device: cuda:1}",
                         "{layers: [blocks.1, ln_f, lm_head], devices: [cuda:1, cuda:2, cuda:3, cuda:4], "
                         "parallel: {mode: tensor, data: 2}}")
    assert deep(write(tmp_path, two_d))[1] == []
    assert deep(write(tmp_path, two_d.replace("data: 2}", "data: 2, shard: full}")))[1] == []  # FSDP2 x TP too
    first = four.replace("{layers: [embed, blocks.0], device: cuda:0}",
                         "{layers: [embed, blocks.0], devices: [cuda:1, cuda:2, cuda:3, cuda:4], "
                         "parallel: {mode: tensor, data: 2}}").replace(
        "{layers: [blocks.1, ln_f, lm_head], device: cuda:1}", "{layers: [blocks.1, ln_f, lm_head], device: cuda:0}")
    assert deep(write(tmp_path, first))[1] == []  # as the first segment: each rank cuts its rows of the batch
    # the whole model as one 2-D tensor segment runs, under bf16 too (each replica's row sums bfloat16)
    whole = whole_tensor(four).replace("devices: [cuda:0, cuda:1], parallel: tensor",
                                       "devices: [cuda:0, cuda:1, cuda:2, cuda:3], parallel: {mode: tensor, data: 2}")
    whole = whole.replace("devices: [cuda:0, cuda:1, cuda:2, cuda:3, cuda:4]", "devices: [cuda:0, cuda:1, cuda:2, cuda:3]")
    assert deep(write(tmp_path, whole))[1] == []
    bf16 = whole.replace("optimizer: {op: SGD, lr: 0.1}}", "optimizer: {op: SGD, lr: 0.1}, precision: bf16}")
    assert deep(write(tmp_path, bf16))[1] == []
    for shard in ("optimizer", "full"):
        sharded = bf16.replace("data: 2}", f"data: 2, shard: {shard}}}")
        assert sharded != bf16 and deep(write(tmp_path, sharded))[1] == []
