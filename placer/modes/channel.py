"""`channel`: every Linear / Conv of the segment split by output channels over its group.

The one rule (`role`, shared with the program's ChannelSplit, whose layer classes a unit test
compares with it): a Linear or Conv is `split` (each device makes its slice of the output
channels from the whole input), a per-channel or per-element layer `follows` the slice, and
any other layer needs every channel, so the slices are gathered before it and at the
segment's end. The input's gradient is the sum of every slice's part: one all-reduce per
split layer that something before it trains through.
"""
from __future__ import annotations

from collections.abc import Sequence

from placer.diagnostics import Diagnostic
from placer.modes import tensor
from placer.modes.base import Mode
from placer.plan.attach import Attached
from placer.plan.crossings import group_blocker
from placer.plan.ir import OpKind
from placer.spec import shapes

KINDS = {"linear", "conv", "pool", "elementwise", "batchnorm"}
"""Layer kinds a channel segment may hold (and InstanceNorm, `NORMS`)."""
NORMS = {"InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"}
"""Norms with per-channel statistics; LayerNorm, GroupNorm, RMSNorm and LocalResponseNorm mix channels."""


def role(op: str) -> str:
    """How a layer class runs on channel slices: `split`, `follows` or `whole` (see the module doc)."""
    if shapes.op_kind(op) in ("linear", "conv"):  # not ConvTranspose
        return "split"
    if shapes.op_kind(op) in ("pool", "elementwise") or any(
            k in op for k in ("BatchNorm", "AdaptiveAvgPool", "AdaptiveMaxPool")):  # Lazy, Sync ones too
        return "follows"
    return "whole"


def channel_dim(l) -> int:
    """The channel dim of a Linear / Conv input: last for Linear, 1 for Conv."""
    return len(l.in_shape) - 1 if l.op == "Linear" and l.in_shape else 1


def check(seg, seg_layers, kinds: Sequence[str]) -> list[Diagnostic]:
    """P027 for a layer the channel split cannot run, a grouped convolution, or no Linear/Conv."""
    bad = [l for l, k in zip(seg_layers, kinds) if k not in KINDS and l.op not in NORMS]
    grouped = [l for l, k in zip(seg_layers, kinds) if k == "conv" and shapes.param(l, "groups", 1) != 1]
    diags = []
    if grouped and not bad:
        diags.append(Diagnostic("P027", f"segment {seg.name!r}: layer {grouped[0].name!r} is a grouped convolution "
                                f"(groups={shapes.param(grouped[0], 'groups', 1)}) and cannot be split by channel",
                                grouped[0].loc, "use groups: 1, or put it in a segment of its own"))
    if bad:
        diags.append(Diagnostic("P027", f"segment {seg.name!r}: layer {bad[0].name!r} ({bad[0].op}) cannot be split "
                                "by channel", bad[0].loc, "channel segments hold Linear, Conv, Pool, BatchNorm, "
                                "InstanceNorm and elementwise layers"))
    elif not any(k in ("linear", "conv") for k in kinds):
        diags.append(Diagnostic("P027", f"segment {seg.name!r} has no Linear or Conv to split by channel", seg.loc,
                                "put the Linear/Conv layers in this segment"))
    return diags


