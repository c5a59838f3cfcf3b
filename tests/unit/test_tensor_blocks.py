"""`tensor` on a module model: the plan's all-reduces per transformer block, each rank's share
of the parameters, and the program's DTensor plan, all from one rule (modes.tensor.groups)."""
from __future__ import annotations

import dataclasses
import os

import pytest

from placer import api
from placer.plan.ir import OpKind

SPEC = os.path.join(os.path.dirname(__file__), "..", "models", "tinygpt_tensor.yaml")
TOKENS, D = 4 * 8, 16  # batch x positions, d_model of tests/models/tinygpt_tensor.yaml


def test_the_plan_all_reduces_each_block_as_dtensor_does():
    report = api.plan(SPEC)
    ops = [op for op in report.plan.unique_ops() if op.kind == OpKind.ALL_REDUCE]
    fwd = [op for op in ops if op.phase == "fwd"]
    bwd = [op for op in ops if op.phase == "bwd"]
    # per block: attention's proj and the MLP's proj sum their partial outputs ...
    assert [op.attrs["pair"] for op in fwd] == [
        f"blocks.{b}.attn.q+blocks.{b}.attn.k+blocks.{b}.attn.v..blocks.{b}.attn.proj" if i == 0 else
        f"blocks.{b}.mlp.fc..blocks.{b}.mlp.proj" for b in (0, 1) for i in (0, 1)]
    assert {op.bytes for op in fwd} == {TOKENS * D * 4}
    # ... and each column half's input gradient is all-reduced in backward: q, k, v, fc
    assert len(bwd) == 8 and {op.bytes for op in bwd} == {TOKENS * D * 4}
    assert {op.devices for op in ops} == {("cpu", "cpu:1")}


