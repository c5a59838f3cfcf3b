"""`data`: every device of the group runs the segment's layers on its rows of the batch.

What each `sync` and `shard` option costs in the plan, as torch runs it: DDP's bucketed
all-reduce of the gradients (`allreduce`); gradients reduced to a server that steps and
broadcasts the weights (`parameter_server`); the first device's weights broadcast before the
forward and the gradients reduced to it (`broadcast`); ZeroRedundancyOptimizer (`shard:
optimizer`: the all-reduce, then each device broadcasts the ~1/d of the parameters it
stepped); FSDP2 (`shard: full`: each layer's parameters gathered around its forward and
backward, its gradients reduce-scattered); and SyncBatchNorm's statistics.
"""
from __future__ import annotations

from placer.diagnostics import Diagnostic, name_hint
from placer.modes.base import Mode
from placer.plan.attach import Attached, bucket_ops
from placer.plan.ir import Op, OpKind, PlacedSegment
from placer.spec.types import DEFAULT_PARALLEL


def check(seg, seg_layers, pipelined: bool) -> list[Diagnostic]:
    """W002 for sync_batchnorm without a BatchNorm; W006 for a BatchNorm whose statistics cover
    one device's rows only (a pipeline's W006 is the spec's, over every stage)."""
    p, n = seg.parallel, len(seg.devices)
    norms = [l for l in seg_layers if l.batchnorm]
    if p.sync_batchnorm and not norms:
        return [Diagnostic("W002", f"segment {seg.name!r}: sync_batchnorm is set but it has no BatchNorm layer",
                           p.loc, "remove sync_batchnorm", severity="warning")]
    if norms and not p.sync_batchnorm and not pipelined:
        return [Diagnostic("W006", f"layer {norms[0].name!r} {norms[0].batchnorm} a BatchNorm in data segment {seg.name!r}: each "
                           f"device normalises over its 1/{n} of the batch, so run --check cannot match one device",
                           norms[0].loc, "set sync_batchnorm: true for statistics of the whole batch",
                           severity="warning")]
    return []


def channels(l) -> int:
    """The channels of a BatchNorm's output (its statistics' length)."""
    return l.out_shape[1] if l.out_shape and len(l.out_shape) > 1 else 0


