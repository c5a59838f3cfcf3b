"""Estimates of small specs against numbers worked out by hand (in the comments).

Conventions used below: float32 (4 bytes); Linear(i, o) has i*o + o parameters
and a forward of 2*B*i*o FLOPs (matmul only, as torch's FlopCounter counts);
the step is forward + backward = 3x forward FLOPs; ring all-reduce sends
2(n-1)/n of the bucket per device; sizes are on the global batch.
"""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("torch")

from placer.cli.plan_cmd import build_and_plan  # noqa: E402
from placer.spec.check import load_spec  # noqa: E402


def spec_head(*layers: str, input_shape: str = "[B, 8]") -> str:
    """A spec's first lines: the model of these layers, with 4-class targets."""
    listed = "".join(f"    - {layer}\n" for layer in layers)
    return (f"placer: 1\nname: hand\nmodel:\n  layers:\n{listed}  input: {{shape: {input_shape}}}\n"
            "  target: {shape: [B], dtype: int64, high: 4}\n  loss: CrossEntropyLoss\n")


FC1, ACT = "{name: fc1, op: Linear, args: [8, 16]}", "{name: act, op: ReLU}"
HEAD = spec_head(FC1, ACT, "{name: fc2, op: Linear, args: [16, 4]}")
# fc1: 8*16 + 16 = 144 params (576 B); fc2: 16*4 + 4 = 68 params (272 B); together 212 (848 B).


def plan_of(tmp_path, body: str, head: str = HEAD, optimizer: str = "{op: SGD, lr: 0.1}", batch: int = 16,
            training: str = ""):
    text = head + textwrap.dedent(body) + f"training:\n  batch_size: {batch}\n  steps: 1\n  optimizer: {optimizer}\n"
    text += training
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    graph, plan, est, _ = build_and_plan(load_spec(str(path)))
    return plan, est


def pairs(est) -> dict:
    return dict(est.comm.pairs)


def bytes_by_kind(est) -> dict:
    """{(op kind, phase): bytes sent} of the communication rows."""
    out = {}
    for r in est.comm.rows:
        out[r.op.kind.value, r.op.phase] = out.get((r.op.kind.value, r.op.phase), 0) + r.bytes
    return out


def test_working_memory_follows_the_optimizer_the_device_and_the_sync(tmp_path):
    """What torch allocates in a step besides weights, gradients, state and activations."""
    cpu_adam = """\
        devices: [cpu, cpu:1]
        placement:
          - {layers: fc1..act, device: cpu}
          - {layers: fc2, devices: [cpu, cpu:1], parallel: {mode: data, overlap: false}}
        """
    _, est = plan_of(tmp_path, cpu_adam, optimizer="{op: Adam, lr: 0.001}")
    cpu, cpu1 = est.per_device["cpu"], est.per_device["cpu:1"]
    # on CPU Adam steps one tensor at a time: two temporaries of the largest layer it steps,
    # fc1 (576 B) on cpu, fc2 (272 B) on cpu:1; no DDP (overlap: false), so no buckets
    assert (cpu.step_bytes, cpu1.step_bytes) == (2 * 576, 2 * 272)
    assert cpu.comm_bytes == cpu1.comm_bytes == 0
    _, sgd = plan_of(tmp_path, cpu_adam)
    assert sgd.per_device["cpu"].step_bytes == 0  # SGD steps in place
    _, ddp = plan_of(tmp_path, cpu_adam, optimizer="{op: Adam, lr: 0.001}")
    _, fsdp = plan_of(tmp_path, cpu_adam.replace("overlap: false", "shard: full"), optimizer="{op: Adam, lr: 0.001}")
    whole, sharded = ddp.per_device["cpu:1"], fsdp.per_device["cpu:1"]
    # FSDP2 gathers fc2 whole (272 B) and its whole gradient before reduce-scattering it, in
    # backward only: nothing held through the step, whose temporaries are of fc2's shard (136 B)
    assert sharded.comm_bytes == 0 and sharded.step_bytes == 2 * 136
    # the backward peak, running fc2: its gathered parameters and whole gradients in place of
    # the gradient shard the walk counts made there (2 * 272 - 136)
    assert sharded.backward_bytes == whole.backward_bytes - 272 + 2 * 272


