"""`expert`: expert parallelism over a segment's group.

Each mixture of experts in the segment (LayerInfo.experts: Hugging Face's stacked experts, one
3-D weight per projection with the expert on dim 0) spreads its E experts over the G devices,
E / G each, in order. Everything else is data parallel over the same devices (as torchtitan's
expert parallelism borrows its ranks from data parallelism): each device runs its rows of the
batch, and the dense parameters' gradients are summed over the group after backward. A mixture
of experts sends each (token, chosen expert) row to the device holding the expert and its
output back: two all-to-alls forward, two backward (their gradients), and an exchange of the
rows per expert before the first. An expert's gradient sums the rows of every device: no sync.
With `shard: full` the dense parameters are FSDP2's instead (gathered per layer, gradients
reduce-scattered), each rank's experts left out of it.

Bytes: a device hands torch its whole send buffer, its tokens x top k rows, whatever the
routing; what comes back to it (the combine's input, the dispatch's gradient) is the rows its
experts received, T x k only under uniform routing. The plan counts that uniform share for
each; the run's per-device bytes differ by the imbalance, and their sum over the group equals
the plan's (every row sent is received once).
"""
from __future__ import annotations

import math

from placer.diagnostics import Diagnostic
from placer.modes.base import Mode
from placer.plan.ir import OpKind


def moes(info) -> list[tuple[int, str, int, int, int, int, bool, float]]:
    """(layer index, path, experts, top k, hidden, expert elements, stacked, router noise) of
    each mixture of experts in the layers (LayerInfos)."""
    return [(i, path, e, k, h, n, stacked, noise)
            for i, l in enumerate(info) for (path, e, k), (_, h, n, stacked, noise) in zip(l.experts, l.expert_weights)]


def paths(layers, info) -> tuple[str, ...]:
    """The experts modules' names in the whole model (what the program cuts)."""
    return tuple(f"{layers[i]}.{p}" if p else layers[i] for i, p, *_ in moes(info))


def tokens(l, hidden: int) -> int:
    """Tokens (rows x positions) that enter the layer on the global batch: its input's elements
    over the hidden size (a hidden state), or its elements (token ids: a parent such as `model`)."""
    n = math.prod(l.in_shape or ())
    return n // hidden if l.in_shape and l.in_shape[-1] == hidden else n


def check_module(seg, info, locs, degree: int) -> list[Diagnostic]:
    """P110 without a mixture of experts; P111 unless the group's size divides each one's expert
    count; P112 for experts that are not stacked weights; P113 for a router that adds noise
    (each device would draw its own, and the reference another)."""
    found = moes(info)
    if not found:
        return [Diagnostic("P110", f"segment {seg.name!r}: mode 'expert' needs a mixture of experts in its layers, and "
                           f"{', '.join(l.name for l in info[:3])}{' ...' if len(info) > 3 else ''} hold none",
                           seg.parallel.loc, "place the MoE layers here (a block holding experts), or use mode data")]
    for i, path, e, _, _, _, stacked, noise in found:
        where = f"{info[i].name}.{path}" if path else info[i].name
        if not stacked:
            return [Diagnostic("P112", f"segment {seg.name!r}: the experts of {where!r} are not stacked as mode 'expert' "
                               "spreads them: one 3-D weight per projection, expert on dim 0, the module called as "
                               "experts(hidden, top_k_index, top_k_weights), as Hugging Face's MoE models hold them "
                               "(an nn.ModuleList is not)", locs[i],
                               "stack the experts' weights, or use mode data")]
        if e % degree:
            return [Diagnostic("P111", f"segment {seg.name!r}: {where!r} has {e} experts, not divisible by the "
                               f"{degree} devices of the group", locs[i],
                               f"use a group whose size divides {e} "
                               f"({', '.join(str(d) for d in range(2, e + 1) if e % d == 0)})")]
        if noise:
            return [Diagnostic("P113", f"segment {seg.name!r}: the router of {where!r} adds random noise to its input "
                               f"in training (jitter {noise:g}): each device draws its own, so the run cannot match "
                               "one device", locs[i], "set the model's router_jitter_noise to 0")]
    return []


