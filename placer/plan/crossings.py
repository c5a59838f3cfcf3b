"""What crosses a segment boundary in a module model, found by the trace.

A module model (`model.module`) whose segments sit on one device each (or a tensor group's several,
`Mode.lockstep_group`: each runs the segment on the whole input), without a pipeline or with
a GPipe or 1F1B one, runs in lockstep (`codegen/runtime/lockstep.py`): every rank runs the parent's forward (its glue:
embedding sums, masks, rotary), a placed layer runs only on its segment's device, and every
output leaf that a layer on another device reads (directly or through glue: a hidden state,
rotary `cos`/`sin`, a skip connection) crosses to that device, once per device and call. Masks
and positions built from the batch are computed on every device and never cross. The trace
(`LayerInfo.consumers`) says which leaves reach which layers; `crossings` turns that into one
transfer per tensor and receiving device, which the plan counts and the program sends.

What lockstep cannot run is refused before any worker starts: a placed layer whose output is
not a tensor or a tuple / list of tensors (P081: the devices without it rebuild it), and a
parent's own parameter whose glue feeds layers on several devices (P082: each would train its
own copy). Other placements of module models are cut by torch.distributed.pipelining, which
passes one tensor between stages: a cut where the trace sees more is refused (P083).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from placer.diagnostics import Diagnostic
from placer.model.graph import INPUT, OUTPUT, ModelGraph
from placer.plan.ir import OpKind, PlacedSegment

ITEMSIZE = {"float64": 8, "int64": 8, "complex64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2,
            "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


@dataclass(frozen=True)
class Crossing:
    layer: str
    """The layer whose output leaf crosses."""
    leaf: int
    """The leaf's index in that output (0 for a tensor; `cos` is 0, `sin` 1 of a rotary pair)."""
    src: int
    """The producing segment."""
    dst: int
    """The first segment on the receiving device that reads it."""
    src_device: str
    dst_device: str
    shape: tuple
    """On the global batch."""
    dtype: str
    grad: bool
    """Whether it requires grad where it is made (then its gradient goes back, see `back`)."""
    calls: int = 1
    back: bool = True
    """Whether this receiver sends the gradient back: of a replicated group (tensor), which all
    hold the same gradient, only its first device does."""
    src_group: tuple = ()
    """The producing segment's devices when several (a tensor group): each runs its backward, so
    the gradient goes to each."""

    @property
    def grad_to(self) -> tuple:
        """The devices this receiver sends the gradient to (none unless `grad` and `back`)."""
        return (self.src_group or (self.src_device,)) if self.grad and self.back else ()

    @property
    def bytes(self) -> int:
        """Per step: every call's output crosses."""
        return math.prod(self.shape) * ITEMSIZE.get(self.dtype, 4) * self.calls


LOCKSTEP_SCHEDULES = ("gpipe", "1f1b")
"""The schedules lockstep runs as placer's micro-batch loops: one stage per rank, each forward
the whole model's. A rank holding several stages (interleaved, looped, V) would run a part of
one forward per action, which the model's single forward cannot do: those are cut by
torch.distributed.pipelining instead."""


def lockstep(spec, segments) -> bool:
    """Whether a module model runs in lockstep: several segments, one device each, and no
    pipeline or a GPipe or 1F1B one (placer's micro-batch loops); or, without a pipeline or with
    a GPipe one, groups that `group_blocker` lets run beside them (tensor, channel, spatial)."""
    if spec.model.inline or len(segments) < 2:
        return False
    if all(len(s.devices) == 1 for s in segments):
        return spec.pipeline is None or spec.pipeline.schedule in LOCKSTEP_SCHEDULES
    return (spec.pipeline is None or spec.pipeline.schedule == "gpipe") and all(len(s.devices) == 1 or group_blocker(segments, s.index) is None
                                         for s in segments)


def group_blocker(segments, k: int) -> str | None:
    """Why segment k (spec or plan segments), over several devices, cannot run in lockstep beside
    the others, as words after its mode; None if it can. Each rank of a group runs the segment's
    layers on the whole activation (`Mode.lockstep_group`), the others must be one device each or
    such groups, on devices no other segment uses."""
    from placer.modes import MODES

    seg = segments[k]
    if not MODES[seg.mode].lockstep_group:
        return "beside other segments"
    for other in segments:
        if other.index == k:
            continue
        if len(other.devices) > 1 and not MODES[other.mode].lockstep_group:
            return f"beside segment {other.name!r} of mode {other.mode!r} over several devices"
        shared = [d for d in other.devices if d in seg.devices]
        if shared:
            return f"beside segment {other.name!r} on its device {shared[0]!r} (give the group devices of its own)"
    return None


def per_microbatch(c: "Crossing", batch_size: int, m: int) -> int:
    """Bytes of one micro-batch's copy: a leaf whose dim 0 is the batch is cut m ways (rotary
    cos / sin, [1, seq, d], is not)."""
    return c.bytes // m if c.shape and c.shape[0] == batch_size else c.bytes