def test_data_parallel_allreduce(tmp_path):
    plan, est = plan_of(tmp_path, """\
        devices: [cuda:0, cuda:1, cuda:2, cuda:3]
        placement:
          - {layers: fc1..fc2, devices: [cuda:0, cuda:1, cuda:2, cuda:3], parallel: data}
        """, optimizer="{op: Adam, lr: 0.001}")
    for d in plan.devices:
        e = est.per_device[d]
        assert (e.params, e.param_bytes, e.grad_bytes) == (212, 848, 848)
        assert e.optimizer_bytes == 2 * 848  # Adam: exp_avg + exp_avg_sq
        # saved for backward, batch 16: fc1's input 16*8*4 = 512, ReLU's output 16*16*4 = 1024
        # (fc2 saves the same tensor), and CrossEntropyLoss's log-probabilities 16*4*4 = 256;
        # each device has 1/4 of the batch: 1792 / 4
        assert e.activation_bytes == 448
        # Adam on CUDA steps all tensors at once: a sqrt of every exp_avg_sq, 848; the whole input
        # batch 16*8*4 = 512 made on every rank, 2 ahead and 1 in use; DDP's buckets, 848
        assert (e.step_bytes, e.data_bytes, e.comm_bytes) == (848, 3 * 512, 848)
        # activation gradients: 512 at most (act's output and input, 2 * 1024 / 4), on the 384
        # left once the loss's backward has freed its log-probabilities: 448 above the activations' peak
        assert e.act_grad_bytes == 384 + 512 - 448
        # backward's peak, running fc1: activations 384, its output's and input's gradients
        # (1024 + 512) / 4 less act's 256 freed, and every parameter's gradient made by then, 848:
        # 1360. The step holds every gradient and its temporaries, 848 + 848: the peak is the step's
        assert e.backward_bytes == 384 + 384 - 256 + 848
        assert e.total_bytes == 848 + 2 * 848 + 3 * 512 + 848 + 848 + 848
        # forward 2*16*8*16 + 2*16*16*4 = 4096 + 2048 = 6144; x3 for the step, / 4 devices
        assert e.flops == 4608
    # one 848-byte bucket, ring of 4: each device sends 2*3/4*848 = 1272 to the next
    assert pairs(est) == {("cuda:0", "cuda:1"): 1272, ("cuda:1", "cuda:2"): 1272,
                          ("cuda:2", "cuda:3"): 1272, ("cuda:3", "cuda:0"): 1272}
    assert est.comm.total == 4 * 1272
    assert est.balance == 1.0


