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
from placer.modes import data, tensor
from placer.modes.base import Mode
from placer.plan.attach import Attached, bucket_ops
from placer.plan.crossings import group_blocker
from placer.plan.ir import OpKind
from placer.spec import shapes
from placer.spec.types import DEFAULT_PARALLEL

KINDS = {"conv", "pool", "elementwise", "batchnorm"}
"""Layer kinds a band runs (BatchNorm as SyncBatchNorm over the group: the statistics of every band)."""


def check(seg, seg_layers, kinds: Sequence[str]) -> list[Diagnostic]:
    """P026 for a layer a band cannot run, or a Conv/Pool option it cannot reproduce."""
    bad = [l for l, k in zip(seg_layers, kinds) if k not in KINDS]
    option = next(((l, why) for l in seg_layers if (why := _option(l))), None)
    if bad:
        return [Diagnostic("P026", f"segment {seg.name!r}: layer {bad[0].name!r} ({bad[0].op}) cannot be split "
                           "spatially", bad[0].loc, "spatial segments hold Conv, Pool, BatchNorm and elementwise layers only")]
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


def band_copy(geo: dict | None, l, axis: int, d: int) -> int:
    """Bytes (global batch, so d bands) of the input a Conv/Pool of a spatial segment reads and keeps
    for backward: the runtime's halo exchange makes a fresh copy of each band with its halo rows
    and the image border's padding rows (the layer pads the other dims itself). A layer that reads
    no other band's rows (a 2x2 pool on even bands) runs on the band as it is: no copy."""
    if geo is None or not l.in_shape or axis >= len(l.in_shape):
        return 0
    halo = halo_rows(geo, l, axis)
    if not halo:
        return 0
    rows = l.in_shape[axis]
    return l.in_bytes * (rows + d * (halo[0] + halo[1])) // rows


def collectives(a: Attached, info, grads: Sequence[bool], op, axis: int, n: int, geometry: Callable,
                replicas: int = 1) -> None:
    """The plan's halo exchanges around each Conv/Pool over n devices (`geometry(name)`: its
    kernel, stride, padding, dilation; `replicas`: a 2-D segment's, each exchanging its own rows'
    halos in its own group, so 1/replicas of the bytes); the weight-gradient all-reduce is
    lowering's bucketed one."""
    for i, l in enumerate(info):
        halo = halo_rows(geometry(l.name), l, axis)
        if not halo:
            continue
        top, bottom, row = halo
        row //= replicas
        a.cuts.add(i)
        attrs = {"prev_rows": top, "next_rows": bottom, "row_bytes": row}
        total = (top + bottom) * row * (n - 1)
        a.add("pre_fwd", i, op(OpKind.HALO, "fwd", "act", total, l.name, dim=axis, attrs=attrs))
        if grads[i]:
            a.add("post_bwd", i, op(OpKind.HALO, "bwd", "grad", total, l.name, dim=axis, attrs=dict(attrs)))


def lockstep_gathers(a: Attached, info, grads: Sequence[bool], op, axis: int, replicas: int = 1) -> None:
    """In lockstep (a module model) the group takes the whole input on each rank and gives the
    whole output (runtime bands.py): the output's bands all-gathered forward, and the input's
    gradient bands all-gathered backward when something before trains (`replicas`: a 2-D
    segment's, each gathering the bands of its rows in its own group)."""
    last = info[-1]
    assert last.out_shape is not None and info[0].in_shape is not None  # traced shapes
    a.add("post_fwd", len(info) - 1, op(OpKind.ALL_GATHER, "fwd", "act", last.out_bytes // replicas, last.name,
                                        dim=axis, attrs={"rows": last.out_shape[axis]}))
    if grads[0]:
        a.add("post_bwd", 0, op(OpKind.ALL_GATHER, "bwd", "grad", info[0].in_bytes // replicas, info[0].name,
                                dim=axis, attrs={"rows": info[0].in_shape[axis]}))


def emit_stage(k: int, ranks, axis: int, size: int, replicas: int = 1, shard: str = "none",
               server: int | None = None) -> list[str]:
    """The program's line that cuts segment k's `stage` into bands of dim `axis` over group g{k}
    (a 2-D segment's: this rank's replica, which runs every BatchNorm over its own bands; under
    `shard: full` its weights then sharded by FSDP2 over dp{k}, a unit per layer; a parameter
    `server` outside the group keeps the whole layers, which it steps and runs no forward of)."""
    over = f"{list(ranks)}" if replicas == 1 else f"next(r for r in {tensor.runs(ranks, replicas)} if rank in r)"
    split = [f"seg{k} = SpatialSplit(stage, g{k}, {over}, dim={axis}, size={size})"] + (
        [f"seg{k} = fully_shard_segment(seg{k}, dp{k}, device.type)  # gradients reduce-scattered over dp{k}"]
        if shard == "full" else [])
    if server is None or server in ranks:
        return split
    return [f"if rank == {server}:  # the parameter server: the whole layers, stepped here, no forward",
            f"    seg{k} = stage", "else:", *("    " + line for line in split)]


