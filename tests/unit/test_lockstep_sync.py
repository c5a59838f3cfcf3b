"""Data groups of replica pipelines in lockstep (module models: placer/plan/crossings.py) with the
other `sync` and `shard` options: ZeRO-1 (the groups all-reduce, each rank steps its share and
broadcasts it, tied copies included), a parameter server on a device of the placement, and a
broadcast from the first device. A tie is kept where its groups all-reduce; under a parameter
server or a broadcast it is refused (P080); what lockstep still cannot run says why (P083)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from placer.codegen.program import generate
from placer.model.build import deep_check
from placer.model.graph import Tie
from placer.plan.ir import OpKind
from placer.plan.ties import shard_bytes, shard_rows
from placer.spec.check import load_spec

try:
    from .test_lockstep_data import GPT2, LLAMA, lowered, spec_file
except ImportError:  # run as a top-level module
    from test_lockstep_data import GPT2, LLAMA, lowered, spec_file

ROOT = Path(__file__).resolve().parents[2]
ZERO = "{mode: data, shard: optimizer}"
SERVER = "{mode: data, sync: parameter_server, server: cpu:3}"  # a device of the other segment
ONE_F_ONE_B = "pipeline: {microbatches: 2, schedule: 1f1b}\n"


def test_zero1_steps_and_broadcasts_every_parameter_tied_copies_included(tmp_path):
    """GPT-2's wte / lm_head tied across two ZeRO-1 groups: the groups' all-reduce leaves the tie
    out (its own all-reduce sums every copy), but ZeRO steps and broadcasts the copy with the rest."""
    spec, graph, plan = lowered(spec_file(tmp_path, GPT2, front=ZERO, pipeline=ONE_F_ONE_B, tied=True))
    assert not [d for d in deep_check(spec) if d.severity == "error"]  # no P080, no P083
    ops = plan.unique_ops()
    (tie,) = [op for op in ops if "tie" in op.attrs]
    assert tie.devices == ("cpu", "cpu:1", "cpu:2", "cpu:3")
    front = sum(graph.layer(n).param_bytes for n in plan.segments[0].layers)  # wte's weight counted here
    reduced = sum(op.bytes for op in ops if op.kind == OpKind.ALL_REDUCE and op.devices == ("cpu", "cpu:1"))
    shared = [op for op in ops if op.kind == OpKind.BROADCAST and op.segment == 0]
    assert reduced == front - tie.bytes
    assert {op.attrs["root"] for op in shared} == {"cpu", "cpu:1"} and sum(op.bytes for op in shared) == front
    text = generate(spec, out_dir=str(tmp_path)).text
    assert "opt0 = zero_optimizer(seg0.parameters(), g0" in text
    assert "all_reduce_grads(untied(seg0.parameters(), tied0), g0, bucket_mb=25.0)" in text
    assert "PIPELINES = [[0, 2], [1, 3]]" in text and "ddp_sum(" not in text


def test_a_parameter_server_and_a_broadcast_run_replica_pipelines(tmp_path):
    """Llama: the front group's gradients go to a server on a device of the back group, which steps
    and sends the weights back; the back group's first device broadcasts its weights before the
    forward and steps on the gradients reduced to it."""
    path = spec_file(tmp_path, LLAMA, front=SERVER, pipeline="pipeline: {microbatches: 2, schedule: gpipe}\n")
    path.write_text(path.read_text().replace("devices: [cpu:2, cpu:3], parallel: data}",
                                             "devices: [cpu:2, cpu:3], parallel: {mode: data, sync: broadcast}}"))
    spec, _, plan = lowered(path)
    assert not [d for d in deep_check(spec) if d.severity == "error"]
    kinds = {(op.kind, op.segment, op.devices, op.attrs.get("root"), op.tensor) for op in plan.unique_ops()
             if op.kind in (OpKind.REDUCE, OpKind.BROADCAST)}
    # the server ran no forward: the first data device sends it the segment's buffers (rotary's inv_freq)
    assert kinds == {(OpKind.REDUCE, 0, ("cpu", "cpu:1", "cpu:3"), "cpu:3", "grads"),
                     (OpKind.BROADCAST, 0, ("cpu", "cpu:1", "cpu:3"), "cpu:3", "params"),
                     (OpKind.BROADCAST, 0, ("cpu", "cpu:1", "cpu:3"), "cpu", "buffers"),
                     (OpKind.REDUCE, 1, ("cpu:2", "cpu:3"), "cpu:2", "grads"),
                     (OpKind.BROADCAST, 1, ("cpu:2", "cpu:3"), "cpu:2", "params")}
    text = " ".join(generate(spec, out_dir=str(tmp_path)).text.split())  # as one line: ruff wraps calls
    assert "param_server_step( seg0.parameters(), opt0, g0, server=3," in text
    assert "broadcast_sync_before_forward(seg1.parameters(), g1, root=2" in text
    assert "broadcast_sync_after_backward(seg1.parameters(), opt1, g1, root=2" in text
    assert "Lockstep(" in text and "PIPELINES = [[0, 2], [1, 3]]" in text


def test_a_tie_under_a_parameter_server_is_refused(tmp_path):
    """The server steps its copy alone and sends back only what its own sync holds."""
    spec = load_spec(str(spec_file(tmp_path, GPT2, front=SERVER, tied=True)))
    diags = [d for d in deep_check(spec) if d.severity == "error"]
    assert [d.code for d in diags] == ["P080"]
    assert "'transformer.wte.weight'" in diags[0].message and "sync 'parameter_server'" in diags[0].message
    assert "segment 'front'" in diags[0].message and "segment 'back'" in diags[0].message


def test_fsdp2_shards_each_placed_layer(tmp_path):
    """The model's forward calls the placed layers, not the segment's container: one unit each."""
    spec = load_spec(str(spec_file(tmp_path, LLAMA, front="{mode: data, shard: full}", pipeline=ONE_F_ONE_B)))
    assert not [d for d in deep_check(spec) if d.severity == "error"]
    text = " ".join(generate(spec, out_dir=str(tmp_path)).text.split())
    assert ('seg0 = fully_shard_layers( stage, ["model.embed_tokens", "model.rotary_emb", "model.layers.0"], g0, '
            "device.type )") in text
    assert "fully_shard_segment(" not in text.split("# Below: placer's runtime")[0]


def test_a_tie_across_fsdp2_groups_is_summed_shard_by_shard(tmp_path):
    """The r-th device of each FSDP2 group holds the same half of its copy: one all-reduce per
    position, of half the weight; each layer's gathers count the copy it uses."""
    full = "{mode: data, shard: full}"
    path = spec_file(tmp_path, GPT2, front=full, tied=True)
    path.write_text(path.read_text().replace("devices: [cpu:2, cpu:3], parallel: data}",
                                             f"devices: [cpu:2, cpu:3], parallel: {full}}}"))
    spec, _, plan = lowered(path)
    assert not [d for d in deep_check(spec) if d.severity == "error"]
    ties = sorted((op.devices, op.bytes) for op in plan.unique_ops() if "tie" in op.attrs)
    assert ties == [(("cpu", "cpu:2"), 128 * 32 * 2), (("cpu:1", "cpu:3"), 128 * 32 * 2)]
    gathers = {op.attrs["layer"]: op.bytes for op in plan.unique_ops() if op.kind == OpKind.ALL_GATHER}
    assert gathers["lm_head"] == gathers["transformer.wte"] == 128 * 32 * 4
    text = " ".join(generate(spec, out_dir=str(tmp_path)).text.split())
    assert "for ranks in [[0, 2], [1, 3]]" in text and "own.update(tied0)" not in text


