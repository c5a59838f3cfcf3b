"""Memory per device for one training step: parameters, gradients, optimizer state, activations.

- Parameters and gradients: the segment's trainable parameters on every device
  that holds them; channel and tensor modes hold 1/d of each split layer,
  `shard: full` 1/d of everything; a parameter server holds a full copy and
  a gradient buffer (a 2-D segment's: a copy of every slice position's slices).
- Optimizer state: `state_slots(optimizer)` parameter-sized buffers on every
  device that steps the segment (the server for parameter_server, the first
  device for broadcast sync), 1/d of it with `shard: full` or a 2-D segment's `shard: optimizer`.
  A data segment's `shard: optimizer` (ZeroRedundancyOptimizer) steps whole parameters: torch
  gives them out largest first, each to the rank holding the fewest bytes so far
  (`zero_partition`), so a rank's state and step temporaries are those of its partition.
- Activations kept for backward: the `saved_bytes` of the layers a device
  computes, times its share of the batch (1/d in every parallel mode), per
  micro-batch in flight: the peak of a walk through the device's ops where a
  forward keeps its chunk's activations and a backward frees them (GPipe: m
  micro-batches; 1F1B: min(m, p - stage); interleaved: as its order runs).
- Step temporaries (`step_bytes`): what the optimizer step allocates and frees. torch's Adam
  and AdamW step a CPU tensor at a time (a sqrt and a quotient of the largest: 2 of its size)
  and CUDA tensors all at once (`_foreach_sqrt` of every state: 1 of everything); RMSprop one.
- Batches (`data_bytes`): every rank makes each step's whole input, `prefetch` ahead (`auto`:
  none on a CPU worker, 2 on a GPU) plus
  the one in use (targets left out).
- Communication buffers (`comm_bytes`): DDP's gradient buckets (a copy of the gradients).
  FSDP2's are in backward only (`Mode.unit_buffers`, in `backward_bytes`): it reshards each unit
  after its backward, so none is left at the optimizer step. Running a unit's backward it holds
  that unit's gathered parameters and whole gradients, the unit before it gathered ahead
  (backward prefetch) and the unit after it's whole gradients (the reduce-scatter's input, waited
  for at this unit's): the live set at the bench FSDP2 spec's backward peak. The step's
  temporaries are of a parameter's shard.
- The loss (`LOSS_BUFFERS`): CrossEntropyLoss keeps its log-probabilities (the size of the last
  layer's output) from the forward to the backward, which starts with two of that size live
  (NLL's gradient and log_softmax's): the peak of a last stage whose output is a vocabulary's
  logits (TinyGPT's rank 2, inside LogSoftmaxBackward). Another loss: its output's gradient.
- Activation gradients (`act_grad_bytes`): in backward, while a layer runs, the gradient of its
  output (received from the next device where it is a segment's last) and the one of its input
  that it makes are live beside the activations still kept for the layers before it. Inside a
  layer of several ops, an inner op's output and input gradients may be larger than the layer's
  input's (an MLP's 4x wider hidden): the most of them, less what the later ops saved and
  freed (`LayerInfo.inner_grad_bytes`, found by the trace). TinyGPT's blocks: running mlp.proj's
  backward first, its output's gradient (the block's, through the residual add) and its 4x wide
  input's are live beside every activation of the block (the live set at rank 0's backward peak).
  A Conv's backward on CPU holds one more of each (oneDNN's reordered output gradient and its
  input-gradient scratch: measured, bench/memory.py).
- Copies a mode keeps (`Mode.saved_copies`): spatial's Conv/Pool save their halo-padded band.
- Lockstep glue (in `buffer_bytes`): a module model in lockstep runs the parent's forward on every
  rank, so each rank holds every root parameter and buffer (`self.pos`), those of other segments
  too (their seed values, never stepped); of the placed layers, only its own segments'.
- Boundary tensors (`boundary_bytes`): the last micro-batch's activations and gradients that
  crossed from or to another device stay referenced by the step's variables until the next step
  makes new ones: held through the optimizer step and into the next step's backward. Each counts
  once: a received output gradient is not also a gradient in flight, and a received input that
  the first layer saves as its own storage (a transformer block's, whose producer saves none:
  `keeps_received`) is among the activations, the boundary holding its gradient only. A lockstep
  rank makes that gradient at the end of its backward, sends it and lets it go with the step's
  crossings (runtime/lockstep.py): it is never beside the backward peak, nor held through the step.

- Gradients made in backward (`backward_bytes`): a step starts with none (the program zeroes
  them with `set_to_none=True`); a layer's appear when its backward runs, last layer first, and
  stay through the step. The backward peak (`backward_bytes`) is the most of activations still
  kept, activation gradients in flight and the gradients made by then, along the device's ops,
  plus FSDP2's buffers in flight.

Set-up (`setup_bytes`): the first worker of each machine builds the whole model from the seed
(runtime/seed.py) and saves it for the others, which map the file: its whole parameters and
buffers are allocated at once. On a CPU worker that is its peak where it holds a small part of
the model (bench/specs_memory/final_params_big.yaml's rank 0); a GPU worker builds it on the host.

A step's peak (`step_peak_bytes`): parameters, buffers, optimizer state, batches, communication buffers
and boundary tensors are held throughout; on top of them either the backward peak or every
gradient and the optimizer step's temporaries, whichever is larger: the step runs after backward
has freed the activations. The peak (`total_bytes`) is the larger of it and the set-up's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from placer.device import Device
from placer.model.graph import ModelGraph
from placer.modes import MODES
from placer.plan.crossings import ITEMSIZE
from placer.plan.ir import OpKind, PlacedSegment, Plan
from placer.plan.layout import in_layout
from placer.plan.place import steppers
from placer.plan.ties import copy_elements
from placer.spec.types import Optimizer, batches_ahead

KNOWN_SLOTS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Rprop": 2,
               "Adagrad": 1, "ASGD": 1}
ASSUMED_SLOTS = 2
LOSS_BUFFERS = {"CrossEntropyLoss": (1, 2)}
"""Output-sized tensors a loss keeps for backward and its backward holds at once (others: none kept,
the output's gradient): CrossEntropyLoss keeps log_softmax's output; its backward makes NLL's
gradient of it and log_softmax's of the output."""
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
    """DDP's gradient buckets (FSDP2's gathered units are in `backward_bytes`)."""
    act_grad_bytes: int = 0
    """Activation gradients live at the backward peak, beside the activations kept then."""
    boundary_bytes: int = 0
    """The last micro-batch's tensors that crossed devices, referenced until the next step's."""
    backward_bytes: int = 0
    """The backward peak: activations still kept, activation gradients in flight and the
    parameters' gradients made so far (a step starts with none: `zero_grad(set_to_none=True)`),
    and FSDP2's gathered units and whole gradients in flight."""
    setup_bytes: int = 0
    """The set-up's peak: the whole model, which the first worker of a machine builds from the
    seed (a CPU worker's; a GPU's is built on the host)."""

    @property
    def total_bytes(self) -> int:
        """The peak: the training step's (`step_peak_bytes`) or the set-up's, the larger."""
        return max(self.step_peak_bytes, self.setup_bytes)

    @property
    def step_peak_bytes(self) -> int:
        """A step's peak: what is held throughout, plus the backward peak or every gradient and
        the step's temporaries."""
        held = (self.param_bytes + self.buffer_bytes + self.optimizer_bytes
                + self.data_bytes + self.comm_bytes + self.boundary_bytes)
        return held + max(self.backward_bytes, self.grad_bytes + self.step_bytes)

    @property
    def working_bytes(self) -> int:
        """What torch allocates at the peak besides the model, its gradients, state and activations
        (none where those are never all held at once: `overlap_bytes`)."""
        return max(0, self._beyond_model)

    @property
    def overlap_bytes(self) -> int:
        """How far the model, its gradients, state and activations add up above the peak: where
        the backward peak comes before every gradient is made, they are never all held at once."""
        return max(0, -self._beyond_model)

    @property
    def _beyond_model(self) -> int:
        return (self.step_peak_bytes - self.param_bytes - self.buffer_bytes - self.grad_bytes
                - self.optimizer_bytes - self.activation_bytes)


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


def memory(plan: Plan, graph: ModelGraph, optimizer: Optimizer, prefetch: int | str = "auto",
           geometry: Callable[[str], dict | None] = lambda name: None) -> dict[str, DeviceMemory]:
    """Bytes per device for one step of the plan (`prefetch`: training.prefetch; `geometry(name)`:
    a Conv/Pool layer's kernel, stride, padding and dilation, `plan.place.layer_geometry`)."""
    slots, _ = state_slots(optimizer)
    batch = ITEMSIZE.get(graph.input_dtype, 4)
    for n in graph.input_shape:
        batch *= n
    acc = {dev: dict(params=0, param_bytes=0, buffer_bytes=0, grad_bytes=0, optimizer_bytes=0, step_bytes=0,
                     data_bytes=batch * (batches_ahead(prefetch, Device.parse(dev).is_host) + 1), comm_bytes=0,
                     unit_bytes=0)
           for dev in plan.devices}
    temps = STEP_TEMPORARIES.get(optimizer.op, 0)
    made: dict[str, dict[int, list[int]]] = {dev: {} for dev in plan.devices}  # gradient bytes per layer
    for seg in plan.segments:
        server = seg.server
        holders = seg.devices + ((server,) if server and server not in seg.devices else ())
        stepping = steppers(seg)
        # the slices at each position (the first replica's devices), which a 2-D segment's server copies
        # (spatial's devices hold the whole weights: its server one copy of them, as data's)
        copies = [held_params(seg, graph, dev)[:2] for dev in seg.devices[:len(seg.devices) // seg.options["data"]]] \
            if server and seg.options.get("data", 1) > 1 and MODES[seg.mode].holds_slices else []
        shard = seg.options.get("shard", "none")  # (data's option, and a 2-D tensor segment's)
        for dev in holders:
            n, b, buf = held_params(seg, graph, dev) if dev in seg.devices or not copies else (0, 0, 0)
            if dev == server and copies:  # a 2-D segment's server: a copy of every position's slices too
                n, b = n + sum(k for k, _ in copies), b + sum(kb for _, kb in copies)
            a = acc[dev]
            a["params"] += n
            a["param_bytes"] += b
            a["buffer_bytes"] += buf
            a["grad_bytes"] += b  # computed here, or (a server) summed into here
            per_layer = [kb for _, kb, _ in held_layers(seg, graph, dev)]
            made[dev][seg.index] = layer_grads(per_layer, b)
            largest = max(per_layer, default=0)
            a["comm_bytes"] += MODES[seg.mode].comm_buffers(seg, b, largest)
            reps = seg.options.get("data", len(seg.devices))  # the shards of `shard: full`
            a["unit_bytes"] += MODES[seg.mode].unit_buffers(seg, per_layer, reps)
            if shard == "full":  # the step runs on each parameter's shard
                largest = -(-largest // reps)
            if dev in stepping:
                r, d = seg.devices.index(dev) if dev in seg.devices else 0, len(seg.devices)
                state = slots * (sum(kb for _, kb in copies) if copies else b)  # (a server steps its copies only)
                if MODES[seg.mode].zero_whole(seg):  # ZeroRedundancyOptimizer's partition
                    b, largest = zero_partition(param_sizes(seg, graph), d)[r]
                    state = slots * b
                elif shard == "optimizer":  # a 2-D segment's over its replicas (ZeroSlices)
                    state = _share(state, reps, r // (d // reps))
                a["optimizer_bytes"] += state
                step = temps * b // 2 if dev.split("/")[-1].startswith("cuda") else temps * largest
                a["step_bytes"] = max(a["step_bytes"], step)
    glues = lockstep_glue(plan, graph)
    for dev, glue in glues.items():
        acc[dev]["buffer_bytes"] += glue
    act = activations(plan, graph, geometry, made)
    builders: dict[str, str] = {}  # each machine's first worker (its LOCAL_RANK 0) builds the seed model
    for dev in plan.devices:
        builders.setdefault(dev.rpartition("/")[0], dev)
    whole = (sum(l.param_bytes + l.buffer_bytes for l in graph.layers) + sum(r.bytes for r in graph.root_params))
    return {dev: DeviceMemory(activation_bytes=act[dev][0], act_grad_bytes=act[dev][1],
                              backward_bytes=act[dev][2] + acc[dev].pop("unit_bytes"),
                              boundary_bytes=boundary(plan, graph, dev, bool(glues)), **acc[dev],
                              setup_bytes=whole if dev in builders.values() and Device.parse(dev).is_host else 0)
            for dev in plan.devices}


def param_sizes(seg: PlacedSegment, graph: ModelGraph) -> list[int]:
    """Bytes of each trainable parameter of a segment held whole: its layers' and the root ones it consumes."""
    return ([rows * row for name in seg.layers for rows, row in graph.layer(name).param_rows]
            + [r.bytes for r in graph.root_params if r.trainable and r.consumer in seg.layers])


def zero_partition(sizes: list[int], d: int) -> list[tuple[int, int]]:
    """(bytes, the largest parameter's) each of d ranks steps under ZeroRedundancyOptimizer: torch
    gives the parameters out largest first, each to the rank holding the fewest so far (a tie:
    the lowest rank)."""
    held, largest = [0] * d, [0] * d
    for size in sorted(sizes, reverse=True):
        r = held.index(min(held))
        held[r], largest[r] = held[r] + size, max(largest[r], size)
    return list(zip(held, largest))


def lockstep_glue(plan: Plan, graph: ModelGraph) -> dict[str, int]:
    """Bytes of the root parameters and buffers each device holds for the parent's glue beyond
    its own segments' (lockstep only: its copies name the output leaf they carry)."""
    if not any("leaf" in op.attrs for op in plan.unique_ops()):
        return {}
    glue = {}
    for dev in plan.devices:
        own = {name for seg in plan.segments if dev in seg.devices for name in seg.layers}
        glue[dev] = sum(r.bytes for r in graph.root_params if r.consumer not in own)
    return glue


def boundary(plan: Plan, graph: ModelGraph, dev: str, lockstep: bool = False) -> int:
    """Bytes of one micro-batch's activations and gradients crossing the boundaries of the
    segments `dev` runs, where the neighbour runs on other devices: the input received and the
    gradient sent back for it, the output sent and the gradient received for it. In lockstep the
    input's gradient is made at the end of its backward, sent, and let go with the step's crossings."""
    total = 0
    for seg in plan.segments:
        if dev not in seg.devices:
            continue
        share = seg.degree * plan.microbatches * plan.accumulate
        if seg.index > 0 and plan.segments[seg.index - 1].devices != seg.devices:
            held = (not keeps_received(plan, graph, seg)) + (not lockstep)  # the input, its gradient
            total += held * graph.layer(seg.layers[0]).in_bytes // share
        if sends_output(plan, seg):  # the output (a saved one: not among the activations) and its gradient
            total += 2 * graph.layer(seg.layers[-1]).out_bytes // share
    return total


def keeps_received(plan: Plan, graph: ModelGraph, seg: PlacedSegment) -> bool:
    """Whether the segment's first layer saves the input it receives from another device as the
    storage its `saved_bytes` already counts (the producer does not save it as its own output,
    so the trace counted it here): the activations hold it once, the boundary its gradient only."""
    prev = plan.segments[seg.index - 1]
    return (len(prev.devices) == len(seg.devices) == 1 and prev.devices != seg.devices  # a plain copy, no split
            and graph.layer(seg.layers[0]).saves_input and not graph.layer(prev.layers[-1]).saves_output)


def saved_layers(plan: Plan, graph: ModelGraph, seg: PlacedSegment, layers,
                 geometry: Callable[[str], dict | None] = lambda name: None) -> list[int]:
    """Activation bytes each layer of a chunk of a segment keeps for backward (global batch).

    A segment whose input arrived from elsewhere also keeps that copy when its first layer
    saves its input and the producer saved it too (its storage counted there and staying there;
    else `keeps_received`: the trace counted it for this layer already); a mode's own copies
    (`Mode.saved_copies`) count for the layer that keeps them."""
    info = [graph.layer(l) for l in layers]
    extra = MODES[seg.mode].saved_copies(seg, info, len(seg.devices), geometry)
    out = [l.saved_bytes + x for l, x in zip(info, extra)]
    first = graph.layer(seg.layers[0])
    if layers and layers[0] == seg.layers[0] and first.saves_input and seg.index > 0:
        prev = plan.segments[seg.index - 1]
        if in_layout(prev) != in_layout(seg) and not keeps_received(plan, graph, seg):
            out[0] += first.in_bytes
    last = graph.layer(seg.layers[-1])
    if (layers and layers[-1] == seg.layers[-1] and sends_output(plan, seg) and last.saves_output
            and plan.microbatches * plan.accumulate == 1):
        # the output it saves is the one the boundary counts (the program holds it until the next
        # step): not twice. With micro-batches the boundary holds the last one's only.
        out[-1] -= min(out[-1], last.out_bytes)
    return out


def sends_output(plan: Plan, seg: PlacedSegment) -> bool:
    """Whether the segment's output goes to other devices (the next segment runs elsewhere)."""
    return seg.index + 1 < len(plan.segments) and plan.segments[seg.index + 1].devices != seg.devices


def saved_bytes(plan: Plan, graph: ModelGraph, seg: PlacedSegment, layers) -> int:
    """Activation bytes a chunk of a segment keeps for backward (global batch)."""
    return sum(saved_layers(plan, graph, seg, layers))


def layer_grads(held: list[int], total: int) -> list[int]:
    """`total` gradient bytes of a segment on a device, spread over its layers as the parameter
    bytes it holds of each (`held`: a layer's gradients are made when its backward runs); what no
    layer holds (a root parameter, a tied copy) goes with the last layer, whose backward runs first."""
    whole = sum(held)
    out = [total * kb // whole for kb in held] if whole else [0] * len(held)
    if out:
        out[-1] += total - sum(out)
    return out


def grads_in_flight(saved: list[int], info, share: int, made: list[int] | None = None, received: int = 0) -> int:
    """The most that a chunk's backward holds above the activations kept before it starts, minus
    what it has freed: running layer i (last first), the layers after it have freed theirs and
    the gradients of i's output and of its input are live (one micro-batch's: `share`), and so
    are the parameters' gradients that i and the layers after it have made (`made`, per layer).
    `received`: bytes of the last layer's output gradient that the boundary counts (received)."""
    freed, most, grads = 0, 0, 0
    for s, l, g in zip(reversed(saved), reversed(info), reversed(made or [0] * len(info))):
        scratch = 2 if l.op.startswith("Conv") else 1  # a Conv's backward: one more of each (above)
        grads += g
        pair = scratch * max(l.out_bytes + l.in_bytes, l.inner_grad_bytes) - (received if not freed else 0)
        most = max(most, pair // share - freed + grads)
        freed += s // share
    return most


def activations(plan: Plan, graph: ModelGraph,
                geometry: Callable[[str], dict | None] = lambda name: None,
                made: dict[str, dict[int, list[int]]] | None = None) -> dict[str, tuple[int, int, int]]:
    """(peak activation bytes, activation gradients on top of them at the backward peak, the
    backward peak with the parameters' gradients made by then) per device: walk its ops,
    forwards keep, backwards free; a chunk's first backward makes its layers' gradients
    (`made`: device -> segment -> gradient bytes per layer), held from then on. A device's
    gradients that no backward of its own makes (a parameter server's) are there throughout."""
    out = {}
    m = plan.microbatches
    last = graph.layers[-1]
    loss_kept, loss_grads = LOSS_BUFFERS.get(graph.loss, (0, 1)) if graph.loss else (0, 0)
    for dev in plan.devices:
        per_layer = (made or {}).get(dev, {})
        ops = [op for op in plan.ops.get(dev, ()) if op.kind == OpKind.COMPUTE]
        backs = {op.segment for op in ops if op.phase != "fwd"}
        grads = sum(sum(g) for k, g in per_layer.items() if k not in backs)
        done: set[tuple[int, tuple[str, ...]]] = set()  # chunks whose gradients exist
        live = peak = grad_peak = top = 0  # grad_peak: of activations and their gradients; top: and parameters' gradients
        for op in ops:
            seg = plan.segments[op.segment]
            layers = plan.chunk_layers(op)
            new = [0] * len(layers)
            if op.phase in ("bwd", "bwd_weight") and (seg.index, tuple(layers)) not in done:
                done.add((seg.index, tuple(layers)))
                mine = dict(zip(seg.layers, per_layer.get(seg.index, [0] * len(seg.layers))))
                new = [mine[name] for name in layers]
            if op.phase == "bwd_weight":  # a zero-bubble backward's second half makes the gradients
                grads += sum(new)
                top = max(top, live + grads)
                continue
            share = seg.degree * m * plan.accumulate  # one micro-batch's (a pipeline's, or a micro-step's)
            share *= 2 if plan.precision == "bf16" else 1  # autocast saves bfloat16 activations
            saved = saved_layers(plan, graph, seg, layers, geometry)
            b = sum(saved) // share
            if layers[-1] == last.name:  # the loss: kept from its forward to its backward, which runs first
                loss = loss_kept * last.out_bytes // share
                if op.phase == "fwd":
                    live += loss
                else:
                    grad_peak = max(grad_peak, live + loss_grads * last.out_bytes // share)
                    top = max(top, live + grads + loss_grads * last.out_bytes // share)
                    live -= loss
            if op.phase != "fwd":
                info = [graph.layer(l) for l in layers]
                unscaled = share // (2 if plan.precision == "bf16" else 1)
                before = live + (b if seg.recompute else 0)
                # the output gradient received from the next device: the boundary counts it (one micro-batch;
                # a plain copy between single devices: a split or merge makes its own)
                got = (info[-1].out_bytes if layers[-1] == seg.layers[-1] and sends_output(plan, seg)
                       and m * plan.accumulate == 1 and len(seg.devices) == len(plan.segments[seg.index + 1].devices) == 1
                       else 0)
                grad_peak = max(grad_peak, before + grads_in_flight(saved, info, unscaled, received=got))
                top = max(top, before + grads + grads_in_flight(saved, info, unscaled, new, got))
                grads += sum(new)
            if seg.recompute:  # forward keeps the chunk's input; backward holds b again while it runs
                kept = graph.layer(layers[0]).in_bytes // share
                if op.phase != "fwd":
                    peak = max(peak, live + b)
                b = kept
            live += b if op.phase == "fwd" else -b
            peak = max(peak, live)
            top = max(top, live + grads)
        out[dev] = (peak, max(0, grad_peak - peak), top)
    return out
