"""`parallel: {mode: expert}`: the schema takes it without options, the plan lists each mixture
of experts' all-to-alls with their bytes under uniform routing and all-reduces the dense
gradients only, each device holds E / G experts, the diagram says which, and what expert
parallelism cannot run is refused before any worker starts (P110-P113)."""
from __future__ import annotations

from pathlib import Path

import pytest

from placer import api
from placer.diagnostics import PlacerError
from placer.plan.ir import OpKind

SPEC = str(Path(__file__).resolve().parents[1] / "models" / "hf_moe.yaml")
EXPERT = "placement=[{name: all, layers: [model, lm_head], devices: [cpu:0, cpu:1], parallel: expert}]"
TOKENS, D, E, K = 4 * 8, 32, 4, 2  # batch x positions, d_model, experts, top k of tests/models/hf_moe.yaml


def errors(spec: str, *sets: str) -> list:
    from placer.model.build import deep_check
    from placer.spec.check import load_spec

    try:
        diags = deep_check(load_spec(spec, overrides=list(sets)))
    except PlacerError as e:
        diags = e.diagnostics
    return [d for d in diags if d.severity == "error"]


def test_the_schema_takes_mode_expert_without_options(tmp_path):
    from placer.spec.check import load_spec

    text = Path(SPEC).read_text()
    spec = load_spec(SPEC, overrides=[EXPERT])
    assert spec.placement[0].parallel.mode == "expert"
    bad = tmp_path / "spec.yaml"
    bad.write_text(text.replace("device: cpu:0}", "devices: [cpu:0, cpu:1], parallel: {mode: expert, sync: broadcast}}"))
    with pytest.raises(PlacerError) as e:
        load_spec(str(bad))
    assert e.value.diagnostics[0].code.startswith("S")


@pytest.mark.parametrize("family,sparse", [("mixtral", 2), ("qwen2_moe", 2), ("deepseek_v3", 1)])
def test_the_plan_lists_each_moes_all_to_alls_under_uniform_routing(family, sparse):
    pytest.importorskip("transformers")
    report = api.plan(SPEC, overrides=[f"model.kwargs.family={family}", EXPERT])
    ops = [op for op in report.plan.unique_ops() if op.kind == OpKind.ALL_TO_ALL]
    rows = TOKENS // 2 * K * D * 4  # a device's (token, expert) rows, float32
    assert sorted((op.phase, op.tensor, op.bytes) for op in ops) == sorted(
        [("fwd", "counts", 8 * E)] * sparse + [("fwd", "act", rows)] * 2 * sparse + [("bwd", "grad", rows)] * 2 * sparse)
    assert all(op.devices == ("cpu:0", "cpu:1") for op in ops)
    # the dense gradients are all-reduced, the experts' not: each device holds half of them
    g = report.graph
    experts = sum(n for l in g.layers for _, _, n, _, _ in l.expert_weights)
    total = sum(l.params for l in g.layers) + sum(r.numel for r in g.root_params if r.trainable)
    (sync,) = [op for op in report.plan.unique_ops() if op.kind == OpKind.ALL_REDUCE]
    assert sync.bytes == 4 * (total - experts)
    assert report.estimate.per_device["cpu:0"].params == total - experts // 2
    assert any("uniform routing" in n for n in report.estimate.notes)


def test_the_diagram_shows_which_experts_live_where():
    pytest.importorskip("transformers")
    from placer.render.dot import placement_dot

    report = api.plan(SPEC, overrides=[EXPERT])
    src = placement_dot(report.plan, report.graph, report.estimate)
    assert "cpu:0: experts 0..1, cpu:1: experts 2..3" in src and "all-to-all" in src


def test_the_program_cuts_the_experts_and_sums_the_dense_gradients(tmp_path):
    pytest.importorskip("transformers")
    text = api.generate(SPEC, str(tmp_path / "program.py"), overrides=[EXPERT])
    spec_part = " ".join(text.split("# Below: placer's runtime")[0].split())  # (lines the formatter wrapped, joined)
    assert "expert_parallelize( model, [\"model.layers.0.mlp.experts\", \"model.layers.1.mlp.experts\"], g0 )" in spec_part
    assert "expert_sync(" in spec_part and "ddp_sum(" not in spec_part
    compile(text, "program.py", "exec")


def test_a_group_that_does_not_divide_the_experts_is_refused():
    pytest.importorskip("transformers")
    three = "placement=[{name: all, layers: [model, lm_head], devices: [cpu:0, cpu:1, cpu:2], parallel: expert}]"
    (d,) = errors(SPEC, "devices=[cpu:0, cpu:1, cpu:2]", "training.batch_size=6", three)
    assert d.code == "P111" and "4 experts, not divisible by the 3 devices" in d.message and "(2, 4)" in d.hint


def test_a_segment_without_experts_is_refused():
    pytest.importorskip("transformers")
    # DeepSeek-V3's first layer is dense
    front = ("placement=[{name: front, layers: [model.embed_tokens, model.rotary_emb, model.layers.0], devices: "
             "[cpu:0, cpu:1], parallel: expert}, {name: back, layers: [model.layers.1, model.norm, lm_head], "
             "devices: [cpu:2, cpu:3], parallel: data}]")
    (d,) = errors(SPEC, "model.kwargs.family=deepseek_v3", "devices=[cpu:0, cpu:1, cpu:2, cpu:3]", front)
    assert d.code == "P110" and "'front'" in d.message


