"""Lowering: small passes `Plan -> Plan` that add communication to a compute-only plan.

`lower(plan, spec, graph)` runs `PASSES` in order and `verify`s after each:

- insert_copies: COPY where one device hands its output to another device;
- insert_splits: SPLIT / MERGE / RESPLIT where consecutive segments hold the
  activation in different layouts (groups, modes);
- insert_collectives: what each mode needs inside and after its segment
  (gradient all-reduce in buckets, parameter server, broadcast sync, ZeRO-1 /
  fully sharded, channel gathers, tensor-parallel all-reduces, spatial halos,
  SyncBatchNorm statistics), splitting COMPUTE ops where a collective runs
  between layers;
- insert_pipeline: SEND / RECV of every micro-batch between pipeline stages.
- insert_ties: the all-reduce that keeps a tied parameter's copies equal (plan/ties.py).

Passes insert each op into every participant's list at a point fixed by that
device's own ops (after its last forward of segment s-1, before its first of
segment s, ...), so all devices see shared ops in the same order.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

from placer.diagnostics import Diagnostic, Loc, PlanError
from placer.model.graph import ModelGraph
from placer.modes import MODES, Lowering
from placer.plan.attach import Attached
from placer.plan.crossings import ITEMSIZE, crossings, lockstep, per_microbatch, pipelines, rows_entering
from placer.plan.ir import Layout, Op, OpKind, PlacedSegment, Plan, layer_range, transfer_kind, union
from placer.plan.layout import in_layout, moves
from placer.plan.place import layer_geometry
from placer.plan.ties import insert_ties
from placer.plan.ties import placed as placed_ties
from placer.plan.verify import verify
from placer.spec.shapes import op_kind
from placer.spec.types import Spec
from placer.units import MiB

BWD = ("bwd", "bwd_input", "bwd_weight")


def _is_compute(op: Op, seg: int, phases, microbatch: int | None = None) -> bool:
    """A COMPUTE op of segment `seg` in one of `phases` (and, given one, of that micro-batch)."""
    return op.kind == OpKind.COMPUTE and op.segment == seg and op.phase in phases and (
        microbatch is None or op.microbatch == microbatch)


def _first(ops: list, pred) -> int | None:
    return next((i for i, op in enumerate(ops) if pred(op)), None)


def _last(ops: list, pred) -> int | None:
    return next((i for i in range(len(ops) - 1, -1, -1) if pred(ops[i])), None)


def _found(i: int | None) -> int:
    assert i is not None, "a device in a transfer runs the compute it is placed against"
    return i


def boundary_bytes(graph: ModelGraph, seg: PlacedSegment) -> int:
    """Bytes of the activation a segment hands to the next (its last layer's output, global batch)."""
    return graph.layer(seg.layers[-1]).out_bytes


# ---- copies, splits, merges --------------------------------------------------------------------

def _transitions(plan: Plan, graph: ModelGraph, copies: bool) -> Plan:
    if plan.schedule:  # stage boundaries are pipeline sends
        return plan
    ops = {d: list(v) for d, v in plan.ops.items()}
    segs = plan.segments
    for prev, cur in zip(segs, segs[1:]):
        src, dst = in_layout(prev), in_layout(cur)
        if src == dst or (transfer_kind(src.devices, dst.devices) == OpKind.COPY) != copies:
            continue
        n, s = boundary_bytes(graph, prev), cur.index
        fwd = _transfer(src, dst, s, "fwd", "act", n, cur.route)
        bwd = _transfer(dst, src, s, "bwd", "grad", n, cur.route)
        for d in fwd.devices:
            lst = ops[d]
            if d in cur.devices:
                lst.insert(_found(_first(lst, lambda o: _is_compute(o, s, ("fwd",)))), fwd)
            else:
                lst.insert(_found(_last(lst, lambda o: _is_compute(o, s - 1, ("fwd",)))) + 1, fwd)
        for d in bwd.devices:
            lst = ops[d]
            if d in prev.devices:
                lst.insert(_found(_first(lst, lambda o: _is_compute(o, s - 1, BWD))), bwd)
            else:
                lst.insert(_found(_last(lst, lambda o: _is_compute(o, s, BWD))) + 1, bwd)
    return plan.with_ops(ops)


def _loss_gather(plan: Plan, graph: ModelGraph, ops: dict) -> None:
    """The loss takes rows: a last segment whose output is cut along another dim (a spatial
    group's bands) gathers it on its first device for the loss (the program's
    `out = relayout(...)`), and the output's gradient goes back to the slices."""
    last = plan.segments[-1]
    src = in_layout(last)
    if not src.dim or len(last.devices) < 2:
        return
    dst, s = Layout(last.devices[:1]), last.index
    n = boundary_bytes(graph, last) // plan.microbatches
    for mb in range(plan.microbatches) if plan.schedule else (None,):  # a pipeline's: every micro-batch's
        fwd = _transfer(src, dst, s, "fwd", "act", n, last.route)  # (a 2-D src's replicas in its attrs)
        bwd = _transfer(dst, src, s, "bwd", "grad", n, last.route)
        fwd, bwd = (o.with_(attrs={**o.attrs, "loss": True}, microbatch=mb) for o in (fwd, bwd))
        for d in last.devices:
            lst = ops[d]
            lst.insert(_found(_last(lst, lambda o: _is_compute(o, s, ("fwd",), mb))) + 1, fwd)
            lst.insert(_found(_first(lst, lambda o: _is_compute(o, s, BWD, mb))), bwd)


def _transfer(src: Layout, dst: Layout, seg: int, phase: str, tensor: str, nbytes: int, route: str) -> Op:
    # a 2-D side (data replicas of a split mode) says how many replicas it holds
    attrs = {f"{side}_replicas": l.replicas for side, l in (("src", src), ("dst", dst)) if l.replicas > 1}
    return Op(kind=transfer_kind(src.devices, dst.devices), devices=union(src.devices, dst.devices), segment=seg,
              phase=phase, tensor=tensor, bytes=nbytes, route=route, src=src.devices, dst=dst.devices,
              src_dim=src.dim, dst_dim=dst.dim, attrs=attrs)


def insert_copies(plan: Plan, spec: Spec, graph: ModelGraph) -> Plan:
    """COPY (activation forward, its gradient backward) between segments on two single devices;
    for a module model in lockstep, one per crossing tensor and receiving device (plan/crossings.py)."""
    if lockstep(spec, plan.segments):  # (a GPipe pipeline's: insert_pipeline's sends)
        return plan if plan.schedule else _crossing_copies(plan, graph)
    return _transitions(plan, graph, copies=True)


def _crossing_copies(plan: Plan, graph: ModelGraph) -> Plan:
    """One COPY per crossing tensor and receiving device (attrs: `of` the producing layer, its
    output `leaf`, `from` its segment), at the points the lockstep program moves it: forward after
    the producer's segment and before the consumer's; the gradient after every later segment's
    backward on the receiving device and before the producer's backward. With accumulate, once
    per micro-step: a leaf that is not cut by rows (rotary's cos / sin) crosses N times."""
    ops = {d: list(v) for d, v in plan.ops.items()}
    segs = plan.segments
    found = crossings(segs, graph, plan.batch_size)
    n = plan.accumulate

    def xing(o: Op, phase: str, src: int) -> bool:
        return o.attrs.get("from") == src and o.phase == phase

    for c in found:
        attrs = {"of": c.layer, "leaf": c.leaf, "from": c.src}
        fwd = Op(kind=OpKind.COPY, devices=(c.src_device, c.dst_device), segment=c.dst, phase="fwd", tensor="act",
                 bytes=per_microbatch(c, plan.batch_size, n) * n, route=segs[c.dst].route, src=(c.src_device,), dst=(c.dst_device,), attrs=attrs)
        lst = ops[c.src_device]
        lst.insert(_found(_last(lst, lambda o: _is_compute(o, c.src, ("fwd",)) or xing(o, "fwd", c.src))) + 1, fwd)
        lst = ops[c.dst_device]
        lst.insert(_found(_first(lst, lambda o: _is_compute(o, c.dst, ("fwd",)))), fwd)
    for c, to in sorted(((c, to) for c in found for to in c.grad_to), key=lambda ct: -ct[0].src):
        attrs = {"of": c.layer, "leaf": c.leaf, "from": c.src}  # to each device of a producing group
        bwd = Op(kind=OpKind.COPY, devices=(c.dst_device, to), segment=c.dst, phase="bwd", tensor="grad",
                 bytes=per_microbatch(c, plan.batch_size, n) * n, route=segs[c.dst].route, src=(c.dst_device,),
                 dst=(to,), attrs=attrs)
        lst = ops[c.dst_device]
        lst.insert(_found(_last(lst, lambda o: (o.kind == OpKind.COMPUTE and o.segment > c.src and o.phase in BWD)
                                or (o.phase == "bwd" and "from" in o.attrs))) + 1, bwd)
        lst = ops[to]
        lst.insert(_found(_first(lst, lambda o: _is_compute(o, c.src, BWD))), bwd)
    return plan.with_ops(ops)


def insert_splits(plan: Plan, spec: Spec, graph: ModelGraph) -> Plan:
    """SPLIT / MERGE / RESPLIT where consecutive segments use different groups or modes, and
    where a spatial last segment's output meets for the loss."""
    if lockstep(spec, plan.segments):  # one device per segment: copies only
        return plan
    plan = _transitions(plan, graph, copies=False)
    ops = {d: list(v) for d, v in plan.ops.items()}
    _loss_gather(plan, graph, ops)
    return plan.with_ops(ops)


# ---- collectives ---------------------------------------------------------------------------------

def buckets(seg: PlacedSegment, graph: ModelGraph, bucket_mb: float,
            tied: dict[str, int] | None = None) -> list[tuple[int, tuple[str, ...]]]:
    """Gradient buckets like DDP's: layers with parameters in reverse order, about bucket_mb each.

    Returns (bytes, layers in model order) per bucket, first-ready bucket first. A layer is never
    split; one larger than the cap gets a bucket of its own. Root parameters go with their consumer.
    `tied`: layer -> bytes of tied parameters it owns that the tie's own all-reduce sums instead."""
    sizes = param_bytes(seg, graph)
    for name, b in (tied or {}).items():
        sizes[name] -= b
    cap = bucket_mb * MiB
    out, size = [], 0
    cur: list[str] = []
    for name in reversed(seg.layers):
        b = sizes[name]
        if not b:
            continue
        if cur and size + b > cap:
            out.append((size, tuple(reversed(cur))))
            cur, size = [], 0
        cur.append(name)
        size += b
    if cur:
        out.append((size, tuple(reversed(cur))))
    return out


def under_autocast(info: list, half_in: bool = False) -> list:
    """The layers as `precision: bf16` runs them, for what their collectives move: autocast makes
    Linear / Conv outputs bfloat16, and the layers that channel, tensor and spatial segments
    hold besides keep their input's dtype (AvgPool3d excepted: float32); a segment's input
    arrives float32 (the program casts inline crossings back) unless `half_in` (a module model's
    bfloat16 crossing, as one device holds it). Gradients take their tensor's dtype."""
    out, half = [], half_in
    for l in info:
        kind = op_kind(l.op)
        was, half = half, kind in ("linear", "conv") or (half and l.op != "AvgPool3d")
        out.append(replace(l, in_bytes=l.in_bytes // 2 if was else l.in_bytes,
                           out_bytes=l.out_bytes // 2 if half and l.out_dtype == "float32" else l.out_bytes))
    return out


def _collect(seg: PlacedSegment, plan: Plan, spec: Spec, graph: ModelGraph) -> Attached:
    """The collectives a segment's mode needs, by where they run."""
    a = Attached(step_devices=seg.devices)
    info = [graph.layer(n) for n in seg.layers]
    if spec.training.precision == "bf16" and MODES[seg.mode].forward_sends_activations:
        info = under_autocast(info, _arrives_half(graph, seg))
    g, i0 = seg.devices, seg.index
    grads = _input_grads(plan, seg, graph)

    def op(kind, phase, tensor, nbytes, layer=None, **kw):
        attrs = {"layer": layer} if layer else {}
        attrs.update(kw.pop("attrs", {}))
        devices = kw.pop("devices", g)  # a 2-D segment's: one replica, or one position across them
        return Op(kind=kind, devices=devices, segment=i0, phase=phase, tensor=tensor, bytes=nbytes, attrs=attrs,
                  **kw)

    # a tie across data segments (lockstep): summed over every copy by the tie's all-reduce (insert_ties)
    tied = {t.tie.layers[0]: t.tie.bytes for t in placed_ties(plan.segments, graph)
            if len(seg.devices) > 1 and t.tie.layers[0] in seg.layers}
    sizes = param_bytes(seg, graph)
    if seg.options.get("shard") == "full" and len(seg.devices) > 1:  # FSDP2 gathers a tied copy with its layer
        for t in placed_ties(plan.segments, graph):
            for k, layer, _ in t.copies[1:]:
                if k == seg.index:
                    sizes[layer] = sizes.get(layer, 0) + t.tie.bytes
    locked = lockstep(spec, plan.segments)
    rows_in = _rows_in(spec, plan, seg, graph) if locked and seg.options.get("data", 1) > 1 else 0
    ctx = Lowering(sizes=sizes, rows_in=rows_in, buckets=lambda mb: buckets(seg, graph, mb, tied),
                   geometry=lambda name: layer_geometry(spec, name) or _window(graph.layer(name)),
                   lockstep=locked, bf16=spec.training.precision == "bf16",
                   tied_bytes=sum(t.tie.bytes for t in placed_ties(plan.segments, graph) if len(seg.devices) > 1
                                  and any(k == seg.index for k, _, _ in t.copies)))
    MODES[seg.mode].collectives(a, seg, info, grads, op, ctx)
    return a


def _rows_in(spec: Spec, plan: Plan, seg: PlacedSegment, graph: ModelGraph) -> int:
    """A 2-D tensor group in lockstep: bytes of what arrives with the batch's rows and trains (the
    hidden state it cuts; its gradient all-gathered over each position), as it crosses."""
    if not MODES[seg.mode].rows_around:  # (a chain's replicas cut the input of their split: its first layer's)
        return 0
    found = rows_entering(plan.segments, graph, seg.index, spec.training.batch_size)
    leaves = [graph.layer(name).out_leaves[i] for name, i, grad in found if grad]
    return sum(math.prod(leaf[0]) * ITEMSIZE.get(leaf[1], 4) for leaf in leaves)


def _arrives_half(graph: ModelGraph, seg: PlacedSegment) -> bool:
    """Whether a segment's input crosses in bfloat16: a module model's chain reads the output of
    the layer before it, whose leaf dtypes are autocast's under bf16 (build_graph)."""
    i = graph.names.index(seg.layers[0])
    leaf = graph.layers[i - 1].out_leaves[0] if i and graph.layers[i - 1].out_leaves else None
    return leaf is not None and leaf[1] == "bfloat16"


def _window(info) -> dict | None:
    """A module model's Conv / Pool geometry, as layer_geometry gives an inline layer's."""
    return dict(zip(("kernel", "stride", "padding", "dilation"), info.window)) if info.window else None


def _input_grads(plan: Plan, seg: PlacedSegment, graph: ModelGraph) -> list[bool]:
    """Whether each layer's input gets a gradient in backward: only if something before it
    trains (the model input needs none, so nothing is sent for it)."""
    earlier = any(graph.layer(n).params for s in plan.segments[:seg.index] for n in s.layers)
    out = []
    for n in seg.layers:
        out.append(earlier)
        earlier = earlier or graph.layer(n).params > 0
    return out


def param_bytes(seg: PlacedSegment, graph: ModelGraph) -> dict[str, int]:
    """Layer -> bytes of the trainable parameters it owns, root parameters it consumes included."""
    out = {n: graph.layer(n).param_bytes for n in seg.layers}
    for r in graph.root_params:
        if r.trainable and r.consumer in out:
            out[r.consumer] += r.bytes
    return out


def _instantiate(entries, src: Op, m: int, part: str, repeat: int = 1) -> list[Op]:
    """Attached ops for one COMPUTE op: its micro-batch, activation bytes / m in a pipeline.
    `repeat` (accumulate's micro-steps): a layer's parameter gathers and statistics run once per
    micro-step, its gradient reduction once, after the last (DDP no_sync, FSDP2's gradient sync off)."""
    out = []
    for op, scale, weight in entries:
        if (part == "bwd_input" and weight) or (part == "bwd_weight" and not weight):
            continue
        nbytes = op.bytes // m if scale else op.bytes * (1 if weight else repeat)
        out.append(op.with_(bytes=nbytes, microbatch=src.microbatch))
    return out


def _expand(op: Op, seg: PlacedSegment, a: Attached, m: int, repeat: int = 1) -> list[Op]:
    """A segment's COMPUTE op split into chunks, with the collectives between them."""
    starts = sorted({0} | {c for c in a.cuts if 0 < c < len(seg.layers)})
    chunks = [(s, e) for s, e in zip(starts, starts[1:] + [len(seg.layers)])]
    out = []
    if op.phase == "fwd":
        for s, e in chunks:
            out += _instantiate(a.pre_fwd.get(s, []), op, m, "fwd", repeat)
            out.append(op.with_(tensor=layer_range(seg.layers[s:e])))
            out += _instantiate(sum((a.post_fwd.get(i, []) for i in range(s, e)), []), op, m, "fwd", repeat)
        return out
    if seg.recompute and op.phase in ("bwd", "bwd_input"):
        # torch.utils.checkpoint runs the segment's forward again as its backward starts: its
        # collectives (all-gathers, pair all-reduces, halos) run again, in forward order
        for s, e in chunks:
            again = a.pre_fwd.get(s, []) + sum((a.post_fwd.get(i, []) for i in range(s, e)), [])
            out += [o.with_(phase=op.phase, attrs={**o.attrs, "recompute": True})
                    for o in _instantiate(again, op, m, "fwd", repeat)]
    for s, e in reversed(chunks):
        out += _instantiate(a.pre_bwd.get(s, []), op, m, op.phase, repeat)
        out.append(op.with_(tensor=layer_range(seg.layers[s:e])))
        out += _instantiate(sum((a.post_bwd.get(i, []) for i in range(s, e)), []), op, m, op.phase, repeat)
    return out


def insert_collectives(plan: Plan, spec: Spec, graph: ModelGraph) -> Plan:
    """Each segment's mode collectives, on each device of its group (and a parameter server)."""
    ops = {d: list(v) for d, v in plan.ops.items()}
    m = plan.microbatches
    for seg in plan.segments:
        a = _collect(seg, plan, spec, graph)
        if a.empty():
            continue
        s = seg.index
        for d in union(seg.devices, a.step_devices):
            lst, new = ops[d], []

            def mine(part: list) -> list:  # a 2-D segment's collectives run in a replica or a position's group
                return [o for o in part if d in o.devices]
            first = _first(lst, lambda o: _is_compute(o, s, ("fwd",)))
            last = _last(lst, lambda o: _is_compute(o, s, BWD))
            has_step = False
            for i, o in enumerate(lst):
                if o.kind == OpKind.COMPUTE and o.segment == s:
                    new += mine(a.seg_pre_fwd) if i == first else []
                    new += mine(_expand(o, seg, a, m, plan.accumulate))
                    new += mine(a.seg_post_bwd) if i == last else []
                elif o.kind == OpKind.STEP and o.segment == s:
                    new += mine(a.step_pre) + [o] + mine(a.step_post)
                    has_step = True
                else:
                    new.append(o)
            if not has_step and d in a.step_devices and (a.step_pre or a.step_post):
                at = _first(new, lambda o: o.phase == "step" and o.segment > s)
                at = len(new) if at is None else at
                new[at:at] = mine(a.step_pre) + mine(a.step_post)
            ops[d] = new
    return plan.with_ops(ops)


# ---- pipelines -----------------------------------------------------------------------------------

def _flow(phase: str) -> str | None:
    """Which pipeline message a phase's ops wait for and produce: the activation or the gradient."""
    return "fwd" if phase == "fwd" else "bwd" if phase in ("bwd", "bwd_input") else None


def insert_pipeline(plan: Plan, spec: Spec, graph: ModelGraph) -> Plan:
    """SEND / RECV of each micro-batch's activation (forward) and gradient (backward) between stages.

    Like torch's `_add_send_recv`: all devices step through their ops together; when a device
    finishes a stage's forward (backward) of a micro-batch it appends the SENDs to its list and
    the matching RECVs to the receivers' lists right then, and a device does not start a stage's
    work on a micro-batch before its RECVs are there. So every pair of devices sends and
    receives in the same order."""
    if not plan.schedule:
        return plan
    m, segs = plan.microbatches, plan.segments
    out: dict[tuple, list] = {}  # (device, segment, flow, mb) -> [(SEND, RECV, its segment)] after that work
    need: Counter = Counter()  # (device, segment, flow, mb) -> RECVs it waits for
    locked = lockstep(spec, segs)  # a module model in lockstep
    rows = plan.batch_size // len(pipelines(segs)) if locked else 0  # a replica pipeline's (groups of one size)
    for c in crossings(segs, graph, plan.batch_size) if locked else ():
        # per micro-batch of each of accumulate's micro-steps (the schedule runs once per micro-step):
        # a leaf not cut by rows crosses that many times more, one cut by rows in pieces adding up alike
        n, attrs = per_microbatch(c, rows, m * plan.accumulate) * plan.accumulate, {"of": c.layer, "leaf": c.leaf, "from": c.src}
        flows = [("fwd", c.src, c.dst, c.src_device, c.dst_device, "act")]
        flows += [("bwd", c.dst, c.src, c.dst_device, to, "grad") for to in c.grad_to]  # each of a group's
        for flow, a_k, b_k, a, b, what in flows:
            for mb in range(m):
                kw: dict = dict(devices=(a, b), segment=c.dst, phase=flow, tensor=what, bytes=n, microbatch=mb,
                                    route=segs[c.dst].route, src=(a,), dst=(b,), attrs=attrs)
                out.setdefault((a, a_k, flow, mb), []).append(
                    (Op(kind=OpKind.SEND, **kw), Op(kind=OpKind.RECV, **kw), (b, b_k, flow, mb)))
                need[(b, b_k, flow, mb)] += 1
    relay: dict[tuple, list] = {}  # (device, segment, flow, mb) -> the same, sent before that work
    for prev, cur in zip(segs, segs[1:]) if not lockstep(spec, segs) else ():
        src, dst = in_layout(prev), in_layout(cur)
        if src == dst:  # consecutive stages on the same group (the turn of a V schedule)
            continue
        n = boundary_bytes(graph, prev) // m
        for flow, (a_seg, b_seg), mv, what in (("fwd", (prev, cur), moves(src, dst, n), "act"),
                                               ("bwd", (cur, prev), moves(dst, src, n), "grad")):
            for mb in range(m):
                for a, b, nbytes in mv:
                    common: dict = dict(devices=(a, b), segment=cur.index, phase=flow, tensor=what, bytes=nbytes,
                                  microbatch=mb, route=cur.route, src=(a,), dst=(b,))
                    # a 2-D group's first device passes its replica's rows on before its own work on them
                    # (relay); a 2-D source's bands meet on its first device before it sends them (gather)
                    into, gather = a in b_seg.devices, b in a_seg.devices
                    done = ("gather", b, a_seg.index, flow, mb) if gather else (b, b_seg.index, flow, mb)
                    (relay if into else out).setdefault((a, (b_seg if into else a_seg).index, flow, mb), []).append(
                        (Op(kind=OpKind.SEND, **common), Op(kind=OpKind.RECV, **common), done))
                    need[done] += 1
    lists = {d: plan.ops.get(d, ()) for d in plan.devices}
    last = {(d, o.segment, _flow(o.phase), o.microbatch): i for d, lst in lists.items() for i, o in enumerate(lst)}
    new: dict[str, list] = {d: [] for d in plan.devices}
    got: Counter = Counter()
    pos = {d: 0 for d in plan.devices}
    held: dict[str, tuple] = {}  # device -> the work whose sends wait for its replica's bands

    def post(d: str, pairs) -> None:
        for send, recv, done in pairs:
            new[d].append(send)
            new[recv.devices[-1]].append(recv)
            got[done] += 1
    while any(pos[d] < len(lists[d]) for d in plan.devices) or held:
        progress = False
        for d in plan.devices:  # one op per device per round, as torch's simulation does
            if d in held:
                if got[("gather",) + held[d]] < need[("gather",) + held[d]]:
                    continue
                post(d, out.get(held.pop(d), ()))
                progress = True
                continue
            if pos[d] >= len(lists[d]):
                continue
            op = lists[d][pos[d]]
            key = (d, op.segment, _flow(op.phase), op.microbatch)
            if key[2] and got[key] < need[key]:
                continue
            post(d, relay.pop(key, ()))  # (a 2-D group's first device, once)
            new[d].append(op)
            if last.get(key) == pos[d] and got[("gather",) + key] < need[("gather",) + key]:
                held[d] = key
            elif last.get(key) == pos[d]:
                post(d, out.get(key, ()))
            pos[d] += 1
            progress = True
        if not progress:
            stuck = ", ".join(f"{d} at {lists[d][pos[d]].tensor}" for d in plan.devices if pos[d] < len(lists[d]))
            raise PlanError(Diagnostic("V007", f"pipeline schedule {plan.schedule!r} cannot be ordered: every "
                                       f"device waits ({stuck})", Loc(f"<plan {plan.name}>"),
                                       "this is a placer bug; please report it with the spec"))
    return plan.with_ops(new)


def insert_grad_norm(plan: Plan, spec: Spec, graph: ModelGraph) -> Plan:
    """training.clip_grad_norm: one ALL_REDUCE of a float32 (each device's sum of the squared
    gradients it counts) over every device, after every gradient sync and before any step."""
    if spec.training.clip_grad_norm is None:
        return plan
    op = Op(kind=OpKind.ALL_REDUCE, devices=plan.devices, segment=len(plan.segments) - 1, phase="step",
            tensor="grad_norm", bytes=4, attrs={"grad_norm": True})
    ops = {d: list(v) for d, v in plan.ops.items()}
    for d in plan.devices:
        lst = ops.setdefault(d, [])
        at = next((i for i, o in enumerate(lst) if o.kind == OpKind.STEP), len(lst))
        lst.insert(at, op)
    return plan.with_ops(ops)


PASSES = (insert_copies, insert_splits, insert_collectives, insert_pipeline, insert_ties, insert_grad_norm)


def lower(plan: Plan, spec: Spec, graph: ModelGraph, passes=PASSES, each: bool = True) -> Plan:
    """Run the lowering passes in order, verifying the plan after each (`each=False`: after the last
    only, as the placement search lowers many candidates)."""
    for i, p in enumerate(passes):
        last = i == len(passes) - 1
        plan = p(plan, spec, graph)
        if each or last:
            plan = verify(plan, complete=last, after=p.__name__)
    return plan
