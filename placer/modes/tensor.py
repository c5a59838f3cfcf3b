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

from collections.abc import Sequence

from placer.diagnostics import Diagnostic
from placer.modes.base import Mode
from placer.plan.attach import Attached
from placer.plan.ir import OpKind
from placer.spec.shapes import op_kind

BETWEEN = frozenset({"elementwise", "dropout"})
"""Layer kinds that may sit between the two Linears of a pair (they act on each feature alone)."""


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


def collectives(a: Attached, info, grads: Sequence[bool], op) -> None:
    """The plan's all-reduces of each pair, hung on the pair's layers (`op` makes a group op)."""
    for col, row in pairs([op_kind(l.op) for l in info]):
        a.cuts |= {col, row + 1}
        pair = f"{info[col].name}..{info[row].name}"  # the plan text's layer-range form
        a.add("post_fwd", col, op(OpKind.ALL_REDUCE, "fwd", "act", info[row].out_bytes, info[row].name,
                                  attrs={"pair": pair}))
        if grads[col]:
            a.add("post_bwd", col, op(OpKind.ALL_REDUCE, "bwd", "grad", info[col].in_bytes, info[col].name,
                                      attrs={"pair": pair}))


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


class Tensor(Mode):
    name = "tensor"
    whole_on_each = True
    module_models = False
    forward_sends_activations = True

    def check(self, seg, seg_layers, kinds, pipelined):
        return check(seg, seg_layers, kinds)

    def collectives(self, a, seg, info, grads, op, ctx):
        collectives(a, info, grads, op)

    def sliced_dims(self, seg, info):
        split, rows = split_layers(info)
        out, inside = [], False
        for l in info:  # a column half's output is cut by features until its row half sums it
            inside = (inside or l.name in split) and l.name not in rows
            out.append(len(l.out_shape) - 1 if inside and l.out_shape else None)
        return out

    def held(self, seg, info, d, r, share):
        split, rows = split_layers(info)
        return [(held(l, l.name in rows, d, r, share) if l.name in split else l.params, l.buffer_bytes)
                for l in info]

    def describe(self, seg, devices):
        return f"tensor parallel, Linear pairs split by columns then rows over {len(seg.ranks)} ranks"

    def runtime(self, seg, torch_pipeline):
        return {"tensor"}

    def emit_stage(self, seg, resumable):
        return emit_stage(seg.k, seg.pairs)


MODE = Tensor()
