"""What crosses a segment boundary in a module model, found by the trace.

A module model (`model.module`) whose segments sit on one device each (or are data parallel over
groups of one size: one replica pipeline per group position), without a pipeline or under any
schedule, runs in lockstep (`codegen/runtime/lockstep.py`): every rank runs the parent's forward
(its glue: embedding sums, masks, rotary), a placed layer runs only on its segment's device, and every
output leaf that a layer on another device reads (directly or through glue: a hidden state,
rotary `cos`/`sin`, a skip connection) crosses to that device, once per device and call. Masks
and positions built from the batch are computed on every device and never cross. The trace
(`LayerInfo.consumers`) says which leaves reach which layers; `crossings` turns that into one
transfer per tensor and receiving device, which the plan counts and the program sends. With
data-parallel segments each replica pipeline (the r-th device of every segment) takes 1/D of the
batch and sends to its own peers only.

What lockstep cannot run is refused before any worker starts: a placed layer whose output is
not a tensor or a tuple / list of tensors (P081: the devices without it rebuild it), and a
parent's own parameter whose glue feeds layers on several devices (P082: each would train its
own copy). Other placements of module models (channel / tensor / spatial groups, groups of
different sizes, data groups that shard or sync otherwise) are cut by torch.distributed.pipelining,
which passes one tensor between stages: a cut where the trace sees more is refused (P083), saying
why lockstep does not run it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from placer.diagnostics import Diagnostic
from placer.model.graph import INPUT, OUTPUT, ModelGraph
from placer.modes import MODES
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
    """The segment on the receiving device whose work receives it: its first after the producer's
    (where the forward reaches the producing layer's stand-in on that device)."""
    src_device: str
    dst_device: str
    shape: tuple
    """On the global batch."""
    dtype: str
    grad: bool
    """Whether its gradient goes back (it requires grad where it is made)."""
    calls: int = 1

    @property
    def bytes(self) -> int:
        """Per step: every call's output crosses."""
        return math.prod(self.shape) * ITEMSIZE.get(self.dtype, 4) * self.calls


def lockstep(spec, segments) -> bool:
    """Whether a module model runs in lockstep: several segments, one device each or each data
    parallel over the same number of devices (`replica_blocker` says which), without a pipeline
    or under any schedule (placer's micro-batch loops; a rank holding several stages runs each
    micro-batch's forward in a thread that waits for the schedule's action of its next stage)."""
    if spec.model.inline or len(segments) < 2 or len({len(s.devices) for s in segments}) != 1:
        return False
    return len(segments[0].devices) == 1 or replica_blocker(spec, segments) is None


def replica_blocker(spec, segments) -> str | None:
    """Why multi-device segments of a module model cannot run as replica pipelines in lockstep,
    or None. Each group must hold whole replicas that cut the batch (data) and sync by an
    all-reduce of whole gradients after the lockstep backward (placer's buckets, no DDP: the
    segment's layers run inside the whole model's forward), as a stage torch's schedules run
    replicated; and a device keeps one place in every group (its pipeline)."""
    for s in segments:
        seg = spec.placement[s.index]
        mode = MODES[seg.mode]
        if mode.data_degree(len(s.devices)) != len(s.devices):
            return f"segment {s.name!r} is {seg.mode} over {len(s.devices)} devices"
        why = mode.torch_pipeline_blocker(seg.parallel)
        if why:
            return f"segment {s.name!r} is {why}"
    place: dict[str, int] = {}
    for s in segments:
        for r, d in enumerate(s.devices):
            if place.setdefault(d, r) != r:
                return f"device {d!r} is number {place[d] + 1} of one group and number {r + 1} of segment {s.name!r}'s"
    return None


def pipelines(segments) -> list[tuple[str, ...]]:
    """The replica pipelines of a lockstep placement: the r-th device of every segment."""
    return [tuple(s.devices[r] for s in segments) for r in range(len(segments[0].devices))]


def per_microbatch(c: "Crossing", batch_size: int, m: int) -> int:
    """Bytes of one micro-batch's copy: a leaf whose dim 0 is the batch is cut m ways (rotary
    cos / sin, [1, seq, d], is not). `batch_size`: a replica pipeline's."""
    return c.bytes // m if c.shape and c.shape[0] == batch_size else c.bytes


def crossings(segments, graph: ModelGraph, batch_size: int = 0) -> list[Crossing]:
    """Every output leaf that reaches a layer (or the loss) on another device, per replica
    pipeline and receiving device, producers in model order. With D replicas, a leaf whose dim 0
    is the batch (`batch_size`) carries a replica's 1/D of it."""
    seg_of = {layer: s for s in segments for layer in s.layers}
    n = len(segments[0].devices)
    held: dict[str, list] = {}  # device -> its segments, in order
    for s in segments:
        for d in s.devices:
            held.setdefault(d, []).append(s)
    out = []
    for s in segments:
        for layer in s.layers:
            info = graph.layer(layer)
            for leaf, users in info.consumers:
                spec_leaf = info.out_leaves[leaf] if leaf < len(info.out_leaves) else None
                if spec_leaf is None:
                    continue
                shape, dtype, grad = spec_leaf
                shape = tuple(shape)
                if n > 1 and shape and shape[0] == batch_size:
                    shape = (batch_size // n, *shape[1:])
                for r in range(n):
                    dsts: dict[str, PlacedSegment] = {}
                    for u in users:
                        t = segments[-1] if u == OUTPUT else seg_of[u]
                        d = t.devices[r]
                        if d != s.devices[r]:
                            dsts.setdefault(d, next(x for x in held[d] if x.index > s.index))
                    out += [Crossing(layer, leaf, s.index, t.index, s.devices[r], d, shape, dtype,
                                     bool(grad) and dtype in ("float16", "bfloat16", "float32", "float64"),
                                     info.calls) for d, t in dsts.items()]
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
    why = _why_cut(spec, segments)
    for k, seg in enumerate(segments[1:], 1):
        made = [h for layer in seg.layers for h in graph.layer(layer).homes
                if (segments[0] if h == INPUT else seg_of[h]).index != k]
        made = list(dict.fromkeys(made))
        prev = segments[k - 1].layers[-1]
        if made and made != [prev]:
            s = spec.placement[k]
            out.append(Diagnostic(
                "P083", f"segment {s.name!r} reads tensors made in earlier segments at {', '.join(made)} (a layer's "
                f"output, or the parent's work before it: a mask, rotary, a skip connection); {why}, so "
                "torch.distributed.pipelining cuts the module model, and it passes exactly "
                f"one: {prev}'s output", s.loc,
                "place the module model one device per segment, or data parallel over groups of one size (sync "
                "allreduce, no shard), where lockstep passes any crossing under any schedule, or cut where only "
                "the hidden state crosses"))
    return out


def _why_cut(spec, segments) -> str:
    """Why a module model's placement does not run in lockstep, in words."""
    sizes = {len(s.devices) for s in segments}
    if len(sizes) > 1:
        return f"the segments' groups differ in size ({', '.join(map(str, sorted(sizes)))} devices)"
    return replica_blocker(spec, segments) or "it does not run in lockstep"