def test_an_inline_segment_under_expert_is_refused(tmp_path):
    from placer.spec.check import load_spec

    spec = tmp_path / "spec.yaml"
    spec.write_text("placer: 1\nname: inline\nmodel:\n  layers:\n    - {name: fc, op: Linear, args: [4, 4]}\n"
                    "  input: {shape: [B, 4]}\n  target: {shape: [B, 4]}\n  loss: MSELoss\n"
                    "devices: [cpu:0, cpu:1]\nplacement:\n  - {layers: fc, devices: [cpu:0, cpu:1], parallel: expert}\n"
                    "training: {batch_size: 4, steps: 1, optimizer: {op: SGD, lr: 0.1}}\n")
    with pytest.raises(PlacerError) as e:
        load_spec(str(spec))
    assert e.value.diagnostics[0].code == "P110"
    assert str(e.value.diagnostics[0].loc) == f"{spec}:11:53"  # the segment's `parallel`


def test_a_router_that_adds_noise_is_refused():
    pytest.importorskip("transformers")
    (d,) = errors(SPEC, "model.kwargs.jitter=0.01", EXPERT)
    assert d.code == "P113" and "jitter 0.01" in d.message


MODULE_LIST = '''
import torch
from torch import nn


class MoE(nn.Module):
    def __init__(self, d=8, n=2):
        super().__init__()
        self.gate = nn.Linear(d, n)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        w = self.gate(x).softmax(-1)
        return sum(w[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = MoE()

    def forward(self, x):
        return self.moe(x)
'''


def test_experts_in_a_module_list_are_refused(tmp_path):
    (tmp_path / "net.py").write_text(MODULE_LIST)
    (tmp_path / "spec.yaml").write_text(
        "placer: 1\nname: moe_list\nmodel:\n  module: net.py:Net\n  input: {shape: [B, 8]}\n"
        "  target: {shape: [B, 8]}\n  loss: MSELoss\ndevices: [cpu:0, cpu:1]\nplacement:\n"
        "  - {layers: [moe], devices: [cpu:0, cpu:1], parallel: expert}\n"
        "training: {batch_size: 4, steps: 1, optimizer: {op: SGD, lr: 0.1}}\n")
    (d,) = errors(str(tmp_path / "spec.yaml"))
    assert d.code == "P112" and "'moe.experts'" in d.message and "nn.ModuleList" in d.message


def test_under_clip_grad_norm_each_rank_counts_its_own_experts(tmp_path):
    pytest.importorskip("transformers")
    text = api.generate(SPEC, str(tmp_path / "program.py"), overrides=[EXPERT, "training.clip_grad_norm=1.0"])
    assert "norm_params += norm_share(seg0, owner=rank == 0) + list(experts0.values())" in text


def test_an_all_to_all_moves_a_share_of_each_devices_rows_to_each_other_device():
    from placer.estimate.comm import op_moves, op_sent
    from placer.plan.ir import Op

    op = Op(kind=OpKind.ALL_TO_ALL, devices=("a", "b", "c", "d"), segment=0, phase="fwd", tensor="act", bytes=400)
    assert op_sent(op) == dict.fromkeys("abcd", 400)  # the whole send buffer, the rows kept included
    moved = op_moves(op)
    assert len(moved) == 12 and {n for _, _, n in moved} == {100}


def test_shard_full_gathers_and_scatters_the_dense_parameters_padded_as_fsdp2_pads_them():
    pytest.importorskip("transformers")
    full = EXPERT.replace("parallel: expert", "parallel: {mode: expert, shard: full}")
    report = api.plan(SPEC, overrides=["model.kwargs.family=qwen2_moe", full])
    ops = report.plan.unique_ops()
    assert not [op for op in ops if op.kind == OpKind.ALL_REDUCE]
    g = report.graph
    padded = sum(-(-n // 2) * 2 * row for l in g.layers for n, row in l.param_rows) + sum(
        r.bytes for r in g.root_params if r.trainable)
    experts = 4 * sum(n for l in g.layers for _, _, n, _, _ in l.expert_weights)
    # the shared expert's gate, a [1, 32] weight in each layer, is padded to 2 rows
    assert padded - 4 * sum(l.params for l in g.layers) == 2 * 32 * 4
    for kind, phase in ((OpKind.ALL_GATHER, "fwd"), (OpKind.ALL_GATHER, "bwd"), (OpKind.REDUCE_SCATTER, "bwd")):
        assert sum(op.bytes for op in ops if op.kind == kind and op.phase == phase) == padded - experts
    assert "fully_shard_segment(" in api.generate(SPEC, overrides=[full])


@pytest.mark.parametrize("shard,more", [("optimizer", ()), ("full", ("pipeline={microbatches: 2, schedule: gpipe}",))])
def test_what_shard_cannot_do_under_expert_is_refused(shard, more):
    from placer.spec.check import load_spec

    two = ("placement=[{name: a, layers: [model.embed_tokens, model.rotary_emb, model.layers.0], devices: [cpu:0, "
           f"cpu:1], parallel: {{mode: expert, shard: {shard}}}}}, {{name: b, layers: [model.layers.1, model.norm, "
           "lm_head], devices: [cpu:2, cpu:3], parallel: data}]")
    sets = ["devices=[cpu:0, cpu:1, cpu:2, cpu:3]", two if more else EXPERT.replace(
        "parallel: expert", f"parallel: {{mode: expert, shard: {shard}}}"), *more]
    with pytest.raises(PlacerError) as e:
        load_spec(SPEC, overrides=sets)
    assert e.value.diagnostics[0].code == "P114"
