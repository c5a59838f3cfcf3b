"""A `channel` or `spatial` segment as the only one of a module model (tests/models/glue_net.py,
whose forward does glue before its first layer and after its last): it runs in lockstep, every
rank running the model's own forward, whose first placed layer's call runs the split chain, so the
glue after it runs on the whole output the group gathers on each rank. The plan counts that
gather; a parameter of the parent's that the glue after the chain reads is refused (P082), as the
split holds the chain's layers alone."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from placer import api
from placer.cli.main import main
from placer.plan import crossings
from placer.plan.ir import OpKind, PlacedSegment

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "tests" / "models" / "glue_spatial_alone.yaml"
MODES = {"spatial": "{mode: spatial, dim: H}", "channel": "channel"}


def _spec(tmp_path, mode: str, model: str | None = None) -> Path:
    """glue_spatial_alone.yaml with its one segment in `mode` (and `model`: glue_net.py's source)."""
    (tmp_path / "glue_net.py").write_text(model or (SPEC.parent / "glue_net.py").read_text())
    spec = tmp_path / f"{mode}.yaml"
    spec.write_text(SPEC.read_text().replace("{mode: spatial, dim: H}", MODES[mode]))
    return spec


@pytest.mark.parametrize("mode", ["spatial", "channel"])
def test_a_chain_group_alone_is_validated_and_runs_inside_the_models_forward(tmp_path, mode):
    spec = _spec(tmp_path, mode)
    r = CliRunner().invoke(main, ["validate", str(spec)])
    assert r.exit_code == 0 and "W007" not in r.output, r.output
    r = CliRunner().invoke(main, ["validate", "--deep", str(spec)])
    assert r.exit_code == 0 and "P086" not in r.output, r.output
    flat = "".join(api.generate(api.load(spec)).split())
    chain = "SpatialWhole(seg0)" if mode == "spatial" else "seg0"
    assert f'run_as_chain(model,["conv1","relu1","conv2","relu2"],{chain})' in flat
    assert "crossing=Lockstep(" in flat and "groups=GROUPS" in flat


def test_the_plan_gathers_the_chains_output_whole_on_each_rank(tmp_path):
    """The model's glue reads the whole output on every rank: spatial gathers the bands after the
    last layer (as lockstep's SpatialWhole does), channel the channels (as ChannelSplit does), and
    channel sums conv2's input gradient (conv1's input, the image, takes none)."""
    out = 4 * 8 * 8 * 8 * 4  # relu2's output: batch 4, 8 channels, 8 x 8, float32
    for mode, want in (("spatial", [("fwd", "relu2", 2, out)]),
                       ("channel", [("fwd", "conv2", 1, out), ("fwd", "relu2", 1, out)])):
        plan = api.plan(_spec(tmp_path, mode)).plan
        gathers = sorted((op.phase, op.attrs["layer"], op.dim, op.bytes) for op in plan.unique_ops()
                         if op.kind == OpKind.ALL_GATHER)
        assert gathers == want, mode
    sums = [(op.tensor, op.attrs["layer"]) for op in plan.unique_ops() if op.kind == OpKind.ALL_REDUCE]
    assert sums == [("grad", "conv2")]


def test_lockstep_takes_a_chain_group_alone_not_a_tensor_segment_alone():
    """A tensor segment alone keeps its own path (its modules split in place, no lockstep)."""
    spec = SimpleNamespace(model=SimpleNamespace(inline=False))
    for mode, alone in (("channel", True), ("spatial", True), ("tensor", False), ("data", False)):
        seg = PlacedSegment(index=0, name="all", layers=("conv1",), devices=("cpu", "cpu:1"), mode=mode)
        assert crossings.lockstep(spec, [seg]) == alone, mode
    one = PlacedSegment(index=0, name="all", layers=("conv1",), devices=("cpu",), mode="none")
    assert not crossings.lockstep(spec, [one])


def test_a_parameter_the_glue_after_the_chain_reads_is_refused(tmp_path):
    """The split holds the chain's layers only: the parent's `scale`, read after the last layer,
    would never train (run --check: 'parameters missing from the run'); P082 says so."""
    model = (SPEC.parent / "glue_net.py").read_text()
    model = model.replace("        self.relu2 = nn.ReLU()\n",
                          "        self.relu2 = nn.ReLU()\n        self.scale = nn.Parameter(torch.ones(width))\n")
    model = model.replace("return x.mean((2, 3))", "return x.mean((2, 3)) * self.scale")
    model = model.replace("from torch import nn", "import torch\nfrom torch import nn")
    for mode in ("spatial", "channel"):
        r = CliRunner().invoke(main, ["validate", "--deep", str(_spec(tmp_path, mode, model))])
        assert r.exit_code == 1 and "error[P082]: parameter 'scale' belongs to no placed layer, and segment 'all' " \
            f"(mode {mode!r}) runs as a split of its layers alone" in r.output, r.output
    # beside a one-device segment too (lockstep alike): the group holds conv2, relu2 and the glue's `scale`
    beside = _spec(tmp_path, "spatial", model).read_text().replace("devices: [cpu, cpu:1]\n", "devices: [cpu, cpu:1, cpu:2]\n")
    beside = beside.replace("  - {name: all, layers: [conv1, relu1, conv2, relu2], devices",
                            "  - {name: first, layers: [conv1, relu1], device: cpu:2}\n  - {name: all, layers: [conv2, relu2], devices")
    (tmp_path / "beside.yaml").write_text(beside)
    r = CliRunner().invoke(main, ["validate", "--deep", str(tmp_path / "beside.yaml")])
    assert r.exit_code == 1 and "error[P082]: parameter 'scale'" in r.output and "segment 'all'" in r.output, r.output
