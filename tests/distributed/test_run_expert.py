"""`parallel: {mode: expert}` on Hugging Face's MoE models (tests/models/hf_moe.yaml: Mixtral,
Qwen2-MoE with a shared expert, a DeepSeek-V3-style config with a dense first layer): each
rank holds E / G experts of every MoE layer, tokens go to their experts' ranks and back by
all-to-all, the rest is data parallel. `run --check` matches the one-device reference (the
expert slices gathered whole): alone, with `shard: full` and clip_grad_norm, with accumulate
under bf16, and as a stage of a 1F1B pipeline beside a data stage.

Bytes: a rank hands torch its whole dispatch buffer (its tokens x top k rows) whatever the
routing, but the combine's input and the dispatch's gradient are the rows its experts
received: each rank's bytes differ from the plan's (uniform routing) by its imbalance, and the
group's sum equals the plan's exactly (every row sent is received once); other devices send
exactly what the plan says."""
from __future__ import annotations

from pathlib import Path

import pytest

try:
    from . import _harness as h
except ImportError:  # run as a top-level module
    import _harness as h

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

SPEC = Path(__file__).resolve().parents[1] / "models" / "hf_moe.yaml"
ALONE = ("placement=[{name: all, layers: [model, lm_head], devices: [cpu:0, cpu:1], parallel: expert}]",)
STAGE = ("devices=[cpu:0, cpu:1, cpu:2, cpu:3]",
         "placement=[{name: front, layers: [model.embed_tokens, model.rotary_emb, model.layers.0], devices: [cpu:0, "
         "cpu:1], parallel: data}, {name: back, layers: [model.layers.1, model.norm, lm_head], devices: [cpu:2, "
         "cpu:3], parallel: expert}]",
         "pipeline={microbatches: 2, schedule: 1f1b}")
# FSDP2 on the dense parameters; the global norm counts each rank's experts and dense shards
SHARD_CLIP = (ALONE[0].replace("parallel: expert", "parallel: {mode: expert, shard: full}"),
              "training.clip_grad_norm=0.01")
ACCUMULATE_BF16 = (*ALONE, "training.accumulate=2", "training.precision=bf16")  # each micro-step's, under autocast
RUNS = [("mixtral", ALONE), ("qwen2_moe", SHARD_CLIP), ("deepseek_v3", ACCUMULATE_BF16), ("mixtral", STAGE)]
IDS = ["mixtral-alone", "qwen2_moe-shard-clip", "deepseek_v3-accumulate-bf16", "mixtral-stage"]


@pytest.mark.parametrize("family,sets", RUNS, ids=IDS)
def test_expert_parallel_matches_one_device(family, sets, tmp_path):
    sets = (f"model.kwargs.family={family}", *sets)
    bf16 = "training.precision=bf16" in sets  # run --check's stated tolerance for it
    checked = h.checked_run(SPEC, tmp_path / "run", *(a for s in sets for a in ("--set", s)),
                            rtol=2e-2 if bf16 else h.RTOL, atol=2e-3 if bf16 else h.ATOL)
    spec_part = checked.program.split("# Below: placer's runtime")[0]
    assert "expert_parallelize(" in spec_part and "all_to_all" not in spec_part  # it calls the piece, which sends
    # each device of the expert group sends what its routing makes it; the group's sum is the plan's
    h.assert_sends_what_the_plan_says(f"expert-{family}", SPEC, checked.metrics, sets)