def test_copies_direct_and_via_host(tmp_path):
    plan, est = plan_of(tmp_path, """\
        devices: [cuda:0, cuda:1, cuda:2]
        placement:
          - {layers: fc1, device: cuda:0}
          - {layers: act, device: cuda:1, copies: {route: via_host}}
          - {layers: fc2, device: cuda:2}
        """, optimizer="{op: SGD, lr: 0.1, kwargs: {momentum: 0.9}}")
    # fc1 -> act: fc1's output 16*16*4 = 1024 B, via the host CPU: two hops each way
    # act -> fc2: the same 1024 B, direct
    assert pairs(est) == {("cuda:0", "cpu"): 1024, ("cuda:1", "cuda:2"): 1024, ("cuda:1", "cpu"): 1024,
                          ("cuda:2", "cuda:1"): 1024, ("cpu", "cuda:0"): 1024, ("cpu", "cuda:1"): 1024}
    kinds = [(r.op.kind.value, r.op.phase, r.op.route, r.bytes) for r in est.comm.rows]
    assert sorted(kinds) == sorted([("copy", "fwd", "via_host", 2048), ("copy", "bwd", "via_host", 2048),
                                    ("copy", "fwd", "direct", 1024), ("copy", "bwd", "direct", 1024)])
    e0, e1, e2 = (est.per_device[d] for d in plan.devices)
    assert (e0.param_bytes, e0.optimizer_bytes) == (576, 576)  # SGD with momentum: one buffer
    assert (e1.param_bytes, e1.optimizer_bytes, e1.grad_bytes) == (0, 0, 0)
    assert (e2.param_bytes, e2.optimizer_bytes) == (272, 272)
    # cuda:1's ReLU saves its output (1024), the one it sends on: the boundary counts it, once;
    # cuda:2 keeps its received input (1024, fc2 saves it) and the loss's log-probabilities (256)
    assert (e0.activation_bytes, e1.activation_bytes, e2.activation_bytes) == (512, 0, 1024 + 256)
    assert e1.boundary_bytes == 4 * 1024  # its input and the gradient sent back, its output and the one received
    # FLOPs: fc1 3*4096 on cuda:0, fc2 3*2048 on cuda:2; mean over the two = 9216; busiest 12288
    assert (e0.flops, e1.flops, e2.flops) == (12288, 0, 6144)
    assert est.balance == pytest.approx(12288 / 9216)


def test_parameter_server_outside_the_group(tmp_path):
    plan, est = plan_of(tmp_path, """\
        devices: [cpu, cuda:0, cuda:1]
        placement:
          - layers: fc1..fc2
            devices: [cuda:0, cuda:1]
            parallel: {mode: data, sync: parameter_server, server: cpu, bucket_mb: 0.0005}
        """, optimizer="{op: SGD, lr: 0.1, kwargs: {momentum: 0.9}}")
    # buckets of 0.0005 MiB = 524 B, filled in reverse: fc2 (272 B), then fc1 (576 B) alone
    reduces = [r for r in est.comm.rows if r.op.kind.value == "reduce"]
    assert [(r.op.bytes, r.op.attrs["layers"]) for r in reduces] == [(272, "fc2"), (576, "fc1")]
    # grads up, weights down: 848 B per worker each way
    assert pairs(est) == {("cuda:0", "cpu"): 848, ("cuda:1", "cpu"): 848,
                          ("cpu", "cuda:0"): 848, ("cpu", "cuda:1"): 848}
    cpu, w0, w1 = (est.per_device[d] for d in plan.devices)
    assert (cpu.param_bytes, cpu.grad_bytes, cpu.optimizer_bytes, cpu.activation_bytes, cpu.flops) == \
        (848, 848, 848, 0, 0)
    for w in (w0, w1):
        assert (w.param_bytes, w.grad_bytes, w.optimizer_bytes) == (848, 848, 0)
        assert w.activation_bytes == (1536 + 256) // 2  # and the loss's log-probabilities
    assert [op.kind.value for op in plan.ops["cpu"]] == ["reduce", "reduce", "step", "broadcast", "broadcast"]


@pytest.mark.parametrize("schedule, in_flight", [("gpipe", (4, 4)), ("1f1b", (2, 1))])
def test_pipeline_sends_and_activations_in_flight(tmp_path, schedule, in_flight):
    plan, est = plan_of(tmp_path, f"""\
        devices: [cuda:0, cuda:1]
        placement:
          - {{layers: fc1..act, device: cuda:0}}
          - {{layers: fc2, device: cuda:1}}
        pipeline: {{microbatches: 4, schedule: {schedule}}}
        """)
    # the ReLU output, 16*16*4 = 1024 B, crosses in 4 micro-batches of 256 B, and its gradient back
    sends = [(r.op.phase, r.op.microbatch, r.bytes) for r in est.comm.rows if r.op.kind.value == "send"]
    assert sorted(sends) == sorted([(p, mb, 256) for p in ("bwd", "fwd") for mb in range(4)])
    assert pairs(est) == {("cuda:0", "cuda:1"): 1024, ("cuda:1", "cuda:0"): 1024}
    # per micro-batch: stage 0 keeps (512 + 1024) / 4 = 384, stage 1 its received input 1024 / 4 = 256
    # and the loss's log-probabilities 256 / 4; GPipe holds all 4 micro-batches, 1F1B min(m, p - stage) = 2 and 1
    assert est.per_device["cuda:0"].activation_bytes == in_flight[0] * 384
    assert est.per_device["cuda:1"].activation_bytes == in_flight[1] * (256 + 64)
    # FLOPs do not depend on the micro-batching: 3 * 4096 and 3 * 2048
    assert (est.per_device["cuda:0"].flops, est.per_device["cuda:1"].flops) == (12288, 6144)


