"""Memory, FLOPs and communication formulas on hand-made graphs and layouts (no torch)."""
from __future__ import annotations

import textwrap

import pytest

from placer.estimate.comm import op_moves
from placer.estimate.cost import balance, estimate
from placer.estimate.memory import state_slots
from placer.model.graph import LayerInfo, ModelGraph
from placer.plan.ir import Layout, Op, OpKind
from placer.plan.layout import moves
from placer.plan.lower import lower
from placer.plan.place import place
from placer.spec.check import load_spec
from placer.spec.types import Optimizer


@pytest.mark.parametrize("op, kwargs, slots, known", [
    ("SGD", {}, 0, True),
    ("SGD", {"momentum": 0.9}, 1, True),
    ("Adam", {}, 2, True),
    ("AdamW", {"amsgrad": True}, 3, True),
    ("Adagrad", {}, 1, True),
    ("RMSprop", {}, 1, True),
    ("RMSprop", {"momentum": 0.5}, 2, True),
    ("RMSprop", {"momentum": 0.5, "centered": True}, 3, True),
    ("LBFGS", {}, 2, False),  # not known: assume 2, and say so
])
def test_optimizer_state_slots(op, kwargs, slots, known):
    assert state_slots(Optimizer(op=op, kwargs=kwargs)) == (slots, known)


def test_unknown_optimizer_is_flagged(tmp_path):
    spec, graph = _spec(tmp_path, STAGES_4.replace("{schedule}", "gpipe"), optimizer="{op: LBFGS, lr: 1}")
    est = estimate(lower(place(spec, graph), spec, graph), graph, spec.training.optimizer)
    assert not est.optimizer_known and est.notes == ("optimizer LBFGS: state size unknown, assumed 2 "
                                                     "parameter-sized buffers",)
    assert est.per_device["cuda:0"].optimizer_bytes == 2 * 400


HEAD = """\
placer: 1
name: mem
model:
  layers:
    - {name: l, op: Linear, args: [8, 8], repeat: 4}
  input: {shape: [B, 8]}
  target: {shape: [B, 8]}
  loss: MSELoss
"""
STAGES_4 = """\
devices: [cuda:0, cuda:1, cuda:2, cuda:3]
placement:
  - {layers: l.0, device: cuda:0}
  - {layers: l.1, device: cuda:1}
  - {layers: l.2, device: cuda:2}
  - {layers: l.3, device: cuda:3}
pipeline: {microbatches: 4, schedule: {schedule}}
"""
INTERLEAVED = """\
devices: [cuda:0, cuda:1]
placement:
  - {layers: l.0, device: cuda:0}
  - {layers: l.1, device: cuda:1}
  - {layers: l.2, device: cuda:0}
  - {layers: l.3, device: cuda:1}
pipeline: {microbatches: 4, schedule: interleaved_1f1b}
"""


def _spec(tmp_path, body: str, optimizer: str = "{op: SGD, lr: 0.1}"):
    path = tmp_path / "spec.yaml"
    path.write_text(HEAD + textwrap.dedent(body) + f"training: {{batch_size: 16, steps: 1, optimizer: {optimizer}}}\n")
    # every layer keeps 1600 bytes for backward over the whole batch: 400 per micro-batch of 4
    graph = ModelGraph(layers=tuple(
        LayerInfo(name=f"l.{i}", op="Linear", params=100, param_bytes=400, buffer_bytes=0, in_shape=(16, 8),
                  out_shape=(16, 8), out_bytes=512, in_bytes=512, saved_bytes=1600, flops=1000 * (i + 1))
        for i in range(4)), batch_size=16, input_shape=(16, 8), input_dtype="float32")
    return load_spec(str(path)), graph


def _activations(tmp_path, body):
    spec, graph = _spec(tmp_path, body)
    plan = lower(place(spec, graph), spec, graph)
    est = estimate(plan, graph, spec.training.optimizer)
    return [est.per_device[d].activation_bytes for d in plan.devices], est


@pytest.mark.parametrize("schedule, in_flight", [
    ("gpipe", [4, 4, 4, 4]),  # all m micro-batches forward before any backward
    ("1f1b", [4, 3, 2, 1]),  # min(m, p - stage)
])
def test_activations_in_flight(tmp_path, schedule, in_flight):
    got, est = _activations(tmp_path, STAGES_4.replace("{schedule}", schedule))
    assert got == [400 * k for k in in_flight]
    # FLOPs: 3x forward of each stage's layer, whatever the schedule; busiest is the last stage
    assert [e.flops for e in est.per_device.values()] == [3000, 6000, 9000, 12000]
    assert est.balance == pytest.approx(12000 / 7500) and est.busiest == "cuda:3"


def test_activations_in_flight_interleaved(tmp_path):
    # torch's order on rank 0: 0F0 0F1 2F0 2F1 0F2 | 2B0 0F3 2B1 2F2 0B0 ... -> 5 chunks live at most;
    # rank 1: 1F0 1F1 3F0 | 3B0 3F1 3B1 1F2 1B0 1F3 ... -> 3 chunks
    got, _ = _activations(tmp_path, INTERLEAVED)
    assert got == [5 * 400, 3 * 400]


