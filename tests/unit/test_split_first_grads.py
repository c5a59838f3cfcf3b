"""run --check's first-step gradients of split parameters: a tensor segment's DTensors and a
channel segment's slices are named for record_first_grads under the whole model's names (gathered
whole, kept on the group's first rank); a spatial segment's replicas are recorded once, as whole
parameters, by the group's first rank. The gradient sums themselves are checked by the
distributed runs (tests/distributed: assert_every_gradient_compared)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from placer.codegen.program import generate
from placer.codegen.runtime.channel import ChannelSplit, channel_grads
from placer.spec.check import load_spec

ROOT = Path(__file__).resolve().parents[2]


def lines_of(spec: str, tmp_path) -> list[str]:
    return generate(load_spec(str(ROOT / spec)), out_dir=str(tmp_path)).text.splitlines()


def dtensors(k: int, first: int) -> str:
    return f"WHOLE_GRADS.update({{n: (p, rank == {first}) for n, p in named_params(seg{k}, model).items()}})"


def slices(k: int, first: int) -> str:
    return f"WHOLE_GRADS.update(channel_grads(seg{k}, named_params(full{k}, model), rank == {first}))"


@pytest.mark.parametrize("spec, recorded", [
    ("specs/mlp_tensor.yaml", [dtensors(0, 0)]),  # tensor pairs, then a one-device head
    ("specs/cnn_channel.yaml", [slices(0, 0)]),  # channel-split convs, then a one-device classifier
    ("specs/mlp_tensor_data.yaml", [dtensors(1, 0)]),  # tensor x data: the first replica's first rank
    ("tests/models/tinygpt_tensor.yaml", [dtensors(0, 0)]),  # a module model's block plan
    ("specs/mlp_pipeline_tensor_stages.yaml", [slices(0, 0), dtensors(1, 2), slices(2, 0), dtensors(3, 2)]),
    ("specs/cnn_spatial.yaml", []),  # whole parameters on each rank: through `own`, on the first rank
])
def test_split_segments_name_their_parameters_for_the_first_step_gradients(spec, recorded, tmp_path):
    lines = [line.strip() for line in lines_of(spec, tmp_path)]
    whole = [line.split("  #")[0] for line in lines if line.startswith("WHOLE_GRADS.update(")]
    assert whole == recorded
    assert "record_first_grads(own)" in lines
    if not recorded:  # each spatial rank holds its segment whole: the first one records it
        assert lines.count("own.update(named_params(stage, model))") == 2


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_channel_split_names_every_parameter_and_joins_its_slices_gradient(one_rank):
    """channel_grads maps each model name (a tied one under both) to the parameter this rank trains:
    a split layer's slice, whose gradient `whole` joins; a layer that runs whole, which needs none.
    The joined gradients are the one-device gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.LayerNorm(6), nn.Linear(6, 3))
    reference = copy.deepcopy(model)
    split = ChannelSplit(model, dist.group.WORLD, [0])
    named = dict(model.named_parameters())
    named["tied"] = model[2].weight  # a second name of one parameter
    entries = channel_grads(split, named, True)
    assert set(entries) == set(named)
    for name, (mine, keep, whole) in entries.items():
        runs_whole = name.startswith("2.") or name == "tied"
        assert keep and (mine is named[name]) == runs_whole and (whole is None) == runs_whole, name
    x = torch.randn(5, 4)
    split(x).square().sum().backward()
    reference(x).square().sum().backward()
    for name, (mine, _, whole) in entries.items():
        got = whole(mine.grad) if whole else mine.grad
        want = reference.get_parameter("2.weight" if name == "tied" else name).grad
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_a_gradient_zero_by_construction_is_compared_at_the_models_gradient_scale(tmp_path):
    """Attention's key bias gets a gradient the softmax cancels: rounding only, differing between a
    tensor-parallel bf16 run and its reference by more than its own scale. It passes within rtol of
    the model's largest gradient; a halved gradient of any size still fails."""
    from placer.launch.check import BF16_ATOL, BF16_RTOL, CheckReport, _compare_grads

    ref = {"k.bias": torch.full((4,), 1.9e-5), "w": torch.full((4, 4), 0.1), "small": torch.full((4,), 1e-3)}
    torch.save(ref, tmp_path / "ref.pt")

    def bad(run):
        torch.save(run, tmp_path / "run.pt")
        report = CheckReport(ok=True, rtol=BF16_RTOL, atol=BF16_ATOL)
        _compare_grads(report, tmp_path / "run.pt", tmp_path / "ref.pt")
        return [g[0] for g in report.grads if not g[4]]

    assert bad({**ref, "k.bias": ref["k.bias"] - 1.14e-5}) == []  # the measured bf16 gap (tinygpt_tensor)
    assert bad({**ref, "small": ref["small"] / 2}) == ["small"]
    assert bad({**ref, "w": ref["w"] / 2}) == ["w"]
