"""What FSDP2 shards one by one (`fsdp_units`, pasted into programs with `shard: full`): every
block of a ModuleList/ModuleDict and every other child with parameters, never a bare container,
each parameter in at most one unit; as torch's recipes do (one fully_shard per block, then the root)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from placer.codegen.program import generate
from placer.codegen.runtime.sharding import fsdp_units
from placer.spec.check import load_spec

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "specs" / "models"), str(ROOT / "tests" / "models")]

from hf_tiny import Wrapped, make_gpt2, make_llama  # noqa: E402
from tinygpt import TinyGPT  # noqa: E402


def units_of(model: nn.Module) -> list[str]:
    units = fsdp_units(model)
    assert all(model.get_submodule(path) is unit for path, unit in units)
    assert not any(isinstance(unit, (nn.ModuleList, nn.ModuleDict)) for _, unit in units)
    held = [id(p) for _, unit in units for p in unit.parameters()]
    assert len(held) == len(set(held))  # no parameter in two units
    return [path for path, _ in units]


def test_tinygpt_gets_a_unit_per_block():
    with torch.device("meta"):
        model = TinyGPT(vocab=64, d_model=16, n_layers=3, seq=8, n_heads=2)
    # `pos` is the root's own parameter: the final fully_shard(root) holds it
    assert units_of(model) == ["embed", "blocks.0", "blocks.1", "blocks.2", "ln_f", "lm_head"]


def test_hugging_face_models_get_a_unit_per_decoder_layer():
    with torch.device("meta"):
        gpt2, llama = make_gpt2(n_layers=2), make_llama(n_layers=2)
    assert units_of(gpt2) == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                              "transformer.ln_f", "lm_head"]
    assert units_of(llama) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]


def test_a_wrapper_is_opened_and_a_model_without_containers_shards_its_children():
    with torch.device("meta"):
        wrapped = Wrapped(n_layers=2)
    assert units_of(wrapped) == ["net.embed", "net.blocks.0", "net.blocks.1", "net.head"]
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert units_of(mlp) == ["0", "2"]
    blocks = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.ReLU()})
    assert units_of(nn.ModuleDict({"blocks": blocks})) == ["blocks.a"]


def test_tied_embeddings_stay_with_the_root():
    """GPT-2 as it ships: lm_head.weight IS wte.weight. fully_shard refuses one parameter in two
    units, so neither user gets a unit: the root's fully_shard shards it once."""
    with torch.device("meta"):
        gpt2 = make_gpt2(n_layers=2, tied=True)
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert units_of(gpt2) == ["transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f"]


@pytest.mark.parametrize("spec, owners", [("specs/mlp_data_shard_full.yaml", {0: 0}),
                                          ("tests/models/tinygpt_fsdp_tp.yaml", {0: 0})])
def test_fsdp2_programs_gather_each_first_step_gradient_whole_for_the_check(spec, owners, tmp_path):
    """Each FSDP2 (x TP) segment's parameters are shards: the program names them for record_first_grads,
    which gathers each gradient whole (every rank of the group) and keeps it on the group's first rank."""
    text = "".join(generate(load_spec(str(ROOT / spec)), out_dir=str(tmp_path)).text.split())
    for k, first in owners.items():
        assert f"WHOLE_GRADS.update({{n:(p,rank=={first})forn,pinnamed_params(seg{k},model).items()}})" in text
    assert "how(p.grad)ifhowelsep.grad" in text and "returnt.full_tensor()" in text and "withuncounted():" in text