def test_no_pipeline_keeps_everything_until_backward(tmp_path):
    got, _ = _activations(tmp_path, """\
        devices: [cuda:0, cuda:1]
        placement:
          - {layers: l.0..l.2, device: cuda:0}
          - {layers: l.3, device: cuda:1}
        """)
    # all of a device's forwards run before its backwards (saves_input is off here: no received copy)
    assert got == [3 * 1600, 1600]


# ---- communication formulas -------------------------------------------------------------------------

def test_moves_between_layouts():
    one, two, three = ("a",), ("b", "c"), ("d", "e", "f")
    # split 1200 bytes over two devices along dim 0: 600 each
    assert moves(Layout(one), Layout(two, 0), 1200) == [("a", "b", 600), ("a", "c", 600)]
    # the source is in the group: its own half stays
    assert moves(Layout(("b",)), Layout(two, 0), 1200) == [("b", "c", 600)]
    # 2 -> 3 along the same dim: b holds [0, 1/2), c [1/2, 1); d [0, 1/3), e [1/3, 2/3), f [2/3, 1)
    assert moves(Layout(two, 0), Layout(three, 0), 1200) == [
        ("b", "d", 400), ("b", "e", 200), ("c", "e", 200), ("c", "f", 400)]
    # re-split along another dim: every pair exchanges a (1/2 x 1/3) block
    assert moves(Layout(two, 1), Layout(three, 0), 1200) == [(s, t, 200) for t in three for s in two]
    # whole on each of two devices (replicated) -> each destination takes it from one holder
    assert moves(Layout(two), Layout(three, 0), 1200) == [("b", "d", 400), ("c", "e", 400), ("b", "f", 400)]
    # same layout: nothing moves
    assert moves(Layout(two, 0), Layout(two, 0), 1200) == []


def _op(kind, devices, nbytes, **kw):
    return Op(kind=kind, devices=devices, segment=0, bytes=nbytes, **kw)


def test_collective_formulas():
    g = ("a", "b", "c", "d")
    assert op_moves(_op(OpKind.ALL_REDUCE, g, 1000)) == [("a", "b", 1500), ("b", "c", 1500), ("c", "d", 1500),
                                                         ("d", "a", 1500)]  # 2(n-1)/n = 1.5
    assert sum(m[2] for m in op_moves(_op(OpKind.ALL_GATHER, g, 1000))) == 4 * 750  # (n-1)/n each
    assert sum(m[2] for m in op_moves(_op(OpKind.REDUCE_SCATTER, g, 1000))) == 4 * 750
    # 11 channels over 4: slices of 3, 3, 3, 2 travel padded to 3 channels (300 B), 3 of them each
    assert op_moves(_op(OpKind.ALL_GATHER, g, 1100, attrs={"channels": 11})) == \
        [(a, b, 900) for a, b in zip(g, g[1:] + g[:1])]
    assert op_moves(_op(OpKind.BROADCAST, g, 10, attrs={"root": "c"})) == [("c", "a", 10), ("c", "b", 10),
                                                                           ("c", "d", 10)]
    assert op_moves(_op(OpKind.REDUCE, g, 10, attrs={"root": "c"})) == [("a", "c", 10), ("b", "c", 10),
                                                                        ("d", "c", 10)]
    assert op_moves(_op(OpKind.ALL_REDUCE, ("a",), 1000)) == []
    # rows of 10 B: 3 rows cross each of the 2 boundaries (60 B in all)
    halo = dict(attrs={"prev_rows": 2, "next_rows": 1, "row_bytes": 10}, phase="fwd")
    assert op_moves(_op(OpKind.HALO, ("a", "b", "c"), 60, **halo)) == [
        ("a", "b", 20), ("b", "a", 10), ("b", "c", 20), ("c", "b", 10)]
    halo["phase"] = "bwd"  # the halo rows' gradients go back
    assert op_moves(_op(OpKind.HALO, ("a", "b"), 30, **halo)) == [("a", "b", 10), ("b", "a", 20)]
    # a pipeline's micro-batch op carries 1/m of the bytes: its rows are 1/m as long (row_bytes is the batch's)
    assert op_moves(_op(OpKind.HALO, ("a", "b"), 15, **halo)) == [("a", "b", 5), ("b", "a", 10)]


def test_via_host_goes_through_the_senders_cpu():
    copy = _op(OpKind.COPY, ("node0/cuda:0", "node1/cuda:0"), 64, src=("node0/cuda:0",), dst=("node1/cuda:0",),
               route="via_host")
    assert op_moves(copy) == [("node0/cuda:0", "node0/cpu", 64), ("node0/cpu", "node1/cuda:0", 64)]
    to_cpu = copy.with_(devices=("cuda:0", "cpu"), src=("cuda:0",), dst=("cpu",))
    assert op_moves(to_cpu) == [("cuda:0", "cpu", 64)]  # already on the host: one hop


def test_balance_ignores_idle_devices():
    assert balance({"a": 300, "b": 100, "server": 0}) == (1.5, "a", 200.0)
    assert balance({"a": 0}) == (1.0, None, 0.0)
