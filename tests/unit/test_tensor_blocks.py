"""`tensor` on a module model: the plan's all-reduces per transformer block, each rank's share
of the parameters, and the program's DTensor plan, all from one rule (modes.tensor.groups)."""
from __future__ import annotations

import os

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
