"""Layout moves: which bytes of a tensor go from which device to which when it changes layout.

A layout is whole on every device of a group, or cut into equal slices along one dim
(`plan.ir.Layout`). Lowering and `verify` use `moves` to know which devices a transfer
connects; the estimate counts its bytes; both see the same slices.
"""
from __future__ import annotations

from fractions import Fraction

from placer.modes import MODES
from placer.plan.ir import Layout, PlacedSegment

Move = tuple[str, str, int]


def in_layout(seg: PlacedSegment) -> Layout:
    """Layout a segment reads its input in, leaves its output in, and takes and gives back
    their gradients in: slices of the mode's `layout_dim` over the group, or whole on each
    device (one device; channel and tensor groups, which gather their slices and all-reduce
    the input gradient inside the group)."""
    return Layout(seg.devices, MODES[seg.mode].layout_dim(seg), seg.options.get("data", 1))


def transfer_layouts(op) -> tuple[Layout, Layout]:
    """The source and destination layouts of a transfer op (a 2-D side's replicas in its attrs)."""
    return (Layout(op.src, op.src_dim, op.attrs.get("src_replicas", 1)),
            Layout(op.dst, op.dst_dim, op.attrs.get("dst_replicas", 1)))


def _piece(layout: Layout, i: int) -> dict:
    """The part of the tensor device i of the layout holds: {dim: (lo, hi)} fractions."""
    if layout.dim is None:
        return {}
    n = len(layout.devices)
    return {layout.dim: (Fraction(i, n), Fraction(i + 1, n))}


def _overlap(a: dict, b: dict) -> Fraction:
    frac = Fraction(1)
    for dim in set(a) | set(b):
        lo = max(a.get(dim, (0, 1))[0], b.get(dim, (0, 1))[0])
        hi = min(a.get(dim, (0, 1))[1], b.get(dim, (0, 1))[1])
        if hi <= lo:
            return Fraction(0)
        frac *= hi - lo
    return frac


def _share(nbytes: int, j: int, n: int) -> int:
    """Bytes of slice j of n: cumulative rounding, so the slices add up to nbytes exactly."""
    return round(Fraction(nbytes * (j + 1), n)) - round(Fraction(nbytes * j, n))


def _within(layout: Layout, nbytes: int = 0):
    """(run, device, bytes) of each device but the first of a 2-D layout's runs: its replica's
    rows (1/replicas of nbytes), or their band along the layout's dim (one device's share of them)."""
    for i, run in enumerate(layout.runs() if layout.replicas > 1 else ()):
        rows = _share(nbytes, i, layout.replicas)
        for j, t in list(enumerate(run))[1:]:
            yield run, t, rows if layout.dim is None else _share(rows, j, len(run))


def moves(src: Layout, dst: Layout, nbytes: int) -> list[Move]:
    """(from, to, bytes) that take a tensor of `nbytes` from layout `src` to layout `dst`.

    Every destination device gets the part of the tensor it holds in `dst`:
    from each source device that holds a piece of it, from one holder (its
    own copy if it has one) when the source is whole on several devices.
    Nothing moves to itself. Pieces are whole bytes that add up exactly.

    A 2-D layout (replicas: rows cut across runs of devices, each run holding its rows whole on
    each device, or cut along `dim`: spatial x data's bands) sends from its replicas' first
    devices, which first gather their run's bands, and receives on them: each then copies its
    replica's rows (or their bands) to the rest of its replica (the program's `relayout` does the
    same)."""
    if src.replicas > 1 or dst.replicas > 1:
        out = [(t, run[0], b) for run, t, b in _within(src, nbytes)] if src.dim is not None else []
        out += moves(src.leaders(), dst.leaders(), nbytes)
        return out + [(run[0], t, b) for run, t, b in _within(dst, nbytes)]
    out = []
    for j, t in enumerate(dst.devices):
        want = _piece(dst, j)
        size = _share(nbytes, j, len(dst.devices)) if dst.dim is not None else nbytes
        if src.dim is None and len(src.devices) > 1:
            sources = [(t if t in src.devices else src.devices[j % len(src.devices)], Fraction(1))]
        else:
            whole = _overlap({}, want)
            sources = [(s, _overlap(_piece(src, i), want) / whole) for i, s in enumerate(src.devices)]
        acc = Fraction(0)
        for s, f in sources:
            b = round(size * (acc + f)) - round(size * acc)
            acc += f
            if s != t and b:
                out.append((s, t, b))
    return out
