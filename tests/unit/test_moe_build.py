"""Mixture-of-experts models build on the meta device (torch's grouped-matmul meta kernel takes
bfloat16 only: M006 before), their layers say how many experts and the top k, and the plan counts
the experts each token visits: FLOPs grow by exactly one expert's work per token for each k."""
from __future__ import annotations

from pathlib import Path

import pytest

from placer import api

pytest.importorskip("transformers")
SPEC = str(Path(__file__).resolve().parents[1] / "models" / "hf_moe.yaml")
TOKENS, D = 4 * 8, 32  # batch x positions, d_model of tests/models/hf_moe.yaml


@pytest.mark.parametrize("family,sparse", [("mixtral", 2), ("qwen2_moe", 2), ("deepseek_v3", 1)])
def test_each_family_builds_and_names_its_experts(family, sparse):
    report = api.plan(SPEC, overrides=[f"model.kwargs.family={family}"])
    found = [(l.name, l.experts) for l in report.graph.layers if l.experts]
    assert [e for _, e in found] == [(("mlp.experts", 4, 2),)] * sparse  # DeepSeek's first layer is dense
    assert any("mixture of experts" in n and "4 experts, top 2" in n for n in report.estimate.notes)


def test_flops_count_top_k_experts_per_token():
    def flops(k):
        report = api.plan(SPEC, overrides=[f"model.kwargs.top_k={k}"])
        return sum(d.flops for d in report.estimate.per_device.values())

    # an expert: gate_up [2 * 64, 32] and down [32, 64]; forward and backward 3x its 2 * rows * weights
    expert = 3 * 2 * TOKENS * (2 * 2 * D * D + 2 * D * D)
    assert flops(2) - flops(1) == 2 * expert  # one more expert per token, in each of 2 layers
    assert flops(4) - flops(2) == 2 * 2 * expert
