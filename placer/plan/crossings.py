"""What crosses a segment boundary in a module model, found by the trace.

A module model (`model.module`) whose segments sit on one device each (or are data parallel over
groups of one size, with any sync, shard and sync_batchnorm: one replica pipeline per group
position), without a pipeline or under any
schedule, runs in lockstep (`codegen/runtime/lockstep.py`): every rank runs the parent's forward
(its glue: embedding sums, masks, rotary), a placed layer runs only on its segment's device, and every
output leaf that a layer on another device reads (directly or through glue: a hidden state,
rotary `cos`/`sin`, a skip connection) crosses to that device, once per device and call. Masks
and positions built from the batch are computed on every device and never cross. The trace
(`LayerInfo.consumers`) says which leaves reach which layers; `crossings` turns that into one
transfer per tensor and receiving device, which the plan counts and the program sends. With
data-parallel segments each replica pipeline (the r-th device of every segment) takes 1/D of the
batch and sends to its own peers only. Under any schedule or none, a group of a split mode
(tensor, channel, spatial: `Mode.lockstep_group`) may sit beside one-device segments on devices of
its own: each of its devices runs the segment on the whole input, so what enters is sent to each,
what leaves is sent from its first, and the gradients go back alike (`group_blocker`).

What lockstep cannot run is refused before any worker starts: a placed layer whose output is
not a tensor or a tuple / list of tensors (P081: the devices without it rebuild it), and a
parent's own parameter whose glue feeds layers on several devices (P082: each would train its
own copy; or, in a data segment with shard full, no FSDP2 unit would gather). Other placements of
module models (groups of different sizes not as above, data groups whose parameter server
holds no segment) are cut by torch.distributed.pipelining,
which passes one tensor between stages: a cut where the trace sees more is refused (P083), saying
why lockstep does not run it.
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
    """The segment on the receiving device whose work receives it: its first after the producer's
    (where the forward reaches the producing layer's stand-in on that device)."""
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


def lockstep(spec, segments) -> bool:
    """Whether a module model runs in lockstep: several segments, one device each or each data
    parallel over the same number of devices (`replica_blocker` says which), without a pipeline
    or under any schedule (placer's micro-batch loops; a rank holding several stages runs each
    micro-batch's forward in a thread that waits for the schedule's action of its next stage);
    or split-mode groups that `group_blocker` lets run beside one-device segments (tensor,
    channel, spatial), likewise; or a chain group alone (`_chain_alone`)."""
    if spec.model.inline or len(segments) < 2 and not _chain_alone(segments):
        return False
    if has_groups(segments):
        return all(len(s.devices) == 1 or group_blocker(segments, s.index) is None for s in segments)
    if len({len(s.devices) for s in segments}) != 1:
        return False
    return len(segments[0].devices) == 1 or replica_blocker(spec, segments) is None


def _chain_alone(segments) -> bool:
    """A chain group (channel, spatial) as the only segment: its split runs as the model's layers
    inside the model's own forward (lockstep), so the parent's glue after them runs too (a tensor
    segment alone splits the model's own modules in place)."""
    from placer.modes import MODES

    return len(segments) == 1 and len(segments[0].devices) > 1 and MODES[segments[0].mode].chain


def has_groups(segments) -> bool:
    """Whether some segment (spec or plan segments) is a split-mode group over several devices
    (`Mode.lockstep_group`): lockstep then runs one pipeline, the groups beside it."""
    from placer.modes import MODES

    return any(len(s.devices) > 1 and MODES[s.mode].lockstep_group for s in segments)


def group_blocker(segments, k: int) -> str | None:
    """Why segment k (spec or plan segments), over several devices, cannot run in lockstep beside
    the others, as words after its mode; None if it can. Each rank of a group runs the segment's
    layers on the whole activation (`Mode.lockstep_group`), the others must be one device each or
    such groups, on devices no other segment uses (but a group of the same devices: its ranks
    hold several stages alike, as interleaved and V schedules place them): not data replicas
    (replica pipelines), which cut the batch. A 2-D group's replicas cut their own rows
    (tensor's: `rows_blocker`, checked once the model is traced)."""
    from placer.modes import MODES

    seg = segments[k]
    if not MODES[seg.mode].lockstep_group:
        return "beside other segments"
    # a 2-D group's replicas (data: D) take their rows in and are gathered by rows out: a chain's
    # around its split (ReplicaRows), tensor's where its inputs arrive and after its last layer
    # (rows_entering)
    for other in segments:
        if other.index == k:
            continue
        if len(other.devices) > 1 and not MODES[other.mode].lockstep_group:
            return f"beside segment {other.name!r} of mode {other.mode!r} over several devices"
        shared = [d for d in other.devices if d in seg.devices]
        if shared and tuple(other.devices) != tuple(seg.devices):  # one group may hold several segments
            return f"beside segment {other.name!r} on its device {shared[0]!r} (give the group devices of its own)"
    return None


def rows_entering(segments, graph: ModelGraph, k: int, batch: int) -> list[tuple[str, int, bool]]:
    """(layer, leaf, requires grad) of each tensor with the batch's rows (dim 0 == `batch`, as
    traced) that segment k receives from other segments: a 2-D tensor group in lockstep cuts
    its replica's rows of each as it arrives (runtime bands.py replica_rows_around)."""
    seen: dict[tuple[str, int, bool], None] = {}  # (insertion-ordered set: one per receiving device)
    for c in crossings(segments, graph):
        if c.dst == k and c.shape and c.shape[0] == batch:
            seen[(c.layer, c.leaf, c.grad)] = None
    return list(seen)


def rows_blocker(segments, graph: ModelGraph, k: int, batch: int) -> str | None:
    """Why a 2-D tensor group (segment k) cannot cut its replicas' rows in lockstep, or None: its
    rows are cut where tensors with the batch's rows arrive (the first segment: the batch itself,
    as the model's forward begins) and gathered after its last layer, so the batch's rows must
    arrive from another segment there (the plan counts one input gradient's gather: one such
    tensor that trains), and no layer but the last may send its (rows only) output out."""
    seg = segments[k]
    inside = set(seg.layers)
    for layer in seg.layers[:-1]:
        for _, users in graph.layer(layer).consumers:
            out = [u for u in users if u not in inside]
            if out:
                return f"whose layer {layer!r} sends its output to {out[0]!r} (only the last layer's is gathered whole)"
    found = rows_entering(segments, graph, k, batch)
    if not found and k:
        return "that no tensor with the batch's rows reaches from another segment (nothing to cut its rows of)"
    if sum(grad for _, _, grad in found) > 1:
        return (f"receiving {len(found)} tensors with the batch's rows ({', '.join(f'{l}[{i}]' for l, i, _ in found)}); "
                "only one is cut and its gradient gathered")
    return None


def _data(seg) -> int:
    """A segment's data replicas (`data: D` of a 2-D one), of a spec or a plan segment."""
    return seg.parallel.data if hasattr(seg, "parallel") else seg.options.get("data", 1)


def replica_blocker(spec, segments) -> str | None:
    """Why multi-device segments of a module model cannot run as replica pipelines in lockstep,
    or None. Each group must hold whole replicas that cut the batch (data) and sync whole
    gradients after the lockstep backward (`Mode.replica_blocker`: placer's all-reduce buckets,
    ZeRO-1, a parameter server on a device of the placement, a broadcast from the first; no DDP:
    the segment's layers run inside the whole model's forward); and a device keeps one place in
    every group (its pipeline)."""
    from placer.modes import MODES

    for s in segments:
        seg = spec.placement[s.index]
        mode = MODES[seg.mode]
        if mode.data_degree(len(s.devices)) != len(s.devices):
            return f"segment {s.name!r} is {seg.mode} over {len(s.devices)} devices"
        why = mode.replica_blocker(seg.parallel)
        if why:
            return f"segment {s.name!r} is {why}"
        server = getattr(seg.parallel, "server", None)
        if server and not any(server in x.devices for x in segments):  # every rank runs a pipeline
            return f"segment {s.name!r}'s parameter server {server!r} holds no segment"
    place: dict[str, int] = {}
    for s in segments:
        for r, d in enumerate(s.devices):
            if place.setdefault(d, r) != r:
                return f"device {d!r} is number {place[d] + 1} of one group and number {r + 1} of segment {s.name!r}'s"
    return None


def pipelines(segments) -> list[tuple[str, ...]]:
    """The replica pipelines of a lockstep placement: the r-th device of every segment (one, of
    each segment's first device, beside split-mode groups)."""
    if has_groups(segments):
        return [tuple(s.devices[0] for s in segments)]
    return [tuple(s.devices[r] for s in segments) for r in range(len(segments[0].devices))]


def per_microbatch(c: "Crossing", batch_size: int, m: int) -> int:
    """Bytes of one micro-batch's copy: a leaf whose dim 0 is the batch is cut m ways (rotary
    cos / sin, [1, seq, d], is not). `batch_size`: a replica pipeline's."""
    return c.bytes // m if c.shape and c.shape[0] == batch_size else c.bytes


def crossings(segments, graph: ModelGraph, batch_size: int = 0) -> list[Crossing]:
    """Every output leaf that reaches a layer (or the loss) on another device, per replica
    pipeline and receiving device, producers in model order. With D replicas, a leaf whose dim 0
    is the batch (`batch_size`) carries a replica's 1/D of it. A split-mode group (every device
    holds the whole activation) sends from its first device, receives on each, and sends the
    gradient back from its first to each of the producer's."""
    seg_of = {layer: s for s in segments for layer in s.layers}
    groups = has_groups(segments)
    n = 1 if groups else len(segments[0].devices)

    def devices(seg, r: int) -> tuple:  # segment seg's devices in replica pipeline r
        return seg.devices if groups else (seg.devices[r],)

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
                    src = devices(s, r)
                    dsts: dict[str, PlacedSegment] = {}
                    for u in users:
                        for d in devices(segments[-1] if u == OUTPUT else seg_of[u], r):
                            if d not in src:
                                dsts.setdefault(d, next(x for x in held[d] if x.index > s.index))
                    out += [Crossing(layer, leaf, s.index, t.index, src[0], d, shape, dtype,
                                     bool(grad) and dtype in ("float16", "bfloat16", "float32", "float64"),
                                     info.calls, back=d == devices(t, r)[0], src_group=src if len(src) > 1 else ())
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

    if spec.model.inline or len(segments) < 2 and not _chain_alone(segments):
        return []
    seg_of = {layer: s for s in segments for layer in s.layers}
    if lockstep(spec, segments):
        out = []
        for s in segments:
            seg = spec.placement[s.index]
            why = rows_blocker(segments, graph, s.index, spec.training.batch_size) if len(s.devices) > 1 and \
                _data(seg) > 1 and MODES[s.mode].rows_around else None
            if why:
                out.append(Diagnostic(
                    "P086", f"segment {s.name!r}: mode {s.mode!r} with data replicas of a module model beside other "
                    f"segments {why} is not generated by this version of placer", seg.parallel.loc,
                    "start the group where the hidden state arrives from the segment before it (or as the first "
                    "segment) and end it with the layer whose output leaves it, or use mode tensor without data there"))
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
            held = seg_of.get(r.consumer)
            if r.trainable and held is not None and len(held.devices) > 1 and \
                    getattr(spec.placement[held.index].parallel, "shard", "none") == "full":
                out.append(Diagnostic(
                    "P082", f"parameter {r.name!r} belongs to no placed layer, and segment {held.name!r} (mode "
                    f"{held.mode!r}) has shard 'full': in lockstep FSDP2 shards each placed layer (what the model's forward "
                    "calls), and nothing would gather it", spec.placement[held.index].loc,
                    "move it into a submodule and place that, or use shard none or optimizer on that segment"))
            if r.trainable and held is not None and len(held.devices) > 1 and MODES[held.mode].chain:
                out.append(Diagnostic(
                    "P082", f"parameter {r.name!r} belongs to no placed layer, and segment {held.name!r} (mode "
                    f"{held.mode!r}) runs as a split of its layers alone: nothing would train it",
                    spec.placement[held.index].loc, "move it into a submodule and place that in a segment of "
                    "its own (one device), or use mode data or none on that segment"))
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
                "place the module model one device per segment, or data parallel over groups of one size (a "
                "server on a device of the placement), where lockstep passes any crossing under any schedule, or "
                "cut where only the hidden state crosses"))
    return out


def _why_cut(spec, segments) -> str:
    """Why a module model's placement does not run in lockstep, in words."""
    if has_groups(segments):
        why = next((f"segment {s.name!r} is {s.mode} {w}" for s in segments if len(s.devices) > 1
                    for w in [group_blocker(segments, s.index)] if w), None)
        return why or "split-mode groups run in lockstep only without a pipeline or under schedule gpipe"
    sizes = {len(s.devices) for s in segments}
    if len(sizes) > 1:
        return f"the segments' groups differ in size ({', '.join(map(str, sorted(sizes)))} devices)"
    return replica_blocker(spec, segments) or "it does not run in lockstep"