CHANNEL_HEAD = spec_head(FC1, ACT, "{name: fc2, op: Linear, args: [16, 8]}", "{name: head, op: Linear, args: [8, 4]}")
# fc1: 144 params; fc2: 16*8 + 8 = 136; head: 8*4 + 4 = 36


def test_channel_parallel(tmp_path):
    plan, est = plan_of(tmp_path, """\
        devices: [cuda:0, cuda:1]
        placement:
          - {layers: fc1..fc2, devices: [cuda:0, cuda:1], parallel: channel}
          - {layers: head, device: cuda:0}
        """, head=CHANNEL_HEAD)
    rows = bytes_by_kind(est)
    # fc2 needs all 16 channels of its input (16*16*4 = 1024 B), and the segment leaves its whole
    # output (16*8*4 = 512 B) on both devices: two all-gathers, each device sends half of each
    assert rows[("all_gather", "fwd")] == 1024 + 512
    # fc2's input gradient is the sum of both halves' parts: an all-reduce, 1024 B from each device
    # (fc1 reads the model input, which has no gradient)
    assert rows[("all_reduce", "bwd")] == 2 * 1024
    assert ("reduce_scatter", "bwd") not in rows
    # cuda:0 already holds the whole output; the head's input gradient goes whole to cuda:1
    assert rows.get(("merge", "fwd"), 0) == 0
    assert rows[("split", "bwd")] == 512
    e0, e1 = est.per_device["cuda:0"], est.per_device["cuda:1"]
    assert e1.params == 144 // 2 + 136 // 2  # half the output channels of fc1 and fc2
    assert e0.params == e1.params + 36
    # every device computes half the channels of the whole batch: 3 * (4096 + 2*16*16*8) / 2
    assert e1.flops == 3 * (4096 + 4096) // 2
    assert e0.flops == e1.flops + 3 * 2 * 16 * 8 * 4


def test_tensor_parallel(tmp_path):
    plan, est = plan_of(tmp_path, """\
        devices: [cuda:0, cuda:1]
        placement:
          - {layers: fc1..fc2, devices: [cuda:0, cuda:1], parallel: tensor}
          - {layers: head, device: cuda:0}
        """, head=CHANNEL_HEAD)
    ar = [(r.op.phase, r.op.attrs["layer"], r.op.bytes, r.bytes) for r in est.comm.rows
          if r.op.kind.value == "all_reduce"]
    # one all-reduce per pair: fc2's output forward (512 B); fc1's input gradient backward (16*8*4 = 512 B)
    # only where the segment's input needs one: not here, fc1 takes the model input.
    # ring of 2: each device sends 2*1/2*512 = 512
    assert sorted(ar) == [("fwd", "fc2", 512, 1024)]
    rows = bytes_by_kind(est)
    assert rows[("merge", "fwd")] == 0  # cuda:0 already holds the whole output
    assert rows[("split", "bwd")] == 512  # the output gradient goes to cuda:1 too
    e0, e1 = est.per_device["cuda:0"], est.per_device["cuda:1"]
    # fc1 column-split: 144 / 2; fc2 row-split: weight 128 / 2 + its whole bias 8
    assert e1.params == 72 + 64 + 8
    assert e0.params == e1.params + 36


