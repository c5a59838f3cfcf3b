"""Memory per device for one training step: parameters, gradients, optimizer state, activations.

- Parameters and gradients: the segment's trainable parameters on every device
  that holds them; channel and tensor modes hold 1/d of each split layer,
  `shard: full` 1/d of everything; a parameter server holds a full copy and
  a gradient buffer.
- Optimizer state: `state_slots(optimizer)` parameter-sized buffers on every
  device that steps the segment (the server for parameter_server, the first
  device for broadcast sync), 1/d of it with `shard: optimizer` or `full`.
- Activations kept for backward: the `saved_bytes` of the layers a device
  computes, times its share of the batch (1/d in every parallel mode), per
  micro-batch in flight: the peak of a walk through the device's ops where a
  forward keeps its chunk's activations and a backward frees them (GPipe: m
  micro-batches; 1F1B: min(m, p - stage); interleaved: as its order runs).
- Step temporaries (`step_bytes`): what the optimizer step allocates and frees. torch's Adam
  and AdamW step a CPU tensor at a time (a sqrt and a quotient of the largest: 2 of its size)
  and CUDA tensors all at once (`_foreach_sqrt` of every state: 1 of everything); RMSprop one.
- Batches (`data_bytes`): every rank makes each step's whole input, `prefetch` ahead plus
  the one in use (targets left out).
- Communication buffers (`comm_bytes`): DDP's gradient buckets (a copy of the gradients);
  FSDP2 gathers one unit's whole parameters and its whole gradients before reduce-scatter.
"""
from __future__ import annotations

from dataclasses import dataclass

from placer.model.graph import ModelGraph
from placer.modes import MODES
from placer.plan.crossings import ITEMSIZE
from placer.plan.ir import OpKind, PlacedSegment, Plan
from placer.plan.layout import in_layout
from placer.plan.place import steppers
from placer.plan.ties import copy_elements
from placer.spec.types import Optimizer

KNOWN_SLOTS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Rprop": 2,
               "Adagrad": 1, "ASGD": 1}
ASSUMED_SLOTS = 2
STEP_TEMPORARIES = {"Adam": 2, "AdamW": 2, "RMSprop": 1}
"""Parameter-sized temporaries of one tensor's step on CPU (on CUDA, foreach: half as many of all)."""


def state_slots(opt: Optimizer) -> tuple[int, bool]:
    """(parameter-sized state buffers per parameter, whether that is known for this optimizer).

    SGD: a momentum buffer if momentum > 0; Adam/AdamW: exp_avg, exp_avg_sq (+ max_exp_avg_sq with
    amsgrad); RMSprop: square_avg (+ momentum_buffer, + grad_avg if centered); others assume 2."""
    kw = opt.kwargs
    if opt.op == "SGD":
        return (1 if kw.get("momentum", 0) else 0), True
    if opt.op in ("Adam", "AdamW"):
        return 2 + bool(kw.get("amsgrad")), True
    if opt.op == "RMSprop":
        return 1 + bool(kw.get("momentum", 0)) + bool(kw.get("centered")), True
    if opt.op in KNOWN_SLOTS:
        return KNOWN_SLOTS[opt.op], True
    return ASSUMED_SLOTS, False


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    params: int = 0
    """Trainable parameter elements held."""
    param_bytes: int = 0
    buffer_bytes: int = 0
    """Buffers (BatchNorm running statistics) and frozen parameters."""
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0
    """Peak bytes of activations kept for backward."""
    step_bytes: int = 0
    """The optimizer step's temporaries."""
    data_bytes: int = 0
    """Batches made ahead and the one in use."""
    comm_bytes: int = 0
    """DDP's gradient buckets, FSDP2's gathered unit."""

    @property
    def working_bytes(self) -> int:
        """What torch allocates besides the model, its gradients, state and activations."""
        return self.step_bytes + self.data_bytes + self.comm_bytes

    @property
    def total_bytes(self) -> int:
        return (self.param_bytes + self.buffer_bytes + self.grad_bytes + self.optimizer_bytes
                + self.activation_bytes + self.working_bytes)


def _share(x: int, d: int, r: int) -> int:
    """Rank r's part of x split d ways (the first x % d ranks take one more)."""
    return x // d + (r < x % d)


def _roots(seg: PlacedSegment, graph: ModelGraph) -> tuple[int, int, int]:
    """(elements, bytes, buffer bytes) of root parameters / buffers the segment consumes."""
    n = b = buf = 0
    for r in graph.root_params:
        if r.consumer in seg.layers:
            if r.trainable:
                n, b = n + r.numel, b + r.bytes
            else:
                buf += r.bytes
    return n, b, buf