def test_each_rank_holds_half_of_each_split_projection():
    report = api.plan(SPEC)
    # per block: q, k, v and fc (weights and biases), both projs' weights (their biases stay whole)
    split = 3 * (D * D + D) + (D * 4 * D + 4 * D) + D * D + 4 * D * D
    params = {d["device"]: d["params"] for d in report.as_dict()["devices"]}
    assert params == {dev: report.graph.total_params - 2 * split // 2 for dev in ("cpu", "cpu:1")}


def test_the_program_splits_exactly_the_planned_groups(tmp_path):
    out = tmp_path / "program.py"
    api.generate(SPEC, out)
    program = out.read_text().replace(" ", "").replace("\n", "")
    assert ('tensor_parallelize_blocks(stage,g0,[(("blocks.0.attn.q","blocks.0.attn.k","blocks.0.attn.v"),'
            '"blocks.0.attn.proj"),(("blocks.0.mlp.fc",),"blocks.0.mlp.proj")') in program


def test_the_program_divides_the_head_counts_the_check_reads():
    """The runtime piece (stdlib and torch only) repeats the mode's list: held equal here."""
    import ast

    from placer.codegen import runtime
    from placer.modes import tensor

    source = open(os.path.join(os.path.dirname(runtime.__file__), "tensor.py")).read()
    found = next(ast.literal_eval(n.value) for n in ast.parse(source).body
                 if isinstance(n, ast.Assign) and n.targets[0].id == "HEAD_ATTRS")
    assert found == tensor.HEAD_ATTRS


def test_under_bf16_the_blocks_sum_bfloat16_and_all_reduce_float32_input_gradients():
    """autocast makes each row half's partial sums bfloat16 (2 bytes); the column halves' input
    gradients are all-reduced at the DTensor input, before autocast's cast: float32 (4 bytes).
    tests/distributed/test_run_mm_modes.py measures both."""
    report = api.plan(SPEC, overrides=["training.precision=bf16"])
    ops = [op for op in report.plan.unique_ops() if op.kind == OpKind.ALL_REDUCE]
    assert {op.bytes for op in ops if op.phase == "fwd"} == {TOKENS * D * 2}
    assert {op.bytes for op in ops if op.phase == "bwd"} == {TOKENS * D * 4}


def _by_kind(report) -> dict:
    """{(kind, phase, tensor, devices): the sizes of those collectives, sorted} of the plan."""
    out: dict = {}
    for op in report.plan.unique_ops():
        if op.kind in (OpKind.ALL_REDUCE, OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER, OpKind.BROADCAST):
            out.setdefault((op.kind, op.phase, op.tensor, op.devices), []).append(op.bytes)
    return {k: tuple(sorted(v)) for k, v in out.items()}


def test_under_bf16_each_data_replica_sums_its_blocks_in_bfloat16():
    """tensor x data (`data: 2`, no shard, shard: optimizer and shard: full) under bf16: each
    replica's row sums are bfloat16 on its half of the rows, as one group's are; the input
    gradients, the replicas' gradient sums, ZeRO's broadcasts and FSDP2's gathers of the float32
    parameters stay 4 bytes an element, the same ops and bytes as under fp32.
    tests/distributed/test_run_two_d.py measures it."""
    two_d = os.path.join(os.path.dirname(SPEC), "tinygpt_tensor_data.yaml")
    for shard in ("none", "optimizer", "full"):
        sets = [f"placement.0.parallel.shard={shard}"]
        fp32, bf16 = (_by_kind(api.plan(two_d, overrides=sets + [f"training.precision={p}"])) for p in ("fp32", "bf16"))
        rows = {k: v for k, v in bf16.items() if k[1:3] == ("fwd", "act")}
        assert set(rows) == {(OpKind.ALL_REDUCE, "fwd", "act", r) for r in (("cpu", "cpu:1"), ("cpu:2", "cpu:3"))}
        assert set(rows.values()) == {(TOKENS * D * 2 // 2,) * 4}, (shard, rows)  # 2 per block, half the batch
        assert {k: v for k, v in fp32.items() if k not in rows} == {k: v for k, v in bf16.items() if k not in rows}
        assert {v for k, v in bf16.items() if k[1:3] == ("bwd", "grad")} == {(TOKENS * D * 4 // 2,) * 8}  # q, k, v, fc


def test_under_bf16_llamas_fsdp_tp_halves_its_row_sums_only():
    """Hugging Face Llama (rotary, grouped-query attention) as FSDP2 x TP under bf16: o_proj's and
    down_proj's sums are bfloat16 in each replica, every other collective as under fp32."""
    pytest.importorskip("transformers")
    llama = os.path.join(os.path.dirname(SPEC), "hf_llama_fsdp_tp.yaml")
    fp32, bf16 = (_by_kind(api.plan(llama, overrides=[f"training.precision={p}"])) for p in ("fp32", "bf16"))
    rows = {k for k in fp32 if k[1:3] == ("fwd", "act")}
    assert {k[3] for k in rows} == {("cpu", "cpu:1"), ("cpu:2", "cpu:3")}
    assert {k: tuple(b // 2 for b in v) for k, v in fp32.items() if k in rows} == {k: bf16[k] for k in rows}
    assert {(2 * 16) * 32 * 2} == {b for k in rows for b in bf16[k]}  # a replica's 2 rows x 16 positions x d 32
    assert {k: v for k, v in fp32.items() if k not in rows} == {k: v for k, v in bf16.items() if k not in rows}


def test_under_bf16_the_2d_program_runs_each_replicas_blocks_under_autocast():
    """The program split by the plan (the generate step P086 stopped before): autocast around the
    forward and loss, the blocks split over each replica g0, float32 gradients summed over dp0."""
    two_d = os.path.join(os.path.dirname(SPEC), "tinygpt_tensor_data.yaml")
    program = api.generate(two_d, overrides=["training.precision=bf16"])
    assert program.count("with torch.autocast(device.type, dtype=torch.bfloat16):  # precision bf16") >= 2
    flat = "".join(program.split())
    assert 'tensor_parallelize_blocks(stage,g0,[(("blocks.0.attn.q","blocks.0.attn.k","blocks.0.attn.v"),' in flat
    assert "all_reduce_slices(seg0,dp0)" in flat and 'PRECISION="bf16"' in flat


def test_t5s_relative_position_bias_is_held_split_with_its_heads(tmp_path):
    """T5's block 0 holds relative_attention_bias, [32 buckets, 4 heads]: split with the heads,
    each of 2 ranks holds 64 of its 128 values (the run looked the whole bias up for half the
    heads: R020 "size of tensor a (2) must match b (4)")."""
    pytest.importorskip("transformers")
    from placer.modes.tensor import module_held

    models = os.path.join(os.path.dirname(__file__), "..", "models")
    text = open(os.path.join(models, "hf_t5.yaml")).read().replace("hf_tiny.py", os.path.join(models, "hf_tiny.py"))
    start, end = text.index("placement:"), text.index("training:")
    spec = tmp_path / "spec.yaml"
    spec.write_text(text[:start] + "placement:\n  - {layers: [t5.encoder.*, t5.decoder.*, t5.lm_head, t5.shared], "
                    "devices: [cpu:0, cpu:1], parallel: tensor}\n" + text[end:])
    report = api.plan(str(spec))
    block = next(l for l in report.graph.layers if l.name == "t5.encoder.block.0")
    assert block.head_tables == (("layer.0.SelfAttention.relative_attention_bias", 32 * 4),)
    even = lambda n, d, r: n // d  # noqa: E731
    plain = dataclasses.replace(block, head_tables=())
    assert module_held(plain, 2, 0, even) - module_held(block, 2, 0, even) == 64


def test_berts_pairs_follow_the_data_flow_across_sibling_modules(tmp_path):
    """BERT keeps q, k, v in attention.self and their output projection in attention.output, the
    MLP's halves in intermediate and output (P028 "no partner" before). The MLM head's
    transform.dense -> GELU -> LayerNorm -> decoder is no pair: the LayerNorm mixes the features."""
    pytest.importorskip("transformers")
    from placer.diagnostics import PlacerError
    from placer.model.build import deep_check
    from placer.modes.tensor import groups
    from placer.spec.check import load_spec

    spec = os.path.join(os.path.dirname(__file__), "..", "models", "hf_bert_tensor.yaml")
    report = api.plan(spec)
    layer = next(l for l in report.graph.layers if l.name == "bert.encoder.layer.0")
    assert groups(layer) == [(("attention.self.query", "attention.self.key", "attention.self.value"),
                              "attention.output.dense"), (("intermediate.dense",), "output.dense")]
    fwd = [op for op in report.plan.unique_ops() if op.kind == OpKind.ALL_REDUCE and op.phase == "fwd"]
    assert len(fwd) == 4  # two row halves a layer
    head = next(l for l in report.graph.layers if l.name == "cls")
    assert groups(head) == []
    text = open(spec).read().replace("hf_tiny.py", os.path.join(os.path.dirname(spec), "hf_tiny.py")).replace(
        "layers: [bert.encoder.layer.*]", "layers: [bert.encoder.layer.*, cls]").replace(
        "  - {name: head, layers: [cls], device: cpu:0}\n", "")
    moved = tmp_path / "spec.yaml"
    moved.write_text(text)
    try:
        diags = deep_check(load_spec(str(moved)))
    except PlacerError as e:
        diags = e.diagnostics
    assert any(d.code == "P028" and "cls.predictions.transform.dense" in d.message for d in diags)


PER_HEAD = '''
import torch
from torch import nn


class Attn(nn.Module):
    def __init__(self, d=16, n_heads=4):
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.slopes = nn.Parameter(torch.ones(n_heads))  # one value per head, kept whole by a split

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t(x).view(b, s, -1, d // 4).transpose(1, 2) for t in (self.q, self.k, self.v))
        a = (q @ k.transpose(-1, -2)) * self.slopes.view(1, -1, 1, 1)
        return self.o((a.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Attn() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x
'''


def test_a_per_head_tensor_that_tensor_cannot_split_is_refused(tmp_path):
    """A parameter with one value per head held by the attention module itself: the heads would
    split, the tensor stay whole, and each rank scale its 2 heads by all 4 slopes (P093)."""
    (tmp_path / "net.py").write_text(PER_HEAD)
    (tmp_path / "spec.yaml").write_text(
        "placer: 1\nname: per_head\nmodel:\n  module: net.py:Net\n  input: {shape: [B, 8, 16]}\n"
        "  target: {shape: [B, 8, 16]}\n  loss: MSELoss\ndevices: [cpu:0, cpu:1]\nplacement:\n"
        "  - {layers: [blocks.*], devices: [cpu:0, cpu:1], parallel: tensor}\n"
        "training: {batch_size: 4, steps: 1, optimizer: {op: SGD, lr: 0.1}}\n")
    from placer.diagnostics import PlacerError
    from placer.model.build import deep_check
    from placer.spec.check import load_spec

    try:
        diags = deep_check(load_spec(str(tmp_path / "spec.yaml")))
    except PlacerError as e:
        diags = e.diagnostics
    (d,) = [d for d in diags if d.severity == "error"]
    assert d.code == "P093" and "blocks.0.slopes [4]" in d.message and "nn.Embedding" in d.hint


def test_a_parent_placed_whole_plans_what_its_children_plan():
    """Llama tensor parallel as `[model, lm_head]` and as model's children: the same all-reduces,
    sized from each Linear's traced input (the parent's own input is token ids: 8 KiB and no
    backward before)."""
    pytest.importorskip("transformers")
    spec = os.path.join(os.path.dirname(__file__), "..", "models", "hf_llama_tensor.yaml")

    def comm(*sets):
        report = api.plan(spec, overrides=list(sets)) if sets else api.plan(spec)
        return sorted((op.phase, op.bytes) for op in report.plan.unique_ops() if op.kind == OpKind.ALL_REDUCE)

    children = comm()
    assert len(children) == 14 and comm("placement.0.layers=[model, lm_head]") == children