BN_HEAD = spec_head(FC1, "{name: bn, op: BatchNorm1d, args: [16]}", "{name: fc2, op: Linear, args: [16, 4]}")
# fc1 144 + bn 32 (weight, bias) + fc2 68 = 244 params = 976 B; bn buffers: mean, var (16 * 4 each) + count 8


@pytest.mark.parametrize("shard, per_device", [
    # ZeRO-1: full parameters and gradients; the optimizer state (Adam, 2 x its parameters) of
    # torch's greedy partition, largest first to the rank holding fewest: fc1's weight (512 B) on
    # cuda:0; fc2's weight (256), bn's weight and bias and fc1's bias (64 each), fc2's bias (16) on cuda:1
    ("optimizer", (976, 976, (2 * 512, 2 * 464))),
    # fully sharded: half of everything
    ("full", (488, 488, (976, 976))),
])
def test_sharded_data_parallel(tmp_path, shard, per_device):
    plan, est = plan_of(tmp_path, f"""\
        devices: [cuda:0, cuda:1]
        placement:
          - {{layers: fc1..fc2, devices: [cuda:0, cuda:1], parallel: {{mode: data, shard: {shard}}}}}
        """, head=BN_HEAD, optimizer="{op: Adam, lr: 0.001}")
    params, grads, optim = per_device
    for d, state in zip(plan.devices, optim):
        e = est.per_device[d]
        assert (e.param_bytes, e.grad_bytes, e.optimizer_bytes) == (params, grads, state)
    kinds = sorted({r.op.kind.value for r in est.comm.rows})
    if shard == "optimizer":
        # as torch's ZeroRedundancyOptimizer runs: the gradients' bucket (976 B) all-reduced, each
        # device sending 2 * (2 - 1) / 2 of it; after the step each broadcasts its half of the params
        assert kinds == ["all_reduce", "broadcast"]
        assert est.comm.total == 2 * 976 + 2 * 488
    else:  # per layer: params gathered in forward and backward, grads scattered; each device sends half
        assert kinds == ["all_gather", "reduce_scatter"]
        assert est.comm.total == 3 * 976


def test_sync_batchnorm_and_broadcast_sync(tmp_path):
    plan, est = plan_of(tmp_path, """\
        devices: [cuda:0, cuda:1]
        placement:
          - layers: fc1..fc2
            devices: [cuda:0, cuda:1]
            parallel: {mode: data, sync: broadcast, sync_batchnorm: true}
        """, head=BN_HEAD, optimizer="{op: SGD, lr: 0.1, kwargs: {momentum: 0.9}}")
    rows = [(r.op.kind.value, r.op.phase, r.op.tensor, r.op.bytes, r.bytes) for r in est.comm.rows]
    # BatchNorm statistics: (sum, sum of squares) per channel + a count, float64: 8 * (2*16 + 1) = 264;
    # backward: two float32 sums per channel, 4 * 32 = 128; ring of 2 sends it twice in all
    assert ("all_reduce", "fwd", "stats", 264, 528) in rows
    assert ("all_reduce", "bwd", "stats", 128, 256) in rows
    # broadcast sync: cuda:0 sends the weights (976 B) before forward, gets the gradients after backward
    assert ("broadcast", "fwd", "params", 976, 976) in rows
    assert ("reduce", "step", "grads", 976, 976) in rows
    e0, e1 = est.per_device["cuda:0"], est.per_device["cuda:1"]
    assert (e0.optimizer_bytes, e1.optimizer_bytes) == (976, 0)  # only the first device steps
    assert e0.buffer_bytes == e1.buffer_bytes == 16 * 4 * 2 + 8


SPATIAL = spec_head("{name: conv, op: Conv2d, args: [3, 4, 3], kwargs: {padding: 1}}", ACT,
                    "{name: flat, op: Flatten}", "{name: head, op: Linear, args: [1024, 4]}",
                    input_shape="[B, 3, 16, 16]")


