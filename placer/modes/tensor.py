"""`tensor`: Megatron-style tensor parallelism over a segment's group.

The one rule (validate, plan, memory and the program all call `pairs`): a Linear followed,
through elementwise and Dropout layers only, by another Linear is a *pair*. The first is
split by output features (column), the second by input features (row); the layers between
run on each device's slice of the features. A pair costs one all-reduce forward (the row
half's partial sums) and, when something before it trains, one backward (the column half's
input gradient). Every other layer runs whole on every device, and the segment's input and
output are whole on every device of the group.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from placer.diagnostics import Diagnostic, name_hint
from placer.modes.base import Mode
from placer.plan.attach import Attached
from placer.plan.crossings import group_blocker
from placer.plan.ir import OpKind, union
from placer.spec.shapes import op_kind

BETWEEN = frozenset({"elementwise", "dropout"})
"""Layer kinds that may sit between the two Linears of a pair (they act on each feature alone)."""

HEAD_ATTRS = ("n_heads", "n_head", "num_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads")
"""Head counts a module model's attention reads (on the module or its `config`): each rank
runs 1/d of the heads, so each must divide by the degree."""


def pairs(kinds: Sequence[str]) -> list[tuple[int, int]]:
    """(column, row) indices of the Linear pairs among layers of these kinds, in order."""
    out, first = [], None
    for i, k in enumerate(kinds):
        if k == "linear":
            if first is None:
                first = i
            else:
                out.append((first, i))
                first = None
        elif k not in BETWEEN:
            first = None  # a layer that needs every feature breaks a pair
    return out


def check(seg, seg_layers, kinds: Sequence[str]) -> list[Diagnostic]:
    """P028 unless the segment is Linear pairs with only elementwise / Dropout layers between
    and around them: a Linear left without a partner would run whole on every device."""
    pattern = "".join({"linear": "L"}.get(k, "e" if k in BETWEEN else "x") for k in kinds)
    paired = {i for p in pairs(kinds) for i in p}
    if "x" not in pattern and paired == {i for i, c in enumerate(pattern) if c == "L"} and paired:
        return []
    at = next((i for i, c in enumerate(pattern) if c == "x" or (c == "L" and i not in paired)), 0)
    lay = seg_layers[at] if seg_layers else None
    return [Diagnostic("P028", f"segment {seg.name!r}: tensor parallel needs pairs of Linear layers "
                       f"(column split, then row split) with only elementwise layers between; found {pattern!r}",
                       lay.loc if lay else seg.loc, "L = Linear, e = elementwise or Dropout, x = other; move other "
                       "layers to another segment")]


def collectives(a: Attached, info, grads: Sequence[bool], op, replicas: int = 1, **kw) -> None:
    """The plan's all-reduces of each pair, hung on the pair's layers (`op` makes a group op;
    `replicas`: a 2-D segment's, each of which all-reduces its rows in its own group)."""
    for col, row in pairs([op_kind(l.op) for l in info]):
        a.cuts |= {col, row + 1}
        pair = f"{info[col].name}..{info[row].name}"  # the plan text's layer-range form
        a.add("post_fwd", col, op(OpKind.ALL_REDUCE, "fwd", "act", info[row].out_bytes // replicas, info[row].name,
                                  attrs={"pair": pair}, **kw))
        if grads[col]:
            a.add("post_bwd", col, op(OpKind.ALL_REDUCE, "bwd", "grad", info[col].in_bytes // replicas,
                                      info[col].name, attrs={"pair": pair}, **kw))


# -- 2-D segments (`data: D`): D replicas of consecutive devices, each split as above ------------------

def runs(devices: Sequence, replicas: int) -> list[list]:
    """The replicas: `replicas` runs of consecutive devices (or ranks)."""
    t = len(devices) // replicas
    return [list(devices[i:i + t]) for i in range(0, len(devices), t)]


def positions(devices: Sequence, replicas: int) -> list[list]:
    """The devices holding the same slices, one from each replica: the gradients' all-reduce groups."""
    return [list(g) for g in zip(*runs(devices, replicas))]


def lockstep_rows(a: Attached, seg, info, grads: Sequence[bool], op, in_bytes: int | None = None) -> None:
    """A 2-D chain group (channel, spatial) in lockstep: each rank takes its replica's rows of the
    whole input and the replicas' outputs are all-gathered by rows over each position (runtime
    bands.py ReplicaRows), as the input's gradient is in backward when something before trains
    (`in_bytes`: a tensor group's, the hidden state it cuts where it arrives, not every input of
    its first layer: bands.py replica_rows_around)."""
    first, last = info[0], info[-1]
    in_bytes = first.in_bytes if in_bytes is None else in_bytes
    assert first.in_shape is not None and last.out_shape is not None  # traced shapes
    for group in positions(seg.devices, seg.options["data"]):
        a.add("post_fwd", len(info) - 1, op(OpKind.ALL_GATHER, "fwd", "act", last.out_bytes, last.name, dim=0,
                                            devices=tuple(group), attrs={"rows": last.out_shape[0]}))
        if grads[0] and in_bytes:
            a.add("post_bwd", 0, op(OpKind.ALL_GATHER, "bwd", "grad", in_bytes, first.name, dim=0,
                                    devices=tuple(group), attrs={"rows": first.in_shape[0]}))


def replica_rows(seg, call: str) -> str:
    """What the model's forward calls for a chain group in lockstep (`call`: its split, whole
    activations in and out): a 2-D one's on this rank's replica's rows (runtime bands.py)."""
    if seg.replicas == 1:
        return call
    return f"ReplicaRows({call}, dp{seg.k}, next(p for p in {positions(seg.ranks, seg.replicas)} if rank in p))"


def sync_option(p) -> dict:
    """A 2-D segment's plan options `sync` (data's, across its replicas), where not the default
    all-reduce, and its `server`."""
    return ({"sync": p.sync} if p.sync != "allreduce" else {}) | (
        {"server": p.server} if p.sync == "parameter_server" else {})


def server_blocker(spec, seg) -> str | None:
    """A module model's 2-D group run in lockstep whose `sync: parameter_server` is on a device
    that holds no segment: every rank of lockstep runs the model's forward, which it cannot join."""
    server = seg.parallel.server if seg.parallel.sync == "parameter_server" else None
    if server and not any(server in s.devices for s in spec.placement):
        return f"with its parameter server on {server!r}, a device that holds no segment"
    return None


def check_replicas(spec, seg) -> list[Diagnostic]:
    """P033 for `shard` or `sync` without replicas; P012 for an unknown server; P025 for `shard`
    with another `sync`, as for data; P031 unless `data: D` cuts the group into replicas of at
    least 2 devices; P030 unless D divides the batch."""
    p = seg.parallel
    d, n, shard = p.data, len(seg.devices), p.shard
    if (shard != "none" or p.sync != "allreduce") and d == 1:
        what, why = (f"shard {shard!r}", "shard over") if shard != "none" else (f"sync {p.sync!r}", "sync")
        return [Diagnostic("P033", f"segment {seg.name!r}: {p.mode} with {what} needs data replicas to {why}",
                           p.loc, f"add `data: D` ({'2-D: ZeRO-1, or for tensor FSDP2 x TP, over D replicas' if shard != 'none' else '2-D'}), "
                           f"or drop {what.split()[0]}")]
    if p.server and p.server not in spec.devices:
        return [Diagnostic("P012", f"segment {seg.name!r}: server {p.server!r} is not a listed device",
                           spec.doc.loc(("placement", seg.index, "parallel", "server")),
                           name_hint("devices", p.server, spec.devices))]
    if shard != "none" and p.sync != "allreduce":
        return [Diagnostic("P025", f"segment {seg.name!r}: shard {shard!r} needs sync 'allreduce', not {p.sync!r}",
                           p.loc, "sharding splits what all-reduce replicas hold")]
    if d == 1:
        return []
    loc = spec.doc.loc(("placement", seg.index, "parallel", "data"))
    if n % d or n // d < 2:
        return [Diagnostic("P031", f"segment {seg.name!r}: data {d} does not cut its {n} devices into replicas of "
                           "at least 2 devices each", loc,
                           f"use a data degree that divides {n} and leaves 2 or more devices per replica")]
    t = spec.training
    if (t.batch_size // t.accumulate) % d:
        return [Diagnostic("P030", f"batch_size {t.batch_size} is not divisible by the {d} data replicas of "
                           f"segment {seg.name!r}", spec.doc.loc(("training", "batch_size")),
                           f"use a multiple of {d * t.accumulate}")]
    # in a pipeline placer's micro-batch loops run it, GPipe's or in the schedule's order, with a
    # shard too (ZeroSlices or FSDP2 x TP, no_prefetch_across_micro_batches)
    return []


def norms_in_replicas(seg, seg_layers) -> list[Diagnostic]:
    """W006 for a BatchNorm in a 2-D channel or spatial segment: each replica normalises over
    its own rows."""
    norms = [l for l in seg_layers if l.batchnorm] if seg.parallel.data > 1 else []
    return [Diagnostic("W006", f"layer {norms[0].name!r} {norms[0].batchnorm} a BatchNorm in 2-D segment {seg.name!r}: each replica "
                       f"normalises over its 1/{seg.parallel.data} of the batch, so run --check cannot match one "
                       "device", norms[0].loc, "drop `data` here, or use a norm without batch statistics",
                       severity="warning")] if norms else []


def replica_collectives(a: Attached, seg, info, grads: Sequence[bool], op, sizes: dict, mode=None,
                        inner=None, bf16: bool = False) -> None:
    """A 2-D segment: each replica runs the mode's collectives (`inner`: tensor's pair all-reduces
    by default; a module model's row sums are bfloat16 under `bf16`, as on one group) on its
    rows; after its backward, the devices holding the same slices all-reduce their gradients
    (one flat message each, as the program's `all_reduce_slices` sends it, before any step and
    the global gradient norm), or under `shard: full` FSDP2 gathers and reduce-scatters them per layer,
    or under `sync: broadcast` (data's, per position) the first replica's device takes their sum
    (`reduce_slices`), steps, and sends its slices to the others before the next forward
    (`broadcast_slices`), each one flat message."""
    d, mode = seg.options["data"], mode or MODE
    if inner is None:
        inner = functools.partial(module_collectives, bf16=bf16) if seg.options.get("blocks") else collectives
    for run in runs(seg.devices, d):
        inner(a, info, grads, op, d, devices=tuple(run))
    for p, group in enumerate(positions(seg.devices, d)):
        # each layer's bytes (root parameters it consumes included) less the slices others hold
        held_elems = mode.held(seg, info, len(seg.devices), p, lambda n, k, r: n // k + (r < n % k))
        layer_bytes = [sizes[l.name] - (l.params - k) * l.param_bytes // max(l.params, 1)
                       for l, (k, _) in zip(info, held_elems)]
        if seg.options.get("shard") == "full":
            fsdp_ops(a, info, layer_bytes, group, d, op, mode.fsdp_rows(seg, info, len(seg.devices), p))
            continue
        if seg.options.get("sync") == "parameter_server":  # data's, per position, over it and the server
            server = seg.options["server"]
            ps = tuple(group) + (() if server in group else (server,))
            a.step_devices = union(a.step_devices, ps)
            a.step_pre.append(op(OpKind.REDUCE, "step", "grads", sum(layer_bytes), devices=ps,
                                 attrs={"root": server, "replicas": d}))
            a.step_post.append(op(OpKind.BROADCAST, "step", "params", sum(layer_bytes), devices=ps,
                                  attrs={"root": server, "replicas": d}))
            continue
        if seg.options.get("sync") == "broadcast":
            a.seg_pre_fwd.append(op(OpKind.BROADCAST, "fwd", "params", sum(layer_bytes), devices=tuple(group),
                                    attrs={"root": group[0], "replicas": d}))
            a.step_pre.append(op(OpKind.REDUCE, "step", "grads", sum(layer_bytes), devices=tuple(group),
                                 attrs={"root": group[0], "replicas": d}))
            continue
        a.seg_post_bwd.append(op(OpKind.ALL_REDUCE, "bwd", "grads", sum(layer_bytes), devices=tuple(group),
                                 attrs={"replicas": d}))
        zero_broadcasts(a, seg, group, sum(layer_bytes), op)


def fsdp_ops(a: Attached, info, layer_bytes: Sequence[int], group, d: int, op,
             rows: Sequence[tuple[int, int] | None] = ()) -> None:
    """`shard: full` on a 2-D segment: FSDP2 over a position's `group` of replicas, a unit per layer
    (`layer_bytes`: what a device of the group holds of each), as for data: its parameters
    gathered before its forward and its backward, its gradients reduce-scattered after; each as
    FSDP2 pads it, to a multiple of d along dim 0 (`rows`: Mode.fsdp_rows, (dim 0, bytes a row))."""
    for i, (l, pb) in enumerate(zip(info, layer_bytes)):
        if i < len(rows) and rows[i]:
            n, row = rows[i]  # type: ignore[misc]
            pb = -(-n // d) * d * row
        if pb:
            a.cuts |= {i, i + 1}
            kw = dict(devices=tuple(group), attrs={"replicas": d})
            a.add("pre_fwd", i, op(OpKind.ALL_GATHER, "fwd", "params", pb, l.name, **kw), scale=False)
            a.add("pre_bwd", i, op(OpKind.ALL_GATHER, "bwd", "params", pb, l.name, **kw), scale=False)
            a.add("post_bwd", i, op(OpKind.REDUCE_SCATTER, "bwd", "grads", pb, l.name, **kw), scale=False,
                  weight=True)


def zero_broadcasts(a: Attached, seg, group, nbytes: int, op) -> None:
    """`shard: optimizer` on a 2-D segment (ZeroSlices): after the step, each device of a
    position's group broadcasts the 1/D of the `nbytes` of parameters it stepped."""
    if seg.options.get("shard") != "optimizer":
        return
    d, elems = seg.options["data"], nbytes // 4  # (float32 parameters)
    a.step_post += [op(OpKind.BROADCAST, "step", "params", 4 * (elems // d + (k < elems % d)),
                       devices=tuple(group), attrs={"root": root, "shard": k, "replicas": d})
                    for k, root in enumerate(group)]


# -- module models: a parallel plan per transformer block -------------------------------------------
# Inside a placed layer (a transformer block), every module that directly holds Linears is one
# group: its last Linear is the row half (attention's output, MLP's down), the ones before it
# the column halves (q, k, v; up, gate), as torchtitan's and transformers' TP plans name them.
# Each column half runs 1/d of the heads (features), its input whole; the row half sums.
# A layer that is itself a Linear (an LM head), or holds none, runs whole on every device.

def groups(l) -> list[tuple[tuple[str, ...], str]]:
    """(column halves, row half) of a module model's layer `l` (its LayerInfo.projections and
    linear_reads). A module holding several Linear-like submodules that do not all read one
    tensor: all but its last are the columns, its last the row (q, k, v then o; gate, up then
    down). Across sibling modules, by data flow: Linears that all read one tensor (BERT's
    attention.self query, key, value) are the columns of the next Linear called (attention.output's
    dense), if it takes their width; a lone Linear is the column of the next one called where that
    reads its output through elementwise work only (intermediate.dense -> GELU -> output.dense)."""
    by_parent: dict[str, list[str]] = {}
    for path, *_ in l.projections:
        by_parent.setdefault(path.rpartition(".")[0], []).append(path)
    reads = {path: (key, feeder) for path, key, feeder, *_ in l.linear_reads}
    one_input = {parent: len(ps) > 1 and all(p in reads for p in ps) and len({reads[p][0] for p in ps}) == 1
                 for parent, ps in by_parent.items()}
    out = [(tuple(ps[:-1]), ps[-1]) for parent, ps in by_parent.items() if len(ps) > 1 and not one_input[parent]]
    sizes = {p: (n_in, n_out) for p, _, n_in, n_out, _ in l.projections}
    rest = [p for p, *_ in l.linear_reads if p in sizes and not any(p in (*c, r) for c, r in out)]
    i = 0
    while i < len(rest):
        ps = by_parent[rest[i].rpartition(".")[0]]
        cols = tuple(ps) if one_input[rest[i].rpartition(".")[0]] else (rest[i],)
        row = rest[i + len(cols)] if i + len(cols) < len(rest) else None
        if row is not None and len(by_parent[row.rpartition(".")[0]]) == 1 and sizes[row][0] == sizes[cols[0]][1] and (
                len(cols) > 1 or reads[row][1] == cols[0]):
            out.append((cols, row))
            i += len(cols) + 1
        else:
            i += len(cols)
    return out


def check_module(seg, info, locs, degree: int) -> list[Diagnostic]:
    """A module model's tensor segment (LayerInfos, each one's spec loc): P084 for a Linear-like
    module tensor cannot split (transformers' Conv1D), P028 for a Linear without a partner or a
    segment with no block to split, P085 for features or heads the degree does not divide."""
    for l, loc in zip(info, locs):
        other = [(path, cls) for path, cls, *_ in l.projections if cls != "Linear"]
        if other:  # one is enough: every block of such a model holds them
            (path, cls), more = other[0], [p for p, _ in other[1:]]
            return [Diagnostic("P084", f"segment {seg.name!r}: layer {l.name!r} holds {cls} {path!r}"
                               f"{f' (and {len(more)} more)' if more else ''}, not a torch.nn.Linear: tensor parallel "
                               "splits Linears only (transformers' Conv1D keeps its weight transposed, [in, out], and "
                               "GPT-2's c_attn fuses q, k and v in one output, which a column split would cut across "
                               "q, k and v)", loc, "use mode data (or shard: full) for this segment")]
    for l, loc in zip(info, locs):  # the first refusal is enough: the other blocks are alike
        found = groups(l)
        paired = {p for cols, row in found for p in (*cols, row)}
        lone = [p for p, *_ in l.projections if p not in paired]
        if lone:
            return [Diagnostic("P028", f"segment {seg.name!r}: Linear {l.name}.{lone[0]} has no partner in its "
                               "module or in the data flow (tensor parallel splits a module's Linears as column "
                               "halves, then its last as the row half; across sibling modules, the Linears reading "
                               "one tensor, or a Linear feeding the next through elementwise work only, then the next "
                               "Linear called)", loc, "place this layer in a segment with mode data or none")]
        holders = {cols[0].rpartition(".")[0] for cols, _ in found}
        kept = [(path, name, shape) for path, name, shape in l.head_tensors if path in holders]
        if kept:  # its heads split, the tensor whole: each rank would add every head's values to its own
            path, name, shape = kept[0]
            where = f"{l.name}.{path}" if path else l.name
            return [Diagnostic("P093", f"segment {seg.name!r}: layer {l.name!r}: {where}.{name} {list(shape)} holds "
                               f"a value per head, and tensor parallel splits the heads of {where} but not this "
                               "tensor (placer splits an Embedding as wide as the heads, T5's relative position "
                               "bias, and no other per-head tensor)", loc,
                               "use mode data (or shard: full) for this segment, or keep the per-head values in "
                               "an nn.Embedding")]
        sizes = {p: (n_in, n_out) for p, _, n_in, n_out, _ in l.projections}
        for cols, row in found:
            parent = cols[0].rpartition(".")[0]  # the attention module: its columns' (BERT's self, not output)
            bad = [(f"{p} out_features", sizes[p][1]) for p in cols] + [(f"{row} in_features", sizes[row][0])]
            bad += [(f"{a} of {l.name}.{parent}" if parent else f"{a} of {l.name}", v)
                    for path, a, v in l.heads if path == parent]
            bad = [(what, v) for what, v in bad if v % degree]
            if bad:
                what, v = bad[0]
                return [Diagnostic("P085", f"segment {seg.name!r}: layer {l.name!r}: {what} is {v}, not divisible "
                                   f"by the {degree} devices of tensor parallel (each runs 1/{degree} of the "
                                   "heads and features)", loc,
                                   f"use a number of devices that divides {v}, or a model whose heads divide")]
    if not any(groups(l) for l in info):
        return [Diagnostic("P028", f"segment {seg.name!r}: tensor parallel found no transformer block to split "
                           "(a module holding Linears: q, k, v then the output; up, gate then down)",
                           locs[0] if locs else seg.loc, "place the blocks in this segment, or use mode data")]
    return []


def module_collectives(a: Attached, info, grads: Sequence[bool], op, replicas: int = 1, bf16: bool = False,
                       **kw) -> None:
    """The plan's all-reduces of each block's groups: the row half's sum forward, and in
    backward, when something before trains, one per column half (DTensor all-reduces each
    column Linear's input gradient). Under bf16 autocast the row half's partial sums are
    bfloat16; the input gradients stay float32 (autocast casts inside the Linear, after the
    DTensor input whose backward all-reduces)."""
    act = 2 if bf16 else 4
    for i, l in enumerate(info):
        sizes = {p: (n_in, n_out) for p, _, n_in, n_out, _ in l.projections}
        tokens = math.prod(l.in_shape[:-1]) if l.in_shape else 0  # rows x positions, where the trace has none
        # each Linear's own input as traced: a parent placed whole (`[model, lm_head]`) reads token ids,
        # its blocks the hidden state, and its embedding trains before them
        read = {p: (n, rg) for p, _, _, n, rg in l.linear_reads}
        for cols, row in groups(l):
            a.cuts |= {i, i + 1}
            pair = f"{'+'.join(f'{l.name}.{c}' for c in cols)}..{l.name}.{row}"
            a.add("post_fwd", i, op(OpKind.ALL_REDUCE, "fwd", "act",
                                    read.get(row, (tokens,))[0] * sizes[row][1] * act // replicas,
                                    l.name, attrs={"pair": pair}, **kw))
            for c in cols:
                n, trains_before = read.get(c, (tokens, False))
                if grads[i] or trains_before:
                    a.add("post_bwd", i, op(OpKind.ALL_REDUCE, "bwd", "grad", n * sizes[c][0] * 4 // replicas,
                                            l.name, attrs={"pair": pair}, **kw))


def module_held(l, d: int, r: int, share) -> int:
    """Parameter elements of a module model's layer that rank r of d holds: 1/d of each column
    half (weight and bias), of each row half's weight and of a table per head; the rest whole."""
    held = l.params
    sizes = {p: (n_in * n_out, n_out if bias else 0) for p, _, n_in, n_out, bias in l.projections}
    tables = {path.rpartition(".")[0]: n for path, n in l.head_tables}
    for cols, row in groups(l):
        for n in [sizes[row][0]] + [sum(sizes[c]) for c in cols]:  # a row half's bias stays whole
            held += share(n, d, r) - n
        n = tables.get(cols[0].rpartition(".")[0], 0)  # a bias per head goes with its heads
        held += share(n, d, r) - n
    return held


def planned_pairs(plan, segment: int) -> list[tuple[str, str]]:
    """The pairs the lowered plan all-reduces for a segment: what the program splits."""
    seen: dict[tuple[str, str], None] = {}  # insertion-ordered set
    for op in plan.unique_ops():
        if op.segment == segment and op.kind == OpKind.ALL_REDUCE and "pair" in op.attrs:
            col, _, row = op.attrs["pair"].partition("..")
            seen[(col, row)] = None
    return list(seen)


def held(l, row: bool, d: int, r: int, share) -> int:
    """Parameter elements of a paired Linear that rank r of d holds (`share(n, d, r)`: its part
    of n split d ways); `row`: the row half, which keeps its whole bias."""
    weight = l.in_shape[-1] * l.out_shape[-1] if l.in_shape and l.out_shape else l.params
    bias = l.params - weight if row else 0
    return share(l.params - bias, d, r) + bias


def split_layers(info) -> tuple[set[str], set[str]]:
    """(every Linear of a pair, the row halves) of a segment's layers."""
    ps = pairs([op_kind(l.op) for l in info])
    return {info[i].name for p in ps for i in p}, {info[r].name for _, r in ps}


def emit_pairs(layers: Sequence[str], planned: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The pairs as child names of the program's stage (an nn.Sequential of the segment's layers)."""
    index = {name: str(i) for i, name in enumerate(layers)}
    return [(index[c], index[r]) for c, r in planned]


def emit_stage(k: int, pairs) -> list[str]:
    """The program's lines that split segment k's `stage` into the plan's pairs over group g{k}."""
    return [f"tensor_parallelize(stage, g{k}, {list(pairs)!r}, device.type)  # (column, row) Linear pairs",
            f"seg{k} = stage"]


def emit_blocks(k: int, pairs) -> list[str]:
    """A module model's segment k: each block's groups split over g{k} by their module paths."""
    split = [(tuple(cols.split("+")), row) for cols, row in pairs]
    return [f"tensor_parallelize_blocks(stage, g{k}, {split!r}, device.type)  # ((column halves), row half)",
            f"seg{k} = stage"]


def emit_groups(k: int, ranks, replicas: int) -> list[str]:
    """A 2-D segment's groups, made by every rank in the same order: g{k}, this rank's replica
    (the layers split over it), and dp{k}, the ranks holding this rank's slices in every replica."""
    out = [f"g{k} = dp{k} = None"]
    for name, groups, what in ((f"g{k}", runs(ranks, replicas), "the data replicas: each splits the layers"),
                               (f"dp{k}", positions(ranks, replicas), "the same slices in every replica")):
        out += [f"for ranks in {groups}:  # {what}",
                "    group = dist.new_group(ranks, timeout=timedelta(seconds=TIMEOUT_S))",
                f"    {name} = group if rank in ranks else {name}"]
    return out


def emit_fsdp_stage(seg) -> list[str]:
    """FSDP2 x TP, as torch's 2-D recipe builds it: a 2-D DeviceMesh (dp, tp) of the segment's
    ranks, the tensor split over its tp dim, then fully_shard per unit and root over its dp dim."""
    k, reps = seg.k, runs(seg.ranks, seg.replicas)
    tp, dp = f'mesh{k}["tp"]', f'mesh{k}["dp"]'
    split = (f"tensor_parallelize_blocks(stage, {tp}, {[(tuple(c.split('+')), r) for c, r in seg.pairs]!r}, "
             "device.type)  # ((column halves), row half)" if seg.blocks else
             f"tensor_parallelize(stage, {tp}, {list(seg.pairs)!r}, device.type)  # (column, row) Linear pairs")
    head = [f"# FSDP2 x TP: a 2-D mesh, rows the {seg.replicas} data replicas, columns the ranks of each",
            f'mesh{k} = DeviceMesh.from_group([dp{k}, g{k}], device.type, mesh={reps}, mesh_dim_names=("dp", "tp"))',
            split]
    if seg.rows_in:  # in lockstep the model's forward calls the placed layers: a unit each, each its own root
        return head + [f"seg{k} = fully_shard_layers(stage, {list(seg.layers)!r}, {dp}, device.type)  # gradients "
                       "reduce-scattered over dp"]
    return head + [f"seg{k} = fully_shard_segment(stage, {dp}, device.type)  # gradients reduce-scattered over dp",
                   f"no_prefetch_across_micro_batches(seg{k})  # (a gather the plan does not count, in a pipeline)"]


def emit_zero_slices(k: int, replicas: int, zero_args: str) -> list[str]:
    """A 2-D segment's `shard: optimizer`: ZeRO-1 over each position's group dp{k} (runtime zero_slices)."""
    return [f"opt{k} = ZeroSlices(seg{k}.parameters(), dp{k}, {zero_args})  # each steps 1/{replicas} of its slices"]


SUMMED_ON_FIRST = "gradients summed on the first replica, which steps and sends its parameters back"
"""What a 2-D segment under `sync: broadcast` does with its gradients, in the program's comments."""

SUMMED_ON_SERVER = ("gradients summed on the parameter server, rank {server}, which steps a copy of every "
                    "position's slices and sends each its own back")
"""What a 2-D segment under `sync: parameter_server` does with its gradients."""

ROOT = "dist.get_global_rank(dp{k}, 0)"
"""The program's root of this rank's position under `sync: broadcast`: the first replica's rank in dp{k}."""


def emit_broadcast(seg) -> list[str]:
    """`sync: broadcast` before the forward: each position's root sends its slices (spatial: its whole
    parameters, bucketed as data's) to the other replicas."""
    root = ROOT.format(k=seg.k)
    if seg.mode == "spatial":
        return [f"    broadcast_sync_before_forward(seg{seg.k}.parameters(), dp{seg.k}, root={root}, "
                f"bucket_mb={seg.bucket_mb!r})"]
    return [f"    broadcast_slices(seg{seg.k}, dp{seg.k}, root={root})"]


def server_groups(seg) -> list[list[int]]:
    """`sync: parameter_server`: each slice position's ranks and the server (SliceServer's groups)."""
    return [sorted(set(p) | {seg.server}) for p in positions(seg.ranks, seg.replicas)]


def emit_server(seg, cond) -> list[str]:
    """`sync: parameter_server` set-up, on every rank (groups are made by all): the groups, and on
    theirs the SliceServer, whose server's optimizer is opt{k} (`cond(ranks)`: the guard for ranks)."""
    k, ranks = seg.k, sorted({*seg.ranks, seg.server})
    body = ["with uncounted():  # set-up, not training: each position's first slices copied to the server",
            f"    srv{k} = SliceServer(seg{k}, ps{k}, {positions(seg.ranks, seg.replicas)}, server={seg.server}, "
            "make_optimizer=make_optimizer)", f"opt{k} = srv{k}.optimizer  # (None but on the server)"]
    return [f"# the parameter server, rank {seg.server}, keeps a copy of every position's slices and steps them",
            f"ps{k} = [dist.new_group(ranks, timeout=timedelta(seconds=TIMEOUT_S)) for ranks in {server_groups(seg)}]",
            f"record{k} = asked_anywhere(args.grads) and not resuming(args)  # run --check: the first gradients",
            *([f"if {cond(ranks)}:", *("    " + line for line in body)] if cond(ranks) else body)]


def emit_sync(seg) -> tuple[tuple[int, ...], list[str]]:
    """A 2-D segment's gradient sync (the same slices summed over the replicas) and step (under
    `sync: broadcast` the sum on the first replica, whose ranks alone hold an optimizer)."""
    if seg.shard == "full":  # FSDP2 reduce-scattered them in backward
        return seg.ranks, [f"opt{seg.k}.step()"]
    if seg.sync == "parameter_server":
        k = seg.k
        return tuple(sorted({*seg.ranks, seg.server})), [
            "if step == first > 0:  # resumed: the server's copies from the slices loaded from the checkpoint",
            "    with uncounted():", f"        srv{k}.fetch()",
            'with timer("comm"):', f"    srv{k}.step()  # {SUMMED_ON_SERVER.format(server=seg.server)}",
            f"if record{k} and step == 0:  # run --check: each rank's gradients as the server summed them",
            "    with uncounted():", f"        srv{k}.grads_back()",
            f"    if seg{k} is not None:", f"        record_grads_now(seg{k}.parameters())"]
    if seg.sync == "broadcast":
        return seg.ranks, ['with timer("comm"):',
                           f"    reduce_slices(seg{seg.k}, dp{seg.k}, root={ROOT.format(k=seg.k)})  # summed on the "
                           f"first of the {seg.replicas} data replicas",
                           f"if opt{seg.k} is not None:  # the first replica's ranks step", f"    opt{seg.k}.step()"]
    return seg.ranks, ['with timer("comm"):',
                       f"    all_reduce_slices(seg{seg.k}, dp{seg.k})  # summed over the {seg.replicas} data replicas",
                       f"opt{seg.k}.step()"]


class Tensor(Mode):
    name = "tensor"
    holds_slices = True
    rows_around = True
    options_keys = ("data", "shard", "sync", "server")
    whole_on_each = True
    forward_sends_activations = True

    lockstep_group = True

    def rough_sync_bytes(self, param_bytes, out_bytes, n, options):  # activations' all-reduces, fwd and bwd
        return 4 * out_bytes / options.get("data", 1) + 2 * param_bytes / n

    def reshard_blocker(self, seg):  # DTensor's Shard(0) / Shard(1) of the model's Linears
        return ("is tensor parallel over data replicas or a module's blocks"
                if seg.replicas > 1 or seg.blocks or seg.shard != "none" else None)

    def module_model_blocker(self, spec, seg):
        if len(spec.placement) == 1:  # (the whole model: no lockstep)
            return None
        return server_blocker(spec, seg) or group_blocker(spec.placement, seg.index)

    def check(self, seg, seg_layers, kinds, pipelined):
        return check(seg, seg_layers, kinds)

    def check_module(self, seg, info, locs, degree):
        return check_module(seg, info, locs, degree // seg.parallel.data)  # (a 2-D segment: each replica's)

    def check_options(self, spec, seg):
        return check_replicas(spec, seg)

    def data_degree(self, n, replicas=1):
        return replicas

    def options(self, p, layers, graph):
        return ({} if graph.traced_with == "inline" else {"blocks": True}) | (
            {"data": p.data} if p.data > 1 else {}) | ({"shard": p.shard} if p.shard != "none" else {}) | sync_option(p)

    def collectives(self, a, seg, info, grads, op, ctx):
        if seg.options.get("data", 1) > 1:
            replica_collectives(a, seg, info, grads, op, ctx.sizes, bf16=ctx.bf16)
            if ctx.lockstep:  # beside other segments: rows cut as they arrive, gathered whole after
                lockstep_rows(a, seg, info, grads, op, ctx.rows_in)
        elif seg.options.get("blocks"):
            module_collectives(a, info, grads, op, bf16=ctx.bf16)
        else:
            collectives(a, info, grads, op)

    def sliced_dims(self, seg, info):
        if seg.options.get("blocks"):  # inside a block only: its input and output are whole
            return [None] * len(info)
        split, rows = split_layers(info)
        out, inside = [], False
        for l in info:  # a column half's output is cut by features until its row half sums it
            inside = (inside or l.name in split) and l.name not in rows
            out.append(len(l.out_shape) - 1 if inside and l.out_shape else None)
        return out

    def held(self, seg, info, d, r, share):
        d, r = d // seg.options.get("data", 1), r % (d // seg.options.get("data", 1))  # (a 2-D segment: its replica's)
        if seg.options.get("blocks"):
            return [(module_held(l, d, r, share), l.buffer_bytes) for l in info]
        split, rows = split_layers(info)
        return [(held(l, l.name in rows, d, r, share) if l.name in split else l.params, l.buffer_bytes)
                for l in info]

    def describe(self, seg, devices):
        if seg.replicas > 1:
            what = "each block's projections" if seg.blocks else "the Linear pairs"
            how = ("parameters sharded over the replicas by FSDP2 (FSDP2 x TP)" if seg.shard == "full" else
                   SUMMED_ON_FIRST if seg.sync == "broadcast" else SUMMED_ON_SERVER.format(server=seg.server)
                   if seg.sync == "parameter_server" else "gradients summed over the replicas after backward")
            return (f"tensor x data: {seg.replicas} data replicas {runs(seg.ranks, seg.replicas)}, each splitting "
                    f"{what} by columns then rows; {how}")
        if seg.blocks:
            return (f"tensor parallel over {len(seg.ranks)} ranks: in each block, q/k/v and up/gate split by columns "
                    "(heads), the output and down projections by rows; other layers whole")
        return f"tensor parallel, Linear pairs split by columns then rows over {len(seg.ranks)} ranks"

    def runtime(self, seg, torch_pipeline):
        return ({"tensor", "sharding"} if seg.shard == "full" else {"tensor", "zero_slices"}
                if seg.shard == "optimizer" else {"tensor"}) | ({"bands"} if seg.rows_in else set())

    def recompute_blocker(self, p):
        return "FSDP2 gathers the parameters in its forward" if p.shard == "full" else None

    def emit_sync(self, seg):
        return emit_sync(seg) if seg.replicas > 1 else super().emit_sync(seg)

    def emit_stage(self, seg, resumable):
        if seg.shard == "full":
            return emit_fsdp_stage(seg)
        if seg.blocks:
            return emit_blocks(seg.k, seg.pairs)
        return emit_stage(seg.k, seg.pairs)


MODE = Tensor()