@pytest.mark.parametrize("rows, n", [(127, 2), (5, 4), (128, 2), (7, 3), (1, 2)])
def test_fsdp2_shard_rows_are_torchs(rows, n):
    """The rows each rank of an FSDP2 group holds of a dim 0 that need not divide: torch.chunk's
    pieces, then empty ones, as fully_shard cuts them (its own helper, where torch has it)."""
    chunk = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common")._chunk_with_empty
    assert shard_rows(rows, n) == [c.shape[0] for c in chunk(torch.empty(rows, 3), n, 0)]
    tie = Tie(name="w", names=("a.w", "b.w"), layers=("a", "b"), numel=rows * 3, bytes=rows * 12, rows=rows)
    assert sum(shard_bytes(tie, n)) == tie.bytes and shard_bytes(tie, n)[0] == -(-rows // n) * 12


def test_a_tie_whose_rows_do_not_divide_is_summed_as_fsdp2_shards_it(tmp_path):
    """GPT-2 with 127 tokens over FSDP2 groups of 2: the first position sums 64 rows of the tied
    copies, the second 63 (an even cut of the bytes would say 63.5 each); the program gathers each
    shard's first-step gradient whole on the group's first rank for run --check."""
    full = "{mode: data, shard: full}"
    path = spec_file(tmp_path, GPT2, front=full, tied=True)
    path.write_text(path.read_text().replace("devices: [cpu:2, cpu:3], parallel: data}",
                                             f"devices: [cpu:2, cpu:3], parallel: {full}}}")
                    .replace("vocab: 128", "vocab: 127").replace("high: 128", "high: 127"))
    spec, _, plan = lowered(path)
    assert not [d for d in deep_check(spec) if d.severity == "error"]
    ties = sorted((op.devices, op.bytes) for op in plan.unique_ops() if "tie" in op.attrs)
    assert ties == [(("cpu", "cpu:2"), 64 * 32 * 4), (("cpu:1", "cpu:3"), 63 * 32 * 4)]
    text = "".join(generate(spec, out_dir=str(tmp_path)).text.split())  # ruff may wrap the call
    for k, first in ((0, 0), (1, 2)):
        assert f"WHOLE_GRADS.update({{n:(p,rank=={first})forn,pinnamed_params(seg{k},model).items()}})" in text


def test_a_tie_between_fsdp2_and_whole_copies_is_refused(tmp_path):
    """One group holds 1/2 of its copy's gradient on each rank, the other the whole of it."""
    spec = load_spec(str(spec_file(tmp_path, GPT2, front="{mode: data, shard: full}", tied=True)))
    diags = [d for d in deep_check(spec) if d.severity == "error"]
    assert [d.code for d in diags] == ["P080"] and "'transformer.wte.weight'" in diags[0].message


def test_a_parent_parameter_under_fsdp2_is_refused(tmp_path):
    """TinyGPT's `pos` belongs to no placed layer: no unit would gather it (P082)."""
    text = """placer: 1
name: tiny
model:
  module: {model}:TinyGPT
  kwargs: {{vocab: 32, d_model: 16, n_layers: 2, seq: 8, n_heads: 2}}
  input: {{shape: [B, 8], dtype: int64, high: 32}}
  target: {{shape: [B, 8], dtype: int64, high: 32}}
  loss: CrossEntropyLoss
devices: [cpu, cpu:1, cpu:2, cpu:3]
placement:
  - {{name: front, layers: [embed, blocks.0], devices: [cpu, cpu:1], parallel: {{mode: data, shard: full}}}}
  - {{name: back, layers: [blocks.1, ln_f, lm_head], devices: [cpu:2, cpu:3], parallel: data}}
training: {{batch_size: 4, steps: 1, optimizer: {{op: SGD, lr: 0.1}}}}
"""
    path = tmp_path / "spec.yaml"
    path.write_text(text.format(model=ROOT / "specs" / "models" / "tinygpt.py"))
    diags = [d for d in deep_check(load_spec(str(path))) if d.severity == "error"]
    assert [d.code for d in diags] == ["P082"] and "'pos'" in diags[0].message and "shard 'full'" in diags[0].message


def test_sync_batchnorm_converts_the_models_own_batchnorms_and_counts_each(tmp_path):
    """A ResNet block is one placed layer holding two BatchNorms: both are synced (their statistics
    all-reduced forward and backward), converted in the model, whose forward calls them."""
    spec, graph, plan = lowered(ROOT / "tests" / "models" / "resnet_sync_batchnorm.yaml")
    assert not [d for d in deep_check(spec) if d.severity == "error"]
    assert graph.layer("layer1.0").norms == (8, 8) and graph.layer("bn1").norms == (8,)
    stats = [op for op in plan.unique_ops() if op.tensor == "stats" and op.attrs.get("layer") == "layer1.0"]
    assert sorted(op.bytes for op in stats) == [4 * 2 * 8] * 2 + [8 * (2 * 8 + 1)] * 2
    text = " ".join(generate(spec, out_dir=str(tmp_path)).text.split())
    assert "stage = stage_0_front( convert_layers( model," in text and "lambda m: sync_batchnorm(m, g0, device)" in text


def test_what_lockstep_still_cannot_run_says_why(tmp_path):
    """A parameter server on a device that holds no segment: it would run no replica pipeline."""
    path = spec_file(tmp_path, LLAMA, front="{mode: data, sync: parameter_server, server: cpu:4}")
    path.write_text(path.read_text().replace("devices: [cpu, cpu:1, cpu:2, cpu:3]", "devices: [cpu, cpu:1, cpu:2, cpu:3, cpu:4]"))
    diags = [d for d in deep_check(load_spec(str(path))) if d.code == "P083"]
    assert len(diags) == 1 and "segment 'front''s parameter server 'cpu:4' holds no segment" in diags[0].message
