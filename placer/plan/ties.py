"""Tied parameters in a placement: which segments hold a copy, what keeping them equal costs.

A parameter that layers of several segments use (GPT-2's `lm_head.weight` is `wte.weight`)
has one copy per segment: each segment's stage module holds its own (torch's pipeline
tracer copies it into every stage that uses it). The copies start equal (every rank builds
the model from the seed) and stay equal as Megatron keeps its word embeddings: after
backward the copies' gradients are summed, on one rank locally and over the ranks holding a
copy by an all-reduce (one ALL_REDUCE op per tie in the plan), so every copy takes the same
step. The sum is the gradient the one parameter gets on one device.

Data-parallel segments of a module model in lockstep (replica pipelines) keep a tie too: the
all-reduce runs over every rank holding a copy, every replica of every segment that uses it,
and sums all their gradients, so the segments' own data all-reduce leaves the tied parameter
out (ZeRO-1 then steps each copy on one rank of its group and broadcasts it, as any other). A
parameter server or a broadcast root would step the copy alone and send back only what its own
sync holds, so a tie there is refused (P080). FSDP2 groups (`shard: full`) hold the r-th shard of
their copy on their r-th device: the copies are summed shard by shard, one all-reduce per
position (`shards`), the groups' reduce-scatters having summed each copy over its group; a tie
between an FSDP2 group and a group holding whole copies is refused (P080). Elsewhere a tie is kept only between segments on one device each: a channel, tensor or
spatial group, or a data group cut by torch's pipelining, would need its own rule, so `check`
refuses it (P080) before any worker starts rather than train the copies apart.
"""
from __future__ import annotations

from dataclasses import dataclass

from placer.diagnostics import Diagnostic
from placer.model.graph import ModelGraph, Tie
from placer.plan.crossings import has_groups, lockstep
from placer.plan.ir import Op, OpKind, PlacedSegment, Plan, union


@dataclass(frozen=True)
class PlacedTie:
    tie: Tie
    copies: tuple[tuple[int, str, str], ...]
    """(segment index, layer, the parameter's name under that layer) for each segment holding a
    copy: its first user layer there. The first copy is the one saved under `tie.name`."""
    devices: tuple[str, ...]
    """Devices holding a copy, in segment order: the group whose all-reduce sums the gradients."""
    aliases: tuple[tuple[str, ...], ...] = ()
    """Every name of the parameter in each copy's segment (the copy's own name first): one
    segment's users share its one copy, however many of its layers use the parameter."""


def placed(segments, graph: ModelGraph) -> list[PlacedTie]:
    """The ties whose users lie in more than one segment (`segments`: PlacedSegments)."""
    out = []
    for tie in graph.ties:
        copies: dict[int, tuple[int, str, str]] = {}
        aliases: dict[int, list[str]] = {}
        for layer, name, names in zip(tie.layers, tie.names, tie.aliases or [(n,) for n in tie.names]):
            seg = next(s for s in segments if layer in s.layers)
            copies.setdefault(seg.index, (seg.index, layer, name))
            aliases.setdefault(seg.index, []).extend(names)
        if len(copies) > 1:
            held = sorted(copies.values())
            out.append(PlacedTie(tie, tuple(held), union(*(segments[k].devices for k, _, _ in held)),
                                 tuple(tuple(aliases[k]) for k, _, _ in held)))
    return out


def shards(t: PlacedTie, segments) -> int:
    """D where every segment holding a copy is data parallel over D devices with FSDP2 (`shard:
    full`, replica pipelines in lockstep): the r-th device of each holds the r-th shard of its
    copy, so the copies are summed shard by shard, over each position; else 0."""
    segs = [segments[k] for k, _, _ in t.copies]
    full = [len(s.devices) > 1 and s.options.get("shard") == "full" for s in segs]
    return len(segs[0].devices) if all(full) else 0