def dense_bytes(info, sizes: dict, pad: int = 1) -> list[int]:
    """Per layer, the bytes of its trainable parameters other than its experts' (`sizes`: layer ->
    parameter bytes, root parameters it consumes included), each parameter's dim 0 padded to a
    multiple of `pad` as FSDP2 pads it (the experts' divides by the group: never padded)."""
    cut: dict[int, int] = {}
    for i, _, _, _, _, n, _, _ in moes(info):
        cut[i] = cut.get(i, 0) + n * info[i].param_bytes // max(info[i].params, 1)
    padding = [sum((-(-n // pad) * pad - n) * row for n, row in l.param_rows) for l in info]
    return [sizes[l.name] + padding[i] - cut.get(i, 0) for i, l in enumerate(info)]


class Expert(Mode):
    name = "expert"
    dcp_names = False
    splits_params = True
    options_keys = ("shard",)

    def check_options(self, spec, seg):
        t, n, p = spec.training, len(seg.devices), seg.parallel
        if p.shard == "optimizer" or (p.shard == "full" and (len(spec.placement) > 1 or spec.pipeline)):
            what = "shard 'optimizer'" if p.shard == "optimizer" else "shard 'full' beside other segments or in a pipeline"
            return [Diagnostic("P114", f"segment {seg.name!r}: mode 'expert' with {what} is not supported",
                               spec.doc.loc(("placement", seg.index, "parallel", "shard")),
                               "use shard 'full' (FSDP2 on the dense parameters) on an expert segment that is the "
                               "whole placement, or drop shard")]
        rows = t.batch_size // t.accumulate // (spec.pipeline.microbatches if spec.pipeline else 1)
        if rows % n == 0 or t.batch_size % t.accumulate:
            return []
        return [Diagnostic("P030", f"batch_size {t.batch_size} leaves {rows} rows a forward, not divisible by the {n} "
                           f"devices of expert segment {seg.name!r}", spec.doc.loc(("training", "batch_size")),
                           f"use a batch_size that leaves a multiple of {n} rows a forward")]

    def check(self, seg, seg_layers, kinds, pipelined):
        # inline layers (torch.nn classes) hold no mixture of experts
        return [Diagnostic("P110", f"segment {seg.name!r}: mode 'expert' needs a mixture of experts in its layers, and "
                           "inline layers hold none", seg.parallel.loc,
                           "give the model as a module (`model.module`) with MoE layers, or use mode data")]

    def check_module(self, seg, info, locs, degree):
        return check_module(seg, info, locs, degree)

    def recompute_blocker(self, p):
        return "its forward all-to-alls the tokens"

    def data_degree(self, n, replicas=1):
        return n

    def layout_dim(self, seg):
        return 0

    def torch_pipeline_blocker(self, p):
        return "an expert-parallel pipeline stage"  # placer's own loops run it (its backward sends)

    def replica_blocker(self, p):
        return None  # its layers run inside the model's forward (lockstep), which calls the cut experts

    def options(self, p, layers, graph):
        counts = [e for i, _, e, *_ in moes([graph.layer(n) for n in layers])]
        return ({"experts": max(counts)} if counts else {}) | ({"shard": "full"} if p.shard == "full" else {})

    def collectives(self, a, seg, info, grads, op, ctx):
        g = len(seg.devices)
        for i, _, e, k, h, _, _, _ in moes(info):
            h = h or (info[i].in_shape or (0,))[-1]
            rows = tokens(info[i], h) * k // g * 4 * h  # a device's (token, expert) rows, float32
            a.cuts |= {i, i + 1}
            name = info[i].name
            # the rows each device sends each expert, then the rows to the experts and their outputs back
            a.add("pre_fwd", i, op(OpKind.ALL_TO_ALL, "fwd", "counts", 8 * e, name), scale=False)
            for what in ("dispatch", "combine"):
                a.add("post_fwd", i, op(OpKind.ALL_TO_ALL, "fwd", "act", rows, name, attrs={what: e // g}))
                a.add("post_bwd", i, op(OpKind.ALL_TO_ALL, "bwd", "grad", rows, name, attrs={what: e // g}))
        full = seg.options.get("shard") == "full"
        dense = dense_bytes(info, ctx.sizes, len(seg.devices) if full else 1)
        if full:  # FSDP2 on the dense parameters, a unit per layer as data's
            for i, (l, pb) in enumerate(zip(info, dense)):
                if pb:
                    a.cuts |= {i, i + 1}
                    a.add("pre_fwd", i, op(OpKind.ALL_GATHER, "fwd", "params", pb, l.name), scale=False)
                    a.add("pre_bwd", i, op(OpKind.ALL_GATHER, "bwd", "params", pb, l.name), scale=False)
                    a.add("post_bwd", i, op(OpKind.REDUCE_SCATTER, "bwd", "grads", pb, l.name), scale=False,
                          weight=True)
        elif sum(dense) and any(grads):
            a.seg_post_bwd.append(op(OpKind.ALL_REDUCE, "bwd", "grads", sum(dense), attrs={"dense": True}))

    def held(self, seg, info, d, r, share):
        experts: dict[int, int] = {}
        for i, _, _, _, _, n, _, _ in moes(info):
            experts[i] = experts.get(i, 0) + n
        full = seg.options.get("shard") == "full"  # the dense parameters sharded too (FSDP2)
        return [((share(l.params - experts.get(i, 0), d, r) if full else l.params - experts.get(i, 0))
                 + share(experts.get(i, 0), d, r), l.buffer_bytes) for i, l in enumerate(info)]

    def held_modules(self, layers, info):
        return paths(layers, info)

    def device_notes(self, seg):  # which experts each device holds (of every mixture of experts in it)
        e, n = seg.options.get("experts", 0), len(seg.devices)
        return [f"{d}: experts {r * e // n}..{(r + 1) * e // n - 1}" for r, d in enumerate(seg.devices)]

    def plan_note(self, seg):
        return (f"expert parallel segment {seg.name!r}: all-to-all bytes, expert FLOPs and activations assume uniform "
                "routing (each device's experts receive the rows its own tokens send); a run's devices differ from "
                "them by their imbalance, and their sum equals the plan's; at worst one device's experts take every "
                "row of the group")

    def describe(self, seg, devices):
        return (f"expert parallel, {seg.rows} rows each; each mixture of experts spread over the {len(seg.ranks)} "
                "ranks, tokens sent to their experts and back by all-to-all; other gradients summed after backward")

    def runtime(self, seg, torch_pipeline):
        return {"experts", "tensor", "sharding"} if seg.shard == "full" else {"experts"}

    def emit_stage(self, seg, resumable):
        k = seg.k
        cut = [f"experts{k} = expert_parallelize(model, {list(seg.experts)!r}, g{k})  # each rank: 1/{len(seg.ranks)} "
               "of every mixture's experts, by name"]
        if seg.shard == "full":
            return [f"seg{k} = stage", *cut, f"fully_shard_segment(stage, g{k}, device.type, ignored=experts{k}.values())"
                    "  # the dense parameters: FSDP2, gradients reduce-scattered in backward"]
        return [f"seg{k} = stage", *cut]

    def emit_sync(self, seg):
        k = seg.k
        dense = "[]" if seg.shard == "full" else f"[p for n, p in named_params(seg{k}, model).items() if n not in experts{k}]"
        why = "(FSDP2 reduce-scattered the dense ones)" if seg.shard == "full" else "the dense gradients summed"
        return seg.ranks, ['with timer("comm"):', f"    expert_sync({dense}, experts{k}.values(), g{k})  # {why}",
                           f"opt{k}.step()"]

    def emit_norm_share(self, seg):
        return super().emit_norm_share(seg) + f" + list(experts{seg.k}.values())  # each rank's experts"

    def emit_gather(self, seg):
        k = seg.k
        dense = "full_tensor(p)" if seg.shard == "full" else "p"  # (FSDP2's shards gathered too)
        return [f"whole = {{n: experts_whole(p, g{k}) if n in experts{k} else {dense} for n, p in "
                f"named_params(seg{k}, model).items()}}  # segment {k}: each rank's experts gathered"]

    def emit_whole_grads(self, seg):
        k = seg.k
        return [f"WHOLE_GRADS.update(expert_grads(named_params(seg{k}, model), experts{k}, g{k}, rank == {seg.owner}))"
                "  # run --check"]


MODE = Expert()
