"""A lockstep rank holds what it owns (issue 15 item 4): every rank runs the parent's forward, but
builds the model on the meta device and materialises only its own segments and the parent's glue
(runtime/seed.py `materialize_rest`); the layers of other segments stay on meta. The plan counts
the glue each rank holds beyond its segments (the parent's root parameters and buffers)."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from placer.api import generate, plan  # noqa: E402
from placer.codegen.runtime.lockstep import segment_module  # noqa: E402
from placer.codegen.runtime.seed import materialize, materialize_rest, seed_tensors  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Glued(nn.Module):
    """Two placed layers; a parent's own parameter (`pos`, owned by a's segment) and a parent's
    buffer that the forward's glue reads on every rank."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.pos = nn.Parameter(torch.randn(4))
        self.register_buffer("scale", torch.rand(4), persistent=False)

    def forward(self, x):
        return self.b(self.a(x + self.pos) * self.scale)


def build():
    torch.manual_seed(5)
    return Glued()


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_lockstep_rank_holds_its_segment_and_the_glue_and_not_the_other_layers(tmp_path, one_rank):
    seed = seed_tensors(build, str(tmp_path))
    with torch.device("meta"):
        model = build()
    whole = build()
    stage = materialize(segment_module(model, ["a", "pos"]), model, seed, torch.device("cpu"))
    # the parent's own parameter is one tensor: the one the segment's optimizer steps is the
    # one the parent's forward reads
    assert model.pos is stage.pos and not model.pos.is_meta
    materialize_rest(model, seed, torch.device("cpu"), {"a": (0,), "b": (1,)}, (stage, None))
    assert model.b.weight.is_meta and model.b.bias.is_meta  # another rank's layer: a stand-in runs it
    assert model.a.weight is stage.a.weight and model.pos is stage.pos  # not made again
    assert torch.equal(model.scale, whole.scale)  # a non-persistent buffer of the glue: its seed value
    assert torch.equal(model.a.weight, whole.a.weight) and torch.equal(model.pos, whole.pos)
    # the other rank: its segment (b), and the parent's glue, pos included (read, never stepped)
    with torch.device("meta"):
        other = build()
    stage_b = materialize(segment_module(other, ["b"]), other, seed, torch.device("cpu"))
    materialize_rest(other, seed, torch.device("cpu"), {"a": (0,), "b": (1,)}, (None, stage_b))
    assert other.a.weight.is_meta and torch.equal(other.pos, whole.pos)
    assert torch.equal(other.b.weight, whole.b.weight) and torch.equal(other.scale, whole.scale)


def test_the_lockstep_program_builds_on_meta_and_materialises_its_segments_and_the_glue(tmp_path):
    out = tmp_path / "program.py"
    generate(os.path.join(REPO, "specs/tinygpt.yaml"), str(out))
    text = out.read_text()
    text = text[text.index("def train("):text.index("# Below: placer's runtime")]  # (the reference builds it whole)
    assert "Lockstep(model" in text
    assert "build_model().to(device)" not in text
    assert 'with torch.device("meta"):\n        model = build_model()' in text
    assert "stage = materialize(stage_0_front(model), model, seed, device)" in text
    assert "materialize_rest(model, seed, device, LAYERS, (seg0, seg1, seg2))" in text
    assert text.index("materialize_rest(") < text.index("del seed") < text.index("Lockstep(model")


def test_the_plan_counts_the_glue_each_lockstep_rank_holds():
    devices = {d["device"]: d for d in plan(os.path.join(REPO, "specs/tinygpt.yaml")).as_dict()["devices"]}
    pos = 64 * 64 * 4  # TinyGPT's pos [1, seq, d_model]: segment 0's, read by every rank's forward
    assert devices["cuda:0"]["buffer_bytes"] == 0  # counted once there, as its own parameter
    assert devices["cuda:1"]["buffer_bytes"] == pos and devices["cuda:2"]["buffer_bytes"] == pos