def shard_rows(rows: int, n: int) -> list[int]:
    """The rows of dim 0 each of n ranks holds under FSDP2: torch.chunk's pieces (ceil(rows / n)
    each, the last shorter), then empty ones (127 over 2: 64, 63; 5 over 4: 2, 2, 1, 0)."""
    size = -(-rows // n)
    return [max(0, min(size, rows - r * size)) for r in range(n)]


def shard_bytes(tie: Tie, n: int) -> list[int]:
    """The bytes of each FSDP2 shard of a tied parameter over n ranks: what position r sums."""
    if not tie.rows:  # dim 0 unknown: an even cut
        return [tie.bytes // n + (r < tie.bytes % n) for r in range(n)]
    return [tie.bytes // tie.rows * k for k in shard_rows(tie.rows, n)]


def copy_elements(seg: PlacedSegment, graph: ModelGraph) -> tuple[int, int]:
    """(elements, bytes) of tied parameters a segment holds a copy of but does not own (its
    layers' `params` leave them out: the owner counts them)."""
    n = b = 0
    for tie in graph.ties:
        if tie.layers[0] not in seg.layers and any(l in seg.layers for l in tie.layers):
            n, b = n + tie.numel, b + tie.bytes
    return n, b


def insert_ties(plan: Plan, spec, graph: ModelGraph) -> Plan:
    """One ALL_REDUCE of each tie's gradient over the devices holding a copy, after backward and
    before the first optimizer step on each of them, ties in model order on every device."""
    ops = {d: list(v) for d, v in plan.ops.items()}
    for t in placed(plan.segments, graph):
        if len(t.devices) < 2:
            continue  # copies on one device are summed there: nothing is sent
        attrs = {"tie": t.tie.name, "layers": list(t.tie.layers)}
        n = shards(t, plan.segments)
        made = [Op(kind=OpKind.ALL_REDUCE, devices=t.devices, segment=t.copies[-1][0], phase="step", tensor="grads",
                   bytes=t.tie.bytes, attrs=attrs)] if not n else [  # FSDP2: each position's shard, as torch cuts it
            Op(kind=OpKind.ALL_REDUCE, devices=tuple(plan.segments[k].devices[r] for k, _, _ in t.copies),
               segment=t.copies[-1][0], phase="step", tensor="grads", bytes=b, attrs={**attrs, "shard": r})
            for r, b in enumerate(shard_bytes(t.tie, n))]
        for op in made:
            for d in op.devices:
                lst = ops[d]
                at = next((i for i, o in enumerate(lst) if o.phase == "step" and "tie" not in o.attrs), len(lst))
                lst.insert(at, op)
    return plan.with_ops(ops)


def check(spec, graph: ModelGraph, groups) -> list[Diagnostic]:
    """P080 for a tie across segments that placer cannot keep (`groups`: layer indices per segment)."""
    segments = [PlacedSegment(index=k, name=s.name, layers=tuple(graph.names[i] for i in idx), devices=s.devices,
                              mode=s.mode) for k, (s, idx) in enumerate(zip(spec.placement, groups))]
    if lockstep(spec, segments) and not has_groups(segments):  # replica pipelines: the tie's all-reduce spans every copy
        return [d for t in placed(segments, graph) for d in _replica_tie(spec, t)]
    out = []
    for t in placed(segments, graph):
        bad = next((spec.placement[k] for k, _, _ in t.copies if len(spec.placement[k].devices) > 1), None)
        if bad is None:
            continue
        where = " and ".join(f"{layer!r} (segment {spec.placement[k].name!r})" for k, layer, _ in t.copies)
        out.append(Diagnostic(
            "P080", f"parameter {t.tie.name!r} is tied: layers {where} use it, and segment {bad.name!r} is "
            f"{bad.mode} over {len(bad.devices)} devices; placer keeps a tie across segments only between segments "
            "on one device each, or data groups of one size run in lockstep", bad.loc,
            "place the tied layers' segments on one device each, or data parallel over groups of one size (sync "
            "allreduce, shard none or optimizer), or the layers in one segment; untied, the copies would train apart"))
    return out


def _replica_tie(spec, t: PlacedTie) -> list[Diagnostic]:
    """P080 for a tie across replica pipelines whose data group syncs otherwise than by an
    all-reduce of whole gradients: a parameter server or a broadcast root steps the copy alone
    and sends back only what its own sync holds, which leaves the tie's copy out (the tie's
    all-reduce sums it); an FSDP2 group holds 1/d of its copy's gradient on each rank, which only
    the same shard of another FSDP2 group's copy can be summed with."""
    full = {spec.placement[k].parallel.shard == "full" for k, _, _ in t.copies}
    for k, _, _ in t.copies:
        seg = spec.placement[k]
        if len(seg.devices) > 1 and (seg.parallel.sync != "allreduce" or len(full) > 1):
            what = f"shard {seg.parallel.shard!r}" if seg.parallel.sync == "allreduce" else f"sync {seg.parallel.sync!r}"
            where = " and ".join(f"{layer!r} (segment {spec.placement[j].name!r})" for j, layer, _ in t.copies)
            return [Diagnostic(
                "P080", f"parameter {t.tie.name!r} is tied: layers {where} use it, and segment {seg.name!r} is data "
                f"parallel with {what}; across data groups in lockstep placer keeps a tie only where each group "
                "all-reduces whole gradients (shard none or optimizer), or where every group holding a copy is "
                "fully sharded (FSDP2: summed shard by shard)", seg.loc,
                "use sync allreduce and one shard option on the tied layers' segments, or place the tied layers in "
                "one segment")]
    return []


def describe(t: PlacedTie, segments) -> str:
    """`wte.weight (8.0 KiB): wte on cpu:0, lm_head on cpu:1, gradients summed over cpu:0,cpu:1`."""
    from placer import units

    where = ", ".join(f"{' + '.join(l for l in t.tie.layers if l in segments[k].layers)} on "
                      f"{','.join(segments[k].devices)}" for k, _, _ in t.copies)  # every user shares its copy
    how = (f"gradients all-reduced over {','.join(t.devices)}" if len(t.devices) > 1
           else "gradients summed on the device")
    return f"{t.tie.name} ({units.size(t.tie.bytes)}): {where}; {how}"