def held_layers(seg: PlacedSegment, graph: ModelGraph, device: str) -> list[tuple[int, int, int]]:
    """(parameter elements, parameter bytes, buffer bytes) of each layer of a segment that
    `device` holds (before `shard: full`)."""
    d = len(seg.devices)
    r = seg.devices.index(device) if device in seg.devices else 0
    info = [graph.layer(x) for x in seg.layers]
    return [(k, k * l.param_bytes // l.params if l.params else 0, kb)
            for l, (k, kb) in zip(info, MODES[seg.mode].held(seg, info, d, r, _share))]


def held_params(seg: PlacedSegment, graph: ModelGraph, device: str) -> tuple[int, int, int]:
    """(parameter elements, parameter bytes, buffer bytes) of a segment that `device` holds."""
    d = len(seg.devices)
    r = seg.devices.index(device) if device in seg.devices else 0
    n = b = buf = 0
    for k, kb, bb in held_layers(seg, graph, device):
        n, b, buf = n + k, b + kb, buf + bb
    rn, rb, rbuf = _roots(seg, graph)
    tn, tb = copy_elements(seg, graph)  # its own copy of a parameter tied to another segment's layer
    n, b, buf = n + rn + tn, b + rb + tb, buf + rbuf
    if seg.options.get("shard") == "full":  # sharded over the data replicas: a 2-D segment's are runs of devices
        reps = seg.options.get("data", d)
        n, b = _share(n, reps, r // (d // reps)), _share(b, reps, r // (d // reps))
    return n, b, buf


def memory(plan: Plan, graph: ModelGraph, optimizer: Optimizer, prefetch: int = 2) -> dict[str, DeviceMemory]:
    """Bytes per device for one step of the plan (`prefetch`: training.prefetch)."""
    slots, _ = state_slots(optimizer)
    batch = ITEMSIZE.get(graph.input_dtype, 4)
    for n in graph.input_shape:
        batch *= n
    acc = {dev: dict(params=0, param_bytes=0, buffer_bytes=0, grad_bytes=0, optimizer_bytes=0, step_bytes=0,
                     data_bytes=batch * (prefetch + 1), comm_bytes=0) for dev in plan.devices}
    temps = STEP_TEMPORARIES.get(optimizer.op, 0)
    for seg in plan.segments:
        server = seg.server
        holders = seg.devices + ((server,) if server and server not in seg.devices else ())
        stepping = steppers(seg)
        shard = seg.options.get("shard", "none")  # (data's option, and a 2-D tensor segment's)
        for dev in holders:
            n, b, buf = held_params(seg, graph, dev)
            a = acc[dev]
            a["params"] += n
            a["param_bytes"] += b
            a["buffer_bytes"] += buf
            a["grad_bytes"] += b  # computed here, or (a server) summed into here
            largest = max((kb for _, kb, _ in held_layers(seg, graph, dev)), default=0)
            a["comm_bytes"] += MODES[seg.mode].comm_buffers(seg, b, largest)
            if dev in stepping:
                r, d = seg.devices.index(dev) if dev in seg.devices else 0, len(seg.devices)
                state = slots * b
                a["optimizer_bytes"] += _share(state, d, r) if shard == "optimizer" else state
                step = temps * b // 2 if dev.split("/")[-1].startswith("cuda") else temps * largest
                a["step_bytes"] = max(a["step_bytes"], step)
    act = activations(plan, graph)
    return {dev: DeviceMemory(activation_bytes=act[dev], **acc[dev]) for dev in plan.devices}


def saved_bytes(plan: Plan, graph: ModelGraph, seg: PlacedSegment, layers) -> int:
    """Activation bytes a chunk of a segment keeps for backward (global batch).

    A segment whose input arrived from elsewhere also keeps that copy when its first layer
    saves its input (the producer's saved storage stays on the producer)."""
    total = sum(graph.layer(l).saved_bytes for l in layers)
    first = graph.layer(seg.layers[0])
    if layers and layers[0] == seg.layers[0] and first.saves_input and seg.index > 0:
        prev = plan.segments[seg.index - 1]
        if in_layout(prev) != in_layout(seg):
            total += first.in_bytes
    return total


def activations(plan: Plan, graph: ModelGraph) -> dict[str, int]:
    """Peak activation bytes per device: walk its ops, forwards keep, backwards free."""
    out = {}
    m = plan.microbatches
    for dev in plan.devices:
        live = peak = 0
        for op in plan.ops.get(dev, ()):
            if op.kind != OpKind.COMPUTE or op.phase in ("bwd_weight",):
                continue
            seg = plan.segments[op.segment]
            share = seg.degree * m * plan.accumulate  # one micro-batch's (a pipeline's, or a micro-step's)
            share *= 2 if plan.precision == "bf16" else 1  # autocast saves bfloat16 activations
            b = saved_bytes(plan, graph, seg, plan.chunk_layers(op)) // share
            if seg.recompute:  # forward keeps the chunk's input; backward holds b again while it runs
                kept = graph.layer(plan.chunk_layers(op)[0]).in_bytes // share
                if op.phase != "fwd":
                    peak = max(peak, live + b)
                b = kept
            live += b if op.phase == "fwd" else -b
            peak = max(peak, live)
        out[dev] = peak
    return out
