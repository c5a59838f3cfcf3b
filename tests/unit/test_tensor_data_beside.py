"""tensor x data on a module model beside one-device segments, in lockstep
(tests/models/tinygpt_tensor_data_beside.yaml): every rank of the 2-D group receives the whole
hidden state, cuts its replica's rows of it as it arrives (runtime bands.py
replica_rows_around), runs its replica's tensor split of the blocks, and the replicas' outputs
are gathered by rows over each position; the plan counts those gathers and the program makes
them."""
from __future__ import annotations

from pathlib import Path

import pytest

from placer import api
from placer.plan.ir import OpKind

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "tests" / "models" / "tinygpt_tensor_data_beside.yaml"
LLAMA = ROOT / "tests" / "models" / "hf_llama_tensor_data_beside.yaml"
FIRST = ROOT / "tests" / "models" / "tinygpt_tensor_data_first.yaml"
REPLICAS = [("cpu:1", "cpu:2"), ("cpu:3", "cpu:4")]
PLACES = [("cpu:1", "cpu:3"), ("cpu:2", "cpu:4")]


def _ops(plan, kind, segment=1):
    return sorted((op.phase, op.devices, op.bytes) for op in plan.unique_ops()
                  if op.segment == segment and op.kind == kind)


def test_the_plan_cuts_rows_in_each_replica_and_gathers_them_over_each_place():
    plan = api.plan(SPEC).plan
    hidden = 4 * 8 * 16 * 4  # [batch 4, seq 8, d 16] float32, the whole batch
    # the blocks' output gathered by rows over each place; backward, the hidden state's gradient
    assert _ops(plan, OpKind.ALL_GATHER) == sorted([("fwd", p, hidden) for p in PLACES] +
                                                   [("bwd", p, hidden) for p in PLACES])
    # each replica's pair all-reduces run on its own rows (half the batch) within the replica
    reduces = {(op.devices, op.bytes) for op in plan.unique_ops() if op.segment == 1 and op.kind == OpKind.ALL_REDUCE
               and op.tensor == "act"}
    assert reduces == {(r, hidden // 2) for r in REPLICAS}
    # the slices' gradients summed over each place; the hidden state crosses whole to all four
    sums = {op.devices for op in plan.unique_ops() if op.kind == OpKind.ALL_REDUCE and op.tensor == "grads"}
    assert sums == set(PLACES)
    copies = {op.dst for op in plan.unique_ops() if op.kind == OpKind.COPY and op.phase == "fwd" and op.segment == 1}
    assert copies == {(d,) for r in REPLICAS for d in r}


def test_the_plan_gathers_the_gradient_of_the_hidden_state_alone():
    """Llama's decoder layers also read the rotary cos / sin (no batch rows: not cut, whole on each
    rank): the input gradient gathered is the hidden state's, not every input of the first layer."""
    pytest.importorskip("transformers")
    plan = api.plan(LLAMA).plan
    hidden = 4 * 16 * 32 * 4
    assert _ops(plan, OpKind.ALL_GATHER) == sorted([("fwd", p, hidden) for p in PLACES] +
                                                   [("bwd", p, hidden) for p in PLACES])


def test_the_program_cuts_the_rows_where_the_hidden_state_arrives_and_sums_over_the_replicas():
    flat = "".join(api.generate(api.load(SPEC)).split())
    assert ('replica_rows_around(model,[("embed",0)],["blocks.0","blocks.1"],dp1,next(pforpin[[1,3],[2,4]]ifrankinp)'
            in flat)
    assert "tensor_parallelize_blocks(stage,g1," in flat and "all_reduce_slices(seg1,dp1)" in flat
    assert "defreplica_rows_around(model,entering,layers,group,ranks):" in flat and "groups=GROUPS" in flat


def test_as_the_first_segment_the_plan_gathers_its_output_and_no_input_gradient():
    """tests/models/tinygpt_tensor_data_first.yaml: the embedding and blocks as the first segment
    read the batch itself (each rank cuts its replica's rows of the input ids); nothing trains
    before them, so no input gradient is gathered, only their output, by rows over each place."""
    plan = api.plan(FIRST).plan
    hidden = 4 * 8 * 16 * 4
    replicas, places = [("cpu", "cpu:1"), ("cpu:2", "cpu:3")], [("cpu", "cpu:2"), ("cpu:1", "cpu:3")]
    assert _ops(plan, OpKind.ALL_GATHER, segment=0) == sorted(("fwd", p, hidden) for p in places)
    reduces = {(op.devices, op.bytes) for op in plan.unique_ops() if op.segment == 0 and op.kind == OpKind.ALL_REDUCE
               and op.tensor == "act"}
    assert reduces == {(r, hidden // 2) for r in replicas}  # each replica's pair sums on its own rows
    sends = {(op.src, op.dst, op.bytes) for op in plan.unique_ops() if op.kind == OpKind.COPY and op.phase == "fwd"}
    assert sends == {(("cpu",), ("cpu:4",), hidden)}  # the gathered output, from the group's first


def test_as_the_first_segment_the_program_cuts_the_batch_as_the_forward_begins():
    flat = "".join(api.generate(api.load(FIRST)).split())
    assert ('replica_rows_around(model,[("",0)],["embed","blocks.0","blocks.1"],dp0,next(pforpin[[0,2],[1,3]]ifrankinp)'
            in flat)
    assert "model.register_forward_pre_hook(cut_batch)" in flat  # so the parent's `+ pos` runs on the rows too
    assert "model.register_forward_pre_hook(self._rows,prepend=True,with_kwargs=True)" in flat  # lockstep counts the whole batch


FSDP_TP = ROOT / "tests" / "models" / "tinygpt_fsdp_tp_beside.yaml"


def test_fsdp_tp_beside_others_passes_validate_deep(tmp_path):
    from click.testing import CliRunner

    from placer.cli.main import main

    for args in (["validate", str(FSDP_TP)], ["validate", "--deep", str(FSDP_TP)]):  # neither W007 nor P086
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0 and "W007" not in r.output and "P086" not in r.output, r.output
    # every block in the group: its glue then reads TinyGPT's `pos`, which no FSDP2 unit would gather
    text = FSDP_TP.read_text().replace("../../specs", str(ROOT / "specs")).replace(
        "layers: [embed, blocks.0], device", "layers: embed, device").replace("layers: blocks.1,", "layers: blocks.*,")
    (tmp_path / "spec.yaml").write_text(text)
    r = CliRunner().invoke(main, ["validate", "--deep", str(tmp_path / "spec.yaml")])
    assert r.exit_code == 1 and "error[P082]: parameter 'pos'" in r.output and "(mode 'tensor')" in r.output, r.output


def test_fsdp_tp_beside_others_gathers_and_scatters_each_unit_over_each_place():
    """blocks.1, one FSDP2 unit: each rank holds a quarter of every split weight (half of its
    replica's tp slice) and half of what tp leaves whole; its tp slice is all-gathered over each
    place (dp) in forward and again in backward, its gradients reduce-scattered there; no
    all-reduce of the slices' gradients; the rows cut and gathered as without FSDP2."""
    report = api.plan(FSDP_TP)
    plan = report.plan
    d, ff = 16, 64
    split = 3 * (d * d + d) + d * d + d * ff + ff + ff * d  # q, k, v (+ biases), proj, fc (+ bias), mlp.proj
    whole = 2 * 2 * d + d + d  # ln_1, ln_2 (weight, bias), the row halves' biases (attn.proj, mlp.proj)
    tp_slice = (split // 2 + whole) * 4  # bytes, one replica's rank's, before FSDP2 shards it over dp
    assert _ops(plan, OpKind.ALL_GATHER) == sorted(
        [(phase, p, tp_slice) for p in PLACES for phase in ("fwd", "bwd")] +  # the unit's parameters
        [(phase, p, 4 * 8 * d * 4) for p in PLACES for phase in ("fwd", "bwd")])  # the rows, as without FSDP2
    assert _ops(plan, OpKind.REDUCE_SCATTER) == sorted(("bwd", p, tp_slice) for p in PLACES)
    assert not [op for op in plan.unique_ops() if op.kind == OpKind.ALL_REDUCE and op.tensor == "grads"]
    held = {m["device"]: (m["params"], m["comm_bytes"]) for m in report.as_dict()["devices"]}
    # the unit's gathered tp slice and its whole gradients are FSDP2's buffers of backward only
    # (in backward_bytes, Mode.unit_buffers): none is held through the step
    assert all(held[dev] == ((split // 2 + whole) // 2, 0) for r in REPLICAS for dev in r), held


def test_the_program_splits_over_tp_then_shards_each_placed_layer_over_dp():
    flat = "".join(api.generate(api.load(FSDP_TP)).split())
    assert 'mesh1=DeviceMesh.from_group([dp1,g1],device.type,mesh=[[1,2],[3,4]],mesh_dim_names=("dp","tp"))' in flat
    assert 'tensor_parallelize_blocks(stage,mesh1["tp"],' in flat
    # a unit per placed layer (what the model's forward calls), not the stage as one root
    assert 'seg1=fully_shard_layers(stage,["blocks.1"],mesh1["dp"],device.type)' in flat
    assert "fully_shard_segment(stage" not in flat and "all_reduce_slices(seg1" not in flat
    assert 'replica_rows_around(model,[("blocks.0",0)],["blocks.1"],dp1,' in flat