def test_spatial_halo_and_split(tmp_path):
    plan, est = plan_of(tmp_path, """\
        devices: [cuda:0, cuda:1]
        placement:
          - {layers: conv..act, devices: [cuda:0, cuda:1], parallel: {mode: spatial, dim: H}}
          - {layers: flat..head, device: cuda:0}
        """, head=SPATIAL, batch=8)
    halo = [r for r in est.comm.rows if r.op.kind.value == "halo"]
    # 3x3 conv, padding 1: one row from each neighbour; a row of the input is 8*3*16*4 = 1536 B.
    # No halo of gradients goes back: the conv reads the model input, which has none
    assert [(r.op.phase, r.op.attrs["prev_rows"], r.op.attrs["next_rows"], r.bytes) for r in halo] == \
        [("fwd", 1, 1, 3072)]
    rows = bytes_by_kind(est)
    # the conv output 8*4*16*16*4 = 32768 B is merged along H on cuda:0: cuda:1 sends its half
    assert rows[("merge", "fwd")] == 16384
    assert rows[("split", "bwd")] == 16384
    # conv weights are replicated: 3*4*9 + 4 = 112 params, gradients all-reduced (448 B, ring of 2)
    assert rows[("all_reduce", "bwd")] == 2 * 448


def test_activation_gradients_at_the_backward_peak(tmp_path):
    """Backward, running fc2, then act, then fc1: the gradients of a layer's output and input are
    live beside the activations that the layers before it still keep (batch 16)."""
    one = """\
        devices: [cpu]
        placement:
          - {layers: fc1..fc2, device: cpu}
        """
    _, est = plan_of(tmp_path, one)
    e = est.per_device["cpu"]
    # kept: fc1's input 16*8*4 = 512, act's output 16*16*4 = 1024 (fc2 saves the same tensor), and
    # CrossEntropyLoss's log-probabilities 16*4*4 = 256, freed by the loss's backward, which runs first
    assert e.activation_bytes == 1536 + 256
    # the loss's backward: two gradients of its size, 512; running fc2: its output's gradient 256 and
    # its input's 1024, nothing freed yet: 1280; act: 1024 + 1024 = 2048, nothing freed yet (fc2 kept
    # nothing of its own); fc1: 1024 + 512 with act's 1024 freed: 512. The most is act's 2048, on
    # the 1536 left after the loss's backward: 1792 above the activations' peak
    assert e.act_grad_bytes == 1536 + 2048 - (1536 + 256)
    # the parameters' gradients are made as backward goes: fc2's 272 exist while act runs, fc1's
    # 576 only once fc1 does (a step starts with none). The backward peak is act's:
    # 1536 + 2048 + 272; running fc1, 1536 + 512 + 848 is less
    assert e.backward_bytes == 1536 + 2048 + 272
    # SGD steps in place: the peak is backward's, on top of the weights and the batch in use (a
    # CPU worker makes none ahead: training.prefetch auto)
    assert e.total_bytes == 848 + 512 + 1536 + 2048 + 272
    assert e.working_bytes == 512 + 2048 - 576 - 256  # (fc1's gradients are not made yet at that peak;
    # the loss's log-probabilities are among the activations, freed by then)


def test_peak_is_the_backward_or_the_step_not_both(tmp_path):
    """The optimizer step runs after backward has freed the activations: the peak takes the
    larger of the two (batch 1: activations 96 + gradients 128 < Adam's 2 x 576 on CPU)."""
    one = """\
        devices: [cpu]
        placement:
          - {layers: fc1..fc2, device: cpu}
        """
    _, est = plan_of(tmp_path, one, optimizer="{op: Adam, lr: 0.001}", batch=1)
    e = est.per_device["cpu"]
    # activations: 96 and the loss's log-probabilities, 16; the most gradients above them: act's 128
    # on the 96 left after the loss's backward
    assert (e.activation_bytes, e.act_grad_bytes, e.step_bytes) == (96 + 16, 96 + 128 - 112, 2 * 576)
    assert e.total_bytes == 848 * 4 + 32 + 2 * 576  # the batch in use: none made ahead on a CPU
    _, big = plan_of(tmp_path, one, optimizer="{op: Adam, lr: 0.001}", batch=64)
    b = big.per_device["cpu"]
    assert b.backward_bytes > b.grad_bytes + b.step_bytes
    assert b.total_bytes == 848 * 3 + 64 * 32 + b.backward_bytes


