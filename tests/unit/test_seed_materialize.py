"""A rank holds only what it owns (codegen/runtime/seed.py): the seed file holds the whole model's
values once, and a rank materialises only its segments' modules from it, bit-identical to
building the model from the seed."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from placer.api import generate  # noqa: E402
from placer.codegen.runtime.seed import materialize, seed_tensors  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Tied(nn.Module):
    """Two Linears sharing one weight, and a non-persistent buffer (as rotary tables are)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.c = nn.Linear(8, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("table", torch.arange(6.0) * 0.5, persistent=False)


def build():
    torch.manual_seed(3)
    return Tied()


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_rank_materialises_only_its_segment_with_the_seed_values(tmp_path, one_rank):
    seed = seed_tensors(build, str(tmp_path))
    assert not list(tmp_path.glob("seed-*.pt"))  # mapped, then removed
    with torch.device("meta"):
        model = build()
    stage = materialize(nn.Sequential(model.a, model.b, model.norm), model, seed, torch.device("cpu"))
    whole = build()
    # the segment's tensors hold the seed values exactly, the tie stays one parameter
    assert model.a.weight is model.b.weight and isinstance(model.a.weight, nn.Parameter)
    assert model.a.weight.requires_grad
    assert len(list(stage.parameters())) == 5  # a.weight, a.bias, b.bias, norm's two
    assert torch.equal(model.a.weight, whole.a.weight) and torch.equal(model.b.bias, whole.b.bias)
    assert torch.equal(model.norm.running_var, whole.norm.running_var)
    assert model.norm.num_batches_tracked.dtype == torch.int64
    # what the rank does not own stays on the meta device: no memory
    assert model.c.weight.is_meta and model.table.is_meta
    materialize(model, model, seed, torch.device("cpu"))
    assert torch.equal(model.table, whole.table)  # non-persistent buffers are in the seed too
    assert torch.equal(model.c.weight, whole.c.weight)


def test_the_program_builds_on_meta_and_materialises_each_segment(tmp_path):
    out = tmp_path / "program.py"
    generate(os.path.join(REPO, "specs/mlp_layerwise_direct.yaml"), str(out))
    text = out.read_text()
    assert 'with torch.device("meta"):\n        model = build_model()' in text
    assert "materialize(stage_0_" in text and "(model).to(device)" not in text
    assert "del seed" in text