def collectives(a: Attached, seg: PlacedSegment, info, op, sizes: dict, bks: list, tied_bytes: int = 0) -> None:
    """The plan's gradient sync, sharding and BatchNorm statistics for a data segment (`sizes`:
    layer -> parameter bytes; `bks`: DDP-like gradient buckets, see plan.lower.buckets;
    `tied_bytes`: tied copies the buckets leave out, which ZeRO-1 still steps and broadcasts)."""
    o, g, i0 = seg.options, seg.devices, seg.index
    sync, shard = o.get("sync", DEFAULT_PARALLEL.sync), o.get("shard", DEFAULT_PARALLEL.shard)
    if sync == "parameter_server":
        server = o["server"]
        group = g if server in g else g + (server,)
        a.step_devices = group
        a.step_pre = bucket_ops(OpKind.REDUCE, seg, group, "step", "grads", bks, root=server)
        a.step_post = bucket_ops(OpKind.BROADCAST, seg, group, "step", "params", bks, root=server, reverse=True)
        held = sum(l.buffer_bytes for l in info)
        if server not in g and held:  # a server outside ran no forward: the first data device's buffers
            a.step_post.append(Op(kind=OpKind.BROADCAST, devices=group, segment=i0, phase="step", tensor="buffers",
                                  bytes=held, attrs={"root": g[0]}))
    elif sync == "broadcast":
        a.seg_pre_fwd = bucket_ops(OpKind.BROADCAST, seg, g, "fwd", "params", bks, root=g[0], reverse=True)
        a.step_pre = bucket_ops(OpKind.REDUCE, seg, g, "step", "grads", bks, root=g[0])
    elif shard == "full":  # FSDP: gather each layer's parameters around its use, scatter its gradients
        for i, l in enumerate(info):
            pb = sizes[l.name]
            if not pb:
                continue
            a.cuts |= {i, i + 1}
            a.add("pre_fwd", i, op(OpKind.ALL_GATHER, "fwd", "params", pb, l.name), scale=False)
            a.add("pre_bwd", i, op(OpKind.ALL_GATHER, "bwd", "params", pb, l.name), scale=False)
            a.add("post_bwd", i, op(OpKind.REDUCE_SCATTER, "bwd", "grads", pb, l.name), scale=False,
                  weight=True)
    elif shard == "optimizer":  # ZeRO-1 as torch's ZeroRedundancyOptimizer runs it: gradients
        # all-reduced (DDP), then each device steps its ~1/d of the parameters and broadcasts them
        a.seg_post_bwd = bucket_ops(OpKind.ALL_REDUCE, seg, g, "bwd", "grads", bks)
        total = sum(b for b, _ in bks) + tied_bytes
        a.step_post = [Op(kind=OpKind.BROADCAST, devices=g, segment=i0, phase="step", tensor="params",
                          bytes=total // len(g) + (k < total % len(g)), attrs={"root": root, "shard": k})
                       for k, root in enumerate(g)]
    else:
        a.seg_post_bwd = bucket_ops(OpKind.ALL_REDUCE, seg, g, "bwd", "grads", bks)
    if o.get("sync_batchnorm"):
        batchnorm_stats(a, info, op)


def batchnorm_stats(a: Attached, info, op) -> None:
    """The statistics' all-reduces of each BatchNorm run as SyncBatchNorm over the group (the
    pasted CPU version's: data's sync_batchnorm, spatial's bands)."""
    for i, l in enumerate(info):
        # a module model's layer: each BatchNorm in it (a ResNet block's two)
        for c in getattr(l, "norms", ()) or ((channels(l),) if l.op.startswith("BatchNorm") else ()):
            a.cuts |= {i, i + 1}
            # forward: (sum, sum of squares, count) in float64; backward: two float32 sums
            a.add("pre_fwd", i, op(OpKind.ALL_REDUCE, "fwd", "stats", 8 * (2 * c + 1), l.name), scale=False)
            a.add("pre_bwd", i, op(OpKind.ALL_REDUCE, "bwd", "stats", 4 * 2 * c, l.name), scale=False)


def uses_ddp(seg) -> bool:
    """Whether the program wraps a (codegen) data segment in DDP: all-reduce overlapped with
    backward, parameters to sync, and not FSDP2."""
    return seg.sync == "allreduce" and seg.overlap and seg.has_params and seg.shard != "full"


def emit_stage(k: int, shard: str, ddp: bool, bucket_mb: float, resumable: bool) -> list[str]:
    """The program's line that wraps segment k's `stage` for its group g{k}: FSDP2 for `shard: full`,
    DDP summing gradients (`ddp`: allreduce with overlap), else the stage itself."""
    if shard == "full":
        return [f"seg{k} = fully_shard_segment(stage, g{k}, device.type)  # gradients reduce-scattered in backward",
                f"no_prefetch_across_micro_batches(seg{k})  # (a gather the plan does not count, in a pipeline)"]
    if ddp:
        return [f"seg{k} = ddp_sum(stage, g{k}, bucket_mb={bucket_mb!r}, device_ids=device_ids, timing=TIME"
                + (", resumable=True)" if resumable else ")")]
    return [f"seg{k} = stage"]


def emit_optimizer(k: int, n: int, zero_args: str) -> list[str]:
    """ZeroRedundancyOptimizer for `shard: optimizer` over group g{k} of n devices."""
    return [f"opt{k} = zero_optimizer(seg{k}.parameters(), g{k}, {zero_args})  # each rank steps 1/{n}"]


def emit_sync(seg) -> tuple[tuple[int, ...], list[str]]:
    """(ranks that run them, lines): the gradient sync and step after backward of a data segment
    (a codegen Seg: ranks, server, holders, sync, overlap, shard, bucket_mb). DDP (overlap) and
    FSDP2 have synced during backward: they only step."""
    k, mb = seg.k, seg.bucket_mb
    if seg.sync == "parameter_server":
        extra = (f", buffers=list(seg{k}.buffers()), buffers_from={seg.ranks[0]}"
                 if seg.server not in seg.ranks else "")
        return seg.holders, ["# gradients up to the server, new weights back", 'with timer("comm"):',
                             f"    param_server_step(seg{k}.parameters(), opt{k}, g{k}, server={seg.server}, "
                             f"bucket_mb={mb!r}{extra})"]
    if seg.sync == "broadcast":
        return seg.ranks, ["# gradients summed on the root, which steps", 'with timer("comm"):',
                           f"    broadcast_sync_after_backward(seg{k}.parameters(), opt{k}, g{k}, "
                           f"root={seg.ranks[0]}, bucket_mb={mb!r})"]
    if seg.sync == "allreduce" and not seg.overlap and seg.shard != "full":
        return seg.ranks, ['with timer("comm"):', f"    all_reduce_grads(seg{k}.parameters(), g{k}, bucket_mb={mb!r})",
                           f"opt{k}.step()"]
    return seg.ranks, [f"opt{k}.step()"]


class Data(Mode):
    name = "data"
    options_keys = ("sync", "server", "bucket_mb", "overlap", "shard", "sync_batchnorm")

    def rough_sync_bytes(self, param_bytes, out_bytes, n, options):  # a ring all-reduce (FSDP2: gathers too)
        return 2 * param_bytes * (n - 1) / n * (1.5 if options.get("shard") == "full" else 1)

    def state_share(self, n, options):
        return 1 / n if options.get("shard") in ("optimizer", "full") else 1.0

    def reshard_blocker(self, seg):
        return f"syncs by {seg.sync}, whose copies are this program's own" if seg.sync != "allreduce" else None

    def check_options(self, spec, seg):
        # (sync parameter_server without a server, or a server without it: the schema's S002 / S004)
        p, n, diags = seg.parallel, len(seg.devices), []
        if p.server and p.server not in spec.devices:
            diags.append(Diagnostic("P012", f"segment {seg.name!r}: server {p.server!r} is not a listed device",
                                    spec.doc.loc(("placement", seg.index, "parallel", "server")),
                                    name_hint("devices", p.server, spec.devices)))
        if p.shard != "none" and p.sync != "allreduce":
            diags.append(Diagnostic("P025", f"segment {seg.name!r}: shard {p.shard!r} needs sync 'allreduce', not "
                                    f"{p.sync!r}", p.loc, "sharding splits what all-reduce replicas hold"))
        t = spec.training
        rows = t.batch_size // t.accumulate  # a micro-step's (P094 when accumulate does not divide it)
        if rows % n and not spec.pipeline and t.batch_size % t.accumulate == 0:
            what = f"batch_size {t.batch_size}" + (f" / accumulate {t.accumulate} = {rows}" if t.accumulate > 1 else "")
            diags.append(Diagnostic("P030", f"{what} is not divisible by the {n} devices of data segment "
                                    f"{seg.name!r}", spec.doc.loc(("training", "batch_size")),
                                    f"use a multiple of {n * t.accumulate}"))
        return diags

    def check(self, seg, seg_layers, kinds, pipelined):
        return check(seg, seg_layers, pipelined)

    def recompute_blocker(self, p):
        if p.shard == "full":
            return "FSDP2 gathers the parameters in its forward"  # and again in backward: a third gather
        # (and BatchNorm would update its running statistics twice)
        return "SyncBatchNorm all-reduces statistics in its forward" if p.sync_batchnorm else None

    def data_degree(self, n, replicas=1):
        return n

    def torch_pipeline_blocker(self, p):
        if p.sync == "allreduce" and p.shard == "none" and not p.sync_batchnorm:
            return None
        what = f"sync {p.sync!r}" if p.sync != "allreduce" else (
            f"shard {p.shard!r}" if p.shard != "none" else "sync_batchnorm")
        return f"a data-parallel pipeline stage with {what}"

    def replica_blocker(self, p):
        # allreduce (ZeRO-1 too), parameter_server and broadcast sync the segment's parameters
        # after the lockstep backward (the broadcast's root weights also before the forward);
        # FSDP2 shards each placed layer, which the model's forward calls (fully_shard_layers),
        # and sync_batchnorm converts the model's own BatchNorms (convert_layers)
        return None

    def options(self, p, layers, graph):
        opts = {"sync": p.sync, "bucket_mb": float(p.bucket_mb), "overlap": p.overlap, "shard": p.shard,
                "sync_batchnorm": p.sync_batchnorm}
        if p.sync == "parameter_server":
            opts["server"] = p.server
        return opts

    def layout_dim(self, seg):
        return 0

    def steppers(self, seg):
        sync = seg.options.get("sync")
        return (seg.options["server"],) if sync == "parameter_server" else seg.devices[:1] if sync == "broadcast" \
            else seg.devices

    def collectives(self, a, seg, info, grads, op, ctx):
        collectives(a, seg, info, op, ctx.sizes, ctx.buckets(seg.options.get("bucket_mb", DEFAULT_PARALLEL.bucket_mb)),
                    ctx.tied_bytes)

    def describe(self, seg, devices):
        if seg.sync == "parameter_server":
            how = f"parameter server rank {seg.server} ({devices[seg.server]})"
        elif seg.sync == "broadcast":
            how = f"parameters broadcast from rank {seg.ranks[0]}"
        elif seg.shard == "full":
            how = "parameters, gradients and optimizer state sharded (FSDP)"
        else:
            how = f"gradients all-reduced {'by DDP during backward' if seg.overlap else 'after backward'}"
        if seg.shard == "optimizer":
            how += ", optimizer state sharded (ZeRO)"
        return f"data parallel, {seg.rows} rows each, {how}"

    def runtime(self, seg, torch_pipeline):
        used = {"ddp_sum": not torch_pipeline and seg.sync == "allreduce" and seg.overlap,
                "buckets": seg.sync == "allreduce" and (not seg.overlap or torch_pipeline),
                "param_server": seg.sync == "parameter_server", "broadcast_sync": seg.sync == "broadcast",
                "syncbn": seg.sync_batchnorm, "tensor": seg.shard == "full", "sharding": seg.shard != "none"}
        return {piece for piece, on in used.items() if on}

    def zero_whole(self, seg):
        return seg.options.get("shard") == "optimizer"

    def comm_buffers(self, seg, held, largest):
        if seg.options.get("shard") == "full":  # FSDP2's are in backward only (unit_buffers)
            return 0
        if seg.options.get("sync") == "allreduce" and seg.options.get("overlap"):
            return held  # DDP's buckets: a copy of the gradients
        return 0

    def emit_stage(self, seg, resumable):
        return emit_stage(seg.k, seg.shard, uses_ddp(seg), seg.bucket_mb, resumable)

    def emit_sync(self, seg):
        return emit_sync(seg)


MODE = Data()