def test_spatial_conv_keeps_its_padded_band(tmp_path):
    """The halo exchange copies each band with its halo rows and the image border's padding rows;
    the conv keeps that copy for backward instead of the input the trace counted."""
    split = """\
        devices: [cpu:0, cpu:1]
        placement:
          - {layers: conv..act, devices: [cpu:0, cpu:1], parallel: {mode: spatial, dim: H}}
          - {layers: flat..head, device: cpu:0}
        """
    _, est = plan_of(tmp_path, split, head=SPATIAL, batch=8)
    whole = """\
        devices: [cpu:0]
        placement:
          - {layers: conv..head, device: cpu:0}
        """
    _, ref = plan_of(tmp_path, whole, head=SPATIAL, batch=8)
    e1 = est.per_device["cpu:1"]
    # one device keeps conv's input 8*3*16*16*4 = 24576, act's output 8*4*16*16*4 = 32768 and the
    # loss's log-probabilities 8*4*4 = 128
    assert ref.per_device["cpu:0"].activation_bytes == 24576 + 32768 + 128
    # cpu:1's band: 8 rows of H plus a halo row and a padding row, made in one copy (the conv pads
    # W itself): 8*3*10*16*4 = 15360 instead of half the input (12288). Half of act's output, 16384,
    # is the band it sends to the head: the boundary holds it (with its gradient), not the activations
    assert e1.activation_bytes == 15360 and e1.boundary_bytes == 2 * 16384


def test_boundary_tensors_stay_referenced(tmp_path):
    """The activation that crossed to the next device and the gradient that came back for it
    (and on the receiver, the input and the gradient it sent) stay referenced until the next
    step makes new ones: held on top of weights, gradients and state (batch 16)."""
    plan, est = plan_of(tmp_path, """\
        devices: [cpu, cpu:1]
        placement:
          - {layers: fc1..act, device: cpu}
          - {layers: fc2, device: cpu:1}
        """)
    # act's output = fc2's input, 16*16*4 = 1024, and its gradient
    assert est.per_device["cpu"].boundary_bytes == est.per_device["cpu:1"].boundary_bytes == 2 * 1024
    e = est.per_device["cpu:1"]
    # backward: fc2 alone, its gradients (272) made as it runs, beside its activation gradients
    assert e.backward_bytes == e.activation_bytes + e.act_grad_bytes + 272
    assert e.total_bytes == 272 + 512 + 2 * 1024 + e.backward_bytes
    _, one = plan_of(tmp_path, """\
        devices: [cpu]
        placement:
          - {layers: fc1..act, device: cpu}
          - {layers: fc2, device: cpu}
        """)
    assert one.per_device["cpu"].boundary_bytes == 0  # nothing crosses


def test_batches_made_ahead_by_device(tmp_path):
    """training.prefetch: `auto` makes no batch ahead on a CPU worker (a thread there only takes turns
    with its compute) and 2 on a GPU; a count is made ahead everywhere (whole input batch 16*8*4 = 512)."""
    two = """\
        devices: [cpu, cuda:0]
        placement:
          - {layers: fc1..act, device: cpu}
          - {layers: fc2, device: cuda:0}
        """
    _, auto = plan_of(tmp_path, two)
    assert (auto.per_device["cpu"].data_bytes, auto.per_device["cuda:0"].data_bytes) == (512, 3 * 512)
    _, four = plan_of(tmp_path, two, training="  prefetch: 4\n")
    assert four.per_device["cpu"].data_bytes == four.per_device["cuda:0"].data_bytes == 5 * 512
