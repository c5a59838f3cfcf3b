"""`spatial`: the segment's activations cut into bands along one spatial dim over its group.

Each device computes the outputs whose windows start in its band; a Conv/Pool reads `halo_rows`
from its neighbours first (and sends their gradients back), and every device's weight
gradients, computed from its own rows, are summed like data parallelism's. `check` refuses
the layers a band cannot run (`KINDS`) and the options it cannot reproduce band by band
before the program's SpatialSplit would.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from placer.diagnostics import Diagnostic
from placer.plan.attach import Attached
from placer.plan.ir import OpKind
from placer.spec import shapes

KINDS = {"conv", "pool", "elementwise"}


def check(seg, seg_layers, kinds: Sequence[str]) -> list[Diagnostic]:
    """P026 for a layer a band cannot run, or a Conv/Pool option it cannot reproduce."""
    bad = [l for l, k in zip(seg_layers, kinds) if k not in KINDS]
    option = next(((l, why) for l in seg_layers if (why := _option(l))), None)
    if bad:
        return [Diagnostic("P026", f"segment {seg.name!r}: layer {bad[0].name!r} ({bad[0].op}) cannot be split "
                           "spatially", bad[0].loc, "spatial segments hold Conv, Pool and elementwise layers only")]
    if option:
        return [Diagnostic("P026", f"segment {seg.name!r}: layer {option[0].name!r} ({option[0].op}) cannot be "
                           f"split spatially with {option[1]}", option[0].loc,
                           "change the layer's option, or put it in a segment of its own")]
    return []


def _option(layer) -> str | None:
    """An option of a Conv/Pool layer that the spatial split cannot reproduce band by band."""
    if shapes.kind(layer) not in ("conv", "pool"):
        return None
    padding = shapes.param(layer, "padding", 0)
    if isinstance(padding, str):
        return f"padding {padding!r} (give the padding as numbers)"
    if shapes.param(layer, "padding_mode", "zeros") != "zeros":
        return f"padding_mode {shapes.param(layer, 'padding_mode')!r} (only 'zeros')"
    if shapes.param(layer, "return_indices", False):
        return "return_indices: true"
    if layer.op.startswith("AvgPool"):
        if shapes.param(layer, "ceil_mode", False):
            return "ceil_mode: true"
        if padding and not shapes.param(layer, "count_include_pad", True):
            return "padding and count_include_pad: false"
    return None


def halo_rows(geo: dict | None, l, axis: int) -> tuple[int, int, int] | None:
    """(rows from the previous device, rows from the next, bytes of one row) a Conv/Pool needs.

    A device holding input rows [lo, hi) computes the outputs whose windows start there; with
    kernel k, stride s, padding p, dilation d those windows read rows [lo - p, hi - s - p + d(k-1) + 1)."""
    if geo is None or not l.in_shape or axis >= len(l.in_shape):
        return None
    j = axis - (len(l.in_shape) - len(geo["kernel"]))
    if not 0 <= j < len(geo["kernel"]):
        return None
    k, s, p, d = (geo[key][j] for key in ("kernel", "stride", "padding", "dilation"))
    top, bottom = p, max(0, d * (k - 1) + 1 - s - p)
    if not top and not bottom:
        return None
    return top, bottom, l.in_bytes // l.in_shape[axis]


def collectives(a: Attached, info, grads: Sequence[bool], op, axis: int, n: int, geometry: Callable) -> None:
    """The plan's halo exchanges around each Conv/Pool over n devices (`geometry(name)`: its
    kernel, stride, padding, dilation); the weight-gradient all-reduce is lowering's bucketed one."""
    for i, l in enumerate(info):
        halo = halo_rows(geometry(l.name), l, axis)
        if not halo:
            continue
        top, bottom, row = halo
        a.cuts.add(i)
        attrs = {"prev_rows": top, "next_rows": bottom, "row_bytes": row}
        total = (top + bottom) * row * (n - 1)
        a.add("pre_fwd", i, op(OpKind.HALO, "fwd", "act", total, l.name, dim=axis, attrs=attrs))
        if grads[i]:
            a.add("post_bwd", i, op(OpKind.HALO, "bwd", "grad", total, l.name, dim=axis, attrs=dict(attrs)))


def emit_stage(k: int, ranks, axis: int, size: int) -> list[str]:
    """The program's line that cuts segment k's `stage` into bands of dim `axis` over group g{k}."""
    return [f"seg{k} = SpatialSplit(stage, g{k}, {list(ranks)}, dim={axis}, size={size})"]


def emit_sync(k: int, bucket_mb: float) -> list[str]:
    """After backward: every device's weight gradients (from its bands only) summed, then the step."""
    return ["# each rank's weight gradients cover its bands only", 'with timer("comm"):',
            f"    all_reduce_grads(seg{k}.parameters(), g{k}, bucket_mb={bucket_mb!r})", f"opt{k}.step()"]