def collectives(a: Attached, info, grads: Sequence[bool], op, replicas: int = 1, **kw) -> None:
    """The plan's gathers and input-gradient all-reduces, as the program's ChannelSplit runs them
    (`replicas`: a 2-D segment's, each of which runs them on its rows in its own group)."""
    sliced = None  # the channel dim the activation is split along, None while it is whole
    for i, l in enumerate(info):
        how = role(l.op)
        if sliced is not None and how != "follows":  # this layer needs every channel: gather
            a.cuts.add(i)
            assert l.in_shape is not None  # channel segments have shapes
            a.add("pre_fwd", i, op(OpKind.ALL_GATHER, "fwd", "act", l.in_bytes // replicas, l.name, dim=sliced,
                                   attrs={"channels": l.in_shape[sliced]}, **kw))
            sliced = None
        if how == "split":  # each device makes its slice of the output channels from the whole input
            if grads[i]:  # whose gradient is the sum of every slice's part
                a.cuts |= {i, i + 1}
                a.add("post_bwd", i, op(OpKind.ALL_REDUCE, "bwd", "grad", l.in_bytes // replicas, l.name, **kw))
            sliced = channel_dim(l)
    if sliced is not None:  # the segment leaves whole outputs on every device
        last = len(info) - 1
        a.cuts.add(last + 1)
        assert info[-1].out_shape is not None  # channel segments have shapes
        a.add("post_fwd", last, op(OpKind.ALL_GATHER, "fwd", "act", info[-1].out_bytes // replicas, info[-1].name,
                                   dim=sliced, attrs={"channels": info[-1].out_shape[sliced]}, **kw))

def held(l) -> bool:
    """Whether a device holds only its slice of the layer's parameters and buffers."""
    return l.op == "Linear" or l.op.startswith(("Conv", "BatchNorm"))


def emit_stage(k: int, ranks, replicas: int = 1, shard: str = "none") -> list[str]:
    """The program's lines that split segment k's `stage` by channels over group g{k} (a 2-D
    segment's: this rank's replica; under `shard: full` each slice then sharded by FSDP2 over
    dp{k}, the ranks holding the same slices, a unit per layer as the plan gathers them)."""
    over = f"{list(ranks)}" if replicas == 1 else \
        f"next(r for r in {tensor.runs(ranks, replicas)} if rank in r)"
    return [f"full{k} = stage  # the whole layers: trained values are gathered back into them to be saved",
            f"seg{k} = ChannelSplit(stage, g{k}, {over})"] + (
        [f"seg{k} = fully_shard_segment(seg{k}, dp{k}, device.type)  # gradients reduce-scattered over dp{k}"]
        if shard == "full" else [])


def out_axis(layers, graph) -> int:
    """The channel dim of a channel segment's output: that of its last Linear / Conv."""
    for name in reversed(layers):
        info = graph.layer(name)
        if info.op == "Linear":
            return len(info.out_shape) - 1 if info.out_shape else 1
        if info.op.startswith("Conv"):
            return 1
    return 1


def chain_check(seg, info, locs) -> list[Diagnostic]:
    """P087 unless a module model's segment is a chain: each layer called once, on the previous
    one's output only, with no glue of the parent's between them, and each output read by the
    next layer alone (glue before the first: plan/crossings.check, in lockstep only). The program runs the segment's layers as an nn.Sequential, as the model's forward
    would (a ResNet stem: conv1, bn1, relu, maxpool)."""
    for i, (l, loc) in enumerate(zip(info, locs)):
        nxt = info[i + 1].name if i + 1 < len(info) else None
        why = ("is called more than once" if l.calls > 1 else
               "reads the parent's glue (work owned by no layer) made right before it" if l.glue_before and i else
               "reads more than the previous layer's output" if i and l.inputs != (info[i - 1].name,) else
               f"has an output read by more than {nxt!r}" if nxt and l.consumers != ((0, (nxt,)),) else None)
        if why:
            return [Diagnostic("P087", f"segment {seg.name!r}: layer {l.name!r} {why}: mode {seg.mode!r} runs a "
                               "module model's segment as a chain of its layers, each on the output of the one before",
                               loc, "place the layers of a plain chain (conv, norm, activation, pool) in this "
                               "segment, or use mode data or none")]
    return []


class Channel(Mode):
    name = "channel"
    dcp_names = False
    holds_slices = True
    options_keys = ("data", "shard", "sync", "server")
    whole_on_each = True
    forward_sends_activations = True

    chain = True
    lockstep_group = True

    def module_model_blocker(self, spec, seg):
        if spec.pipeline and group_blocker(spec.placement, seg.index):  # lockstep's loops run groups
            return "in a pipeline"
        if why := tensor.server_blocker(spec, seg):
            return why
        why = group_blocker(spec.placement, seg.index)  # else cut by torch.distributed.pipelining
        if why and seg.index == len(spec.placement) - 1:
            return f"as the last segment {why} (the model's own forward may still work on its output)"
        return None

    def check_module(self, seg, info, locs, degree):
        found = chain_check(seg, info, locs)
        return found or None  # a chain: the layer rules of inline models (P027) apply

    def check(self, seg, seg_layers, kinds, pipelined):
        return check(seg, seg_layers, kinds) + tensor.norms_in_replicas(seg, seg_layers)

    def check_options(self, spec, seg):
        return tensor.check_replicas(spec, seg)

    def data_degree(self, n, replicas=1):
        return replicas

    def options(self, p, layers, graph):
        return {"axis": out_axis(layers, graph)} | ({"data": p.data} if p.data > 1 else {}) | (
            {"shard": p.shard} if p.shard != "none" else {}) | tensor.sync_option(p)

    def collectives(self, a, seg, info, grads, op, ctx):
        if seg.options.get("data", 1) > 1:
            tensor.replica_collectives(a, seg, info, grads, op, ctx.sizes, self, collectives)
            if ctx.lockstep:  # (a module model) the replicas' rows gathered whole on each rank
                tensor.lockstep_rows(a, seg, info, grads, op)
        else:
            collectives(a, info, grads, op)

    def sliced_dims(self, seg, info):
        return [seg.options.get("axis", 1)] * len(info)

    def held(self, seg, info, d, r, share):  # a sliced layer: its part of the output channels
        d, r = d // seg.options.get("data", 1), r % (d // seg.options.get("data", 1))  # (a 2-D segment: its replica's)
        return [(share(l.params, d, r), share(l.buffer_bytes, d, r)) if held(l) else (l.params, l.buffer_bytes)
                for l in info]

    def fsdp_rows(self, seg, info, d, r):  # a sliced layer's parameters: its part of the output channels
        d, r = d // seg.options.get("data", 1), r % (d // seg.options.get("data", 1))
        return [(n // d + (r < n % d), l.param_bytes // n) if held(l) and l.out_shape and (
            n := l.out_shape[channel_dim(l)]) else None for l in info]

    def describe(self, seg, devices):
        if seg.replicas > 1:
            how = (tensor.SUMMED_ON_FIRST if seg.sync == "broadcast" else
                   tensor.SUMMED_ON_SERVER.format(server=seg.server) if seg.sync == "parameter_server" else
                   "each slice sharded over the replicas by FSDP2" if seg.shard == "full" else
                   "gradients summed over the replicas after backward")
            return (f"channel x data: {seg.replicas} data replicas {tensor.runs(seg.ranks, seg.replicas)}, each "
                    f"splitting every Linear/Conv's output channels; {how}")
        return f"channel split, 1/{len(seg.ranks)} of every Linear/Conv's output channels each, gathered after"

    def runtime(self, seg, torch_pipeline):
        return ({"channel", "tensor"} | ({"bands"} if seg.chained else set())  # (ReplicaRows)
                | ({"zero_slices"} if seg.shard == "optimizer" else set())
                | ({"sharding"} if seg.shard == "full" else set()) if seg.replicas > 1
                else {"channel"})  # (replica_slice, all_reduce_slices)

    def recompute_blocker(self, p):
        return tensor.MODE.recompute_blocker(p)

    def emit_norm_share_sharded(self, seg, leaders):
        # FSDP2 over channel slices: each rank's shards of its slices, and of the layers run whole
        # in its replica on its first rank
        return (f"norm_params += seg{seg.k}.sliced_parameters() + (list(seg{seg.k}.parameters()) "
                f"if rank in {leaders} else [])")

    def chain_call(self, seg):
        return tensor.replica_rows(seg, f"seg{seg.k}")

    def emit_stage(self, seg, resumable):
        return emit_stage(seg.k, seg.ranks, seg.replicas, seg.shard)

    def emit_sync(self, seg):
        return tensor.emit_sync(seg) if seg.replicas > 1 else super().emit_sync(seg)

    def emit_gather(self, seg):
        whole = f"named_params(full{seg.k}, model)"
        return [f"channel_unshard(seg{seg.k})  # segment {seg.k}: the channel slices back into the full layers",
                f"whole = whole_params({whole})  # (a layer run whole: FSDP2's shards gathered)"
                if seg.shard == "full" else f"whole = {whole}"]

    def emit_whole_grads(self, seg):
        return [f"WHOLE_GRADS.update(channel_grads(seg{seg.k}, named_params(full{seg.k}, model), rank == {seg.owner}))"
                "  # run --check: the slices' first gradients joined as channel_unshard joins their values"]


MODE = Channel()