def crossings(segments, graph: ModelGraph) -> list[Crossing]:
    """Every output leaf that reaches a layer (or the loss) on another device, per receiving
    device, producers in model order. A group (tensor: every device holds the whole activation)
    sends from its first device, receives on each, and sends the gradient back from its first."""
    seg_of = {layer: s for s in segments for layer in s.layers}
    out = []
    for s in segments:
        for layer in s.layers:
            info = graph.layer(layer)
            for leaf, users in info.consumers:
                spec_leaf = info.out_leaves[leaf] if leaf < len(info.out_leaves) else None
                if spec_leaf is None:
                    continue
                dsts: dict[str, PlacedSegment] = {}
                for u in users:
                    t = segments[-1] if u == OUTPUT else seg_of[u]
                    for d in t.devices:
                        if d not in s.devices:
                            dsts.setdefault(d, t)
                shape, dtype, grad = spec_leaf
                group = s.devices if len(s.devices) > 1 else ()
                out += [Crossing(layer, leaf, s.index, t.index, s.devices[0], d, tuple(shape), dtype,
                                 bool(grad) and dtype in ("float16", "bfloat16", "float32", "float64"), info.calls,
                                 back=d == t.devices[0], src_group=group)
                        for d, t in dsts.items()]
    return out


def multi_tensor_boundaries(plan) -> list[str]:
    """Each pair of devices between which a lowered plan moves several tensors forward (a hidden
    state and rotary cos / sin, a skip connection), in words: where `run --check` points when a
    run differs."""
    leaves: dict[tuple[str, str], list[str]] = {}
    for op in plan.unique_ops():
        if "from" in op.attrs and op.phase == "fwd" and op.kind != OpKind.RECV:
            names = leaves.setdefault((op.src[0], op.dst[0]), [])
            name = f"{op.attrs['of']}[{op.attrs['leaf']}]"
            if name not in names:
                names.append(name)
    return [f"{a} -> {b} ({len(n)} tensors: {', '.join(n)})" for (a, b), n in leaves.items() if len(n) > 1]


def check(spec, graph: ModelGraph, segments) -> list[Diagnostic]:
    """P081 / P082 where lockstep cannot run the placement; P083 where the pipelining cut that
    runs it instead would have to pass more than one tensor into a stage."""
    from placer.modes import MODES

    if spec.model.inline or len(segments) < 2:
        return []
    seg_of = {layer: s for s in segments for layer in s.layers}
    if lockstep(spec, segments):
        out = []
        for s in segments:
            for layer in s.layers:
                info = graph.layer(layer)
                if info.out_kind == "other":
                    out.append(Diagnostic(
                        "P081", f"layer {layer!r} ({info.op}) returns neither a tensor nor a tuple / list of tensors; "
                        "the devices that do not run it cannot rebuild its output", spec.placement[s.index].loc,
                        "place its children instead, or the layers around it in one segment"))
        for r in graph.root_params:
            users = {(segments[-1] if u == OUTPUT else seg_of[u]).devices[0] for u in r.users if u in seg_of or
                     u == OUTPUT}
            if r.trainable and len(users) > 1:
                out.append(Diagnostic(
                    "P082", f"parameter {r.name!r} belongs to no placed layer, and the parent's forward feeds it to "
                    f"layers on {len(users)} devices ({', '.join(sorted(users))}); each would train its own copy",
                    spec.placement[0].loc, "move it into a submodule and place that, or place its users on one device"))
        return out
    out = []
    for s in segments:  # a chain group (channel) cut out of the model runs without the parent's glue
        first = graph.layer(s.layers[0])
        if len(s.devices) > 1 and MODES[s.mode].chain and first.glue_before:
            out.append(Diagnostic(
                "P087", f"segment {s.name!r}: layer {first.name!r} reads the parent's glue (work owned by no layer) "
                f"made right before it: mode {s.mode!r} runs the segment as a chain of its layers, which reads only "
                f"the previous segment's output where the model is cut by torch.distributed.pipelining",
                spec.placement[s.index].loc, "give every other segment one device (lockstep runs the glue), or "
                "start the segment after the glue"))
    for k, seg in enumerate(segments[1:], 1):
        made = [h for layer in seg.layers for h in graph.layer(layer).homes
                if (segments[0] if h == INPUT else seg_of[h]).index != k]
        made = list(dict.fromkeys(made))
        prev = segments[k - 1].layers[-1]
        if made and made != [prev]:
            s = spec.placement[k]
            out.append(Diagnostic(
                "P083", f"segment {s.name!r} reads tensors made in earlier segments at {', '.join(made)} (a layer's "
                "output, or the parent's work before it: a mask, rotary, a skip connection); a pipeline schedule or "
                "a multi-device segment cuts a module model with torch.distributed.pipelining, which passes exactly "
                f"one: {prev}'s output", s.loc,
                "place the module model one device per segment, without a pipeline or with schedule gpipe or "
                "1f1b (lockstep passes any crossing), or cut where only the hidden state crosses"))
    return out

