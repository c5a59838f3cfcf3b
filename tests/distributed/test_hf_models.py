"""Real models, placed as users write them: Hugging Face GPT-2 and Llama (tiny configs built in
tests/models/hf_tiny.py, random init, no download) named by their `named_modules()` paths, the
loss on the ModelOutput's `logits`, one segment over two gloo ranks as DDP, ZeRO-1 and FSDP2;
the shipped TinyGPT fully sharded (one fully_shard per block); TinyGPT and Llama tensor
parallel (a DTensor plan per block); a ResNet-18's stem split by channels; and a wrapper model
whose nested layers are placed layer-wise. Each `placer run --check` matches the one-device
reference (rtol 1e-5, atol 4e-5 on every parameter), and each device sends what its plan says."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from placer.cli.main import main

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

pytestmark = pytest.mark.distributed

MODELS = Path(__file__).resolve().parents[1] / "models"

# (spec under tests/models, shard option or None to keep the spec's, what it shows); GPT-2 under
# ZeRO-1 and FSDP2 as it ships, tied (a unit per transformer.h block there too)
RUNS = [
    ("hf_gpt2", "none", "GPT-2 (Conv1D, ModelOutput) under DDP"),
    ("hf_gpt2_tied", "none", "GPT-2 as it ships, lm_head.weight IS wte.weight, under DDP"),
    ("hf_gpt2_tied", "optimizer", "tied GPT-2 with ZeRO-1"),
    ("hf_gpt2_tied", "full", "tied GPT-2 with FSDP2: wte and lm_head left to the root unit"),
    ("hf_llama", "none", "Llama (rotary, grouped-query attention) under DDP"),
    ("hf_llama", "optimizer", "Llama with ZeRO-1"),
    ("hf_llama", "full", "Llama with FSDP2: a unit per model.layers block"),
    ("tinygpt_fsdp", None, "the shipped TinyGPT (a ModuleList of blocks) with FSDP2"),
    ("nested_layerwise", None, "nested names (net.blocks.2..) cut layer-wise over two ranks"),
    ("tinygpt_tensor", None, "the shipped TinyGPT tensor parallel: q, k, v and fc by columns, proj by rows"),
    ("hf_llama_tensor", None, "Llama tensor parallel: 4 heads and 2 kv heads split over 2 ranks"),
    ("hf_bert_tensor", None, "BERT tensor parallel: attention.self's q, k, v with attention.output's dense"),
    ("resnet_stem_channel", None, "a torchvision-layout ResNet-18's stem split by channels over 2 ranks"),
]


@pytest.mark.parametrize("name,shard,what", RUNS, ids=[f"{n}-{s}" if s else n for n, s, _ in RUNS])
def test_real_model_matches_the_one_device_reference(name, shard, what, tmp_path):
    tied = name.endswith("_tied")  # the same spec, GPT2Config(tie_word_embeddings=True)
    spec, run_dir = MODELS / f"{name.removesuffix('_tied')}.yaml", tmp_path / "run"
    sets = [f"placement.0.parallel.shard={shard}"] if shard else []
    sets += ["model.kwargs.tied=true"] if tied else []
    _, run_p, metrics, _ = h.checked_run(spec, run_dir, *(a for s in sets for a in ("--set", s)))
    if shard == "full" or name in ("tinygpt_fsdp", "tinygpt_tensor", "hf_llama_tensor", "hf_bert_tensor",
                                   "resnet_stem_channel"):
        # FSDP2's and tensor parallel's gathered whole from the DTensors, a channel split's slices joined
        h.assert_every_gradient_compared(run_dir)
    if tied:  # both names compared, and one value
        assert json.loads((run_dir / "check.json").read_text())["tied"] == [["transformer.wte.weight",
                                                                             "lm_head.weight"]]
        torch.testing.assert_close(run_p["lm_head.weight"], run_p["transformer.wte.weight"], rtol=0, atol=0)
    # ZeRO partitions whole parameters, the plan counts even shares; FSDP2 pads a parameter's dim 0
    # to a multiple of the group (TinyGPT's pos is [1, seq, d]), the plan counts unpadded halves
    slack = {"optimizer": 0.01, None: 0.02 if name == "tinygpt_fsdp" else 0}.get(shard, 0)
    h.assert_sends_what_the_plan_says(name, spec, metrics, sets, slack=slack)


def test_tensor_refuses_kv_heads_the_degree_does_not_divide():
    """Grouped-query attention: each rank runs 1/d of the kv heads too (1 kv head over 2 ranks: P085)."""
    result = CliRunner().invoke(main, ["validate", "--deep", str(MODELS / "hf_llama_tensor.yaml"),
                                       "--set", "model.kwargs.n_kv_heads=1"])
    assert result.exit_code == 1 and "error[P085]" in result.output, result.output
    assert "config.num_key_value_heads of model.layers.0.self_attn is 1, not divisible by the 2 devices" in result.output


# a parent named whole in a segment: the plan must be the run's however the layers are spelled
PARENT = {"tensor": ("placement.0.parallel=tensor",), "data": ("placement.0.parallel={mode: data}",),
          "fsdp2": ("placement.0.parallel={mode: data, shard: full}",)}


@pytest.mark.parametrize("mode", PARENT)
def test_a_parent_placed_whole_sends_what_its_plan_says(mode, tmp_path):
    """Llama with `layers: [model, lm_head]`: `model` holds the embedding and both blocks. Its
    tensor plan had counted 8 KiB a step from the token ids' shape and no backward all-reduces
    (nothing before `model` trains), while the run sent 448 KiB: each Linear's all-reduces are now
    sized from its own traced input, and a column whose input trains before it (the embedding
    inside `model`) all-reduces its input gradient."""
    spec = MODELS / "hf_llama_tensor.yaml"
    sets = ("placement.0.layers=[model, lm_head]", *PARENT[mode])
    _, _, metrics, _ = h.checked_run(spec, tmp_path / "run", *(a for s in sets for a in ("--set", s)))
    h.assert_sends_what_the_plan_says(f"parent-{mode}", spec, metrics, sets)