def emit_sync(k: int, bucket_mb: float, replicas: int = 1, broadcast: bool = False, shard: str = "none",
              server: int | None = None, buffers_from: int | None = None) -> list[str]:
    """After backward: every device's weight gradients (from its bands only) summed, then the step;
    a 2-D segment's over its replica's bands, then over the replicas (the ranks at its position;
    `broadcast`: data's broadcast sync, summed and stepped on the first replica's rank only; under
    `shard: full` FSDP2 reduce-scattered them over those, so the bands sum their shards; with a
    parameter `server`, data's parameter server over every rank, ps{k}: one reduce sums every
    band of every replica on it, it steps and sends the weights back; `buffers_from`: the rank
    whose buffers a server outside the group takes, as data's does)."""
    if server is not None:
        extra = f", buffers=list(seg{k}.buffers()), buffers_from={buffers_from}" if buffers_from is not None else ""
        return ["# each rank's weight gradients cover its bands only: every band of every replica summed on the "
                "server, which steps and sends the weights back", 'with timer("comm"):',
                f"    param_server_step(seg{k}.parameters(), opt{k}, ps{k}, server={server}, "
                f"bucket_mb={bucket_mb!r}{extra})"]
    across = [f"    all_reduce_grads(seg{k}.parameters(), dp{k}, bucket_mb={bucket_mb!r})  # and over the "
              f"{replicas} data replicas"] if replicas > 1 and shard != "full" else []
    step = [f"opt{k}.step()"]
    if broadcast:
        across = [f"    broadcast_sync_after_backward(seg{k}.parameters(), opt{k}, dp{k}, "
                  f"root={tensor.ROOT.format(k=k)}, bucket_mb={bucket_mb!r})  # the first replica sums and steps"]
        step = []
    return ["# each rank's weight gradients cover its bands only", 'with timer("comm"):',
            f"    all_reduce_grads(seg{k}.parameters(), g{k}, bucket_mb={bucket_mb!r})", *across, *step]


def fsdp_rows(info) -> list[tuple[int, int] | None]:
    """Mode.fsdp_rows: a Conv's or BatchNorm's output channels, whole on every device, and its
    parameter bytes per channel."""
    return [(l.out_shape[1], l.param_bytes // l.out_shape[1]) if l.params and l.out_shape else None for l in info]


def chunk_rows(n: int, d: int, r: int) -> int:
    """Shard r's rows of n over d as FSDP2 cuts dim 0 (torch.chunk: ceil(n / d) each, the last
    ones short or empty)."""
    c = -(-n // d)
    return max(0, min(c, n - r * c))


def replica_collectives(a: Attached, seg, info, grads: Sequence[bool], op, ctx) -> None:
    """A 2-D segment (`data: D`): each replica (a run of consecutive devices) exchanges the halos
    of its rows and runs every BatchNorm over its own bands; after backward each replica sums its
    bands' weight gradients, then the devices at each position sum them over the replicas."""
    d, axis = seg.options["data"], seg.options.get("axis", 2)
    runs = tensor.runs(seg.devices, d)
    for run in runs:
        def in_run(*args, _run=tuple(run), **kw):
            return op(*args, devices=_run, **kw)
        collectives(a, info, grads, in_run, axis, len(run), ctx.geometry, d)
        data.batchnorm_stats(a, info, in_run)
        if ctx.lockstep:  # (a module model) the bands of its rows gathered whole in each replica
            lockstep_gathers(a, info, grads, in_run, axis, d)
    if ctx.lockstep:  # ... then the replicas' rows over each position
        tensor.lockstep_rows(a, seg, info, grads, op)
    bks = ctx.buckets(DEFAULT_PARALLEL.bucket_mb)  # spatial has no bucket_mb option
    if seg.options.get("shard") == "full":  # FSDP2 over each position: the bands then sum their shards
        rows = fsdp_rows(info)
        for group in tensor.positions(seg.devices, d):
            tensor.fsdp_ops(a, info, [ctx.sizes[l.name] for l in info], group, d, op, rows)
        by_name = {l.name: n for l, n in zip(info, rows)}

        def part(name: str, r: int) -> int:  # replica r holds shard r: torch.chunk's rows of dim 0
            n, b = by_name[name] or (0, 0)
            return chunk_rows(n, d, r) * b if n else ctx.sizes[name] // d + (r < ctx.sizes[name] % d)
        for r, run in enumerate(runs):
            shard = [(sum(part(m, r) for m in names), names) for _, names in bks]
            a.seg_post_bwd += bucket_ops(OpKind.ALL_REDUCE, seg, tuple(run), "bwd", "grads", shard)
        return
    if seg.options.get("sync") == "parameter_server":  # data's server over every band of every replica
        server = seg.options["server"]
        ps = tuple(seg.devices) + (() if server in seg.devices else (server,))
        # every device holds the whole weights and its bands' gradients: one reduce onto the server
        # sums them all (the replica's band sum and the replicas' sum at once), then the weights back
        a.step_devices = ps
        a.step_pre += bucket_ops(OpKind.REDUCE, seg, ps, "step", "grads", bks, root=server)
        a.step_post += bucket_ops(OpKind.BROADCAST, seg, ps, "step", "params", bks, root=server, reverse=True)
        held = sum(l.buffer_bytes for l in info)
        if server not in seg.devices and held:  # a server outside ran no forward: the first device's buffers
            a.step_post.append(op(OpKind.BROADCAST, "step", "buffers", held, devices=ps,
                                  attrs={"root": seg.devices[0]}))
        return
    broadcast = seg.options.get("sync") == "broadcast"
    for group in runs + ([] if broadcast else tensor.positions(seg.devices, d)):
        a.seg_post_bwd += bucket_ops(OpKind.ALL_REDUCE, seg, tuple(group), "bwd", "grads", bks)
    for group in tensor.positions(seg.devices, d):
        if broadcast:  # data's broadcast sync, per position
            a.seg_pre_fwd += bucket_ops(OpKind.BROADCAST, seg, tuple(group), "fwd", "params", bks, root=group[0],
                                        reverse=True)
            a.step_pre += bucket_ops(OpKind.REDUCE, seg, tuple(group), "step", "grads", bks, root=group[0])
        else:  # every device holds the whole weights
            tensor.zero_broadcasts(a, seg, group, sum(b for b, _ in bks) + ctx.tied_bytes, op)


def axis_of(dim, in_shape) -> int:
    """The tensor dim `dim` names (H, W or an index) in an activation of `in_shape` (NCHW by default)."""
    nd = len(in_shape) if in_shape else 4
    if isinstance(dim, int):
        return dim
    return nd - 2 if dim in (None, "H") else nd - 1


class Spatial(Mode):
    name = "spatial"
    dcp_names = False
    options_keys = ("dim", "data", "shard", "sync", "server")
    forward_sends_activations = True
    lockstep_group = True
    chain = True

    def module_model_blocker(self, spec, seg):
        if spec.pipeline and group_blocker(spec.placement, seg.index):  # lockstep's loops run groups
            return "in a pipeline"
        if why := tensor.server_blocker(spec, seg):
            return why
        return group_blocker(spec.placement, seg.index)  # lockstep only

    def check_module(self, seg, info, locs, degree):
        from placer.modes.channel import chain_check

        return chain_check(seg, info, locs) or None  # a chain: the layer rules of inline models (P026)

    def check(self, seg, seg_layers, kinds, pipelined):
        return check(seg, seg_layers, kinds) + tensor.norms_in_replicas(seg, seg_layers)

    def check_options(self, spec, seg):
        return tensor.check_replicas(spec, seg)

    def data_degree(self, n, replicas=1):
        return replicas

    def check_shapes(self, seg, seg_layers, shapes_in) -> list[Diagnostic]:
        """P029: each device's share of the split dim must be whole at every strided layer."""
        d, dim = len(seg.devices) // seg.parallel.data, seg.parallel.dim  # (a 2-D segment: each replica's)
        for layer in seg_layers:
            s = shapes_in.get(layer.name)
            if s is None or shapes.kind(layer) not in ("conv", "pool") or len(s) < 2:
                continue
            # s has no batch dim: tensor dim k >= 0 is s[k - 1]; negative dims count from the end
            named: dict[str | int, int | None] = {"H": len(s) - 2, "W": len(s) - 1}
            axis = named.get(dim, (dim - 1 if dim >= 0 else len(s) + dim) if isinstance(dim, int) else None)
            if axis is None or not 1 <= axis < len(s):
                return [Diagnostic("P029", f"segment {seg.name!r}: split dim {dim!r} is not a spatial dim of "
                                   f"{layer.op} input {list(s)}", seg.parallel.loc, "use H or W")]
            w = shapes.window(layer)
            assert w is not None  # a conv or pool layer
            stride, size = w.stride[axis - 1] if axis <= len(w.stride) else None, s[axis]
            if isinstance(stride, int) and stride > 0 and (size % d or (size // d) % stride):
                return [Diagnostic("P029", f"segment {seg.name!r}: {layer.name!r} has {size} rows along {dim} and "
                                   f"stride {stride}; {d} devices cannot each take a whole multiple of the stride",
                                   layer.loc, f"make the input size along {dim} a multiple of {d * stride}")]
        return []

    def options(self, p, layers, graph):
        return {"dim": p.dim, "axis": axis_of(p.dim, graph.layer(layers[0]).in_shape if layers else None)} | (
            {"data": p.data} if p.data > 1 else {}) | ({"shard": p.shard} if p.shard != "none" else {}) | (
            tensor.sync_option(p))

    def layout_dim(self, seg):
        return seg.options.get("axis", 2)

    def work_cut(self, seg):
        """Each device's band of the split dim (of its replica's rows, 2-D): the layer's own padding
        stands for the halo rows, so a Conv on the band computes what the program's does on the
        band with its halo (the exchange and its copies are the plan's halo ops)."""
        replicas = seg.options.get("data", 1)
        return {0: replicas, self.layout_dim(seg): seg.degree // replicas}

    def collectives(self, a, seg, info, grads, op, ctx):
        if seg.options.get("data", 1) > 1:
            return replica_collectives(a, seg, info, grads, op, ctx)
        collectives(a, info, grads, op, self.layout_dim(seg), len(seg.devices), ctx.geometry)
        data.batchnorm_stats(a, info, op)  # SpatialSplit runs each BatchNorm over every band
        if ctx.lockstep:
            lockstep_gathers(a, info, grads, op, self.layout_dim(seg))
        # every device computes weight gradients from its own rows: sum them like data parallel
        bks = ctx.buckets(DEFAULT_PARALLEL.bucket_mb)  # spatial has no bucket_mb option
        a.seg_post_bwd = bucket_ops(OpKind.ALL_REDUCE, seg, seg.devices, "bwd", "grads", bks)

    def saved_copies(self, seg, info, d, geometry):
        """Each Conv/Pool keeps its band copy (`band_copy`) instead of its input: where the trace
        counted that input for this layer (it saved it first), only the difference is extra."""
        axis, out = self.layout_dim(seg), []
        d //= seg.options.get("data", 1)  # a 2-D segment: each replica's bands, its rows of the batch
        for l in info:
            copy = band_copy(geometry(l.name), l, axis, d) if l.op.startswith(("Conv", "MaxPool", "AvgPool")) else 0
            counted = l.in_bytes if copy and l.saves_input and l.saved_bytes >= l.in_bytes else 0
            out.append(max(0, copy - counted))
        return out

    def fsdp_rows(self, seg, info, d, r):
        return fsdp_rows(info)

    def describe(self, seg, devices):
        if seg.replicas > 1:
            return (f"spatial x data: {seg.replicas} data replicas {tensor.runs(seg.ranks, seg.replicas)}, each "
                    f"splitting dim {seg.dim} of its rows into bands (halo rows exchanged before every Conv/Pool); "
                    + (f"every band's gradients summed on the parameter server, rank {seg.server}, which steps and "
                       "sends the weights back" if seg.sync == "parameter_server" else
                       "gradients summed over each replica's bands, then " + (
                           "on the first replica, which steps and sends its parameters back"
                           if seg.sync == "broadcast" else "over the replicas")))
        return f"spatial split, 1/{len(seg.ranks)} of dim {seg.dim} each, halo rows exchanged before every Conv/Pool"

    def runtime(self, seg, torch_pipeline):
        return {"spatial", "buckets"} | ({"bands"} if seg.chained else set()) | (
            {"tensor"} if seg.replicas > 1 else set()) | (  # (replica_slice)
            {"zero_slices"} if seg.shard == "optimizer" else set()) | ({"sharding"} if seg.shard == "full" else set()) | (
            {"broadcast_sync"} if seg.sync == "broadcast" else set()) | (
            {"param_server"} if seg.sync == "parameter_server" else set())

    def recompute_blocker(self, p):
        return tensor.MODE.recompute_blocker(p)

    def chain_call(self, seg):
        return tensor.replica_rows(seg, f"SpatialWhole(seg{seg.k})")

    def emit_stage(self, seg, resumable):
        assert seg.dim is not None and seg.in_shape is not None  # set for every spatial segment
        return emit_stage(seg.k, seg.ranks, seg.dim, seg.in_shape[seg.dim], seg.replicas, seg.shard, seg.server)

    def emit_sync(self, seg):
        # a server outside the group ran no forward: it takes the first rank's buffers (none: nothing sent)
        outside = seg.server is not None and seg.server not in seg.ranks
        return seg.holders, emit_sync(seg.k, seg.bucket_mb, seg.replicas, seg.sync == "broadcast", seg.shard,
                                      seg.server, seg.ranks[0] if outside else None)


MODE = Spatial()
