# channel: a segment split by output channels. Every Linear/Conv holds 1/d of its output
# features (rows of its weight, sliced from the full layer that every rank built), so it
# needs the whole input and makes a slice of the output; per-channel layers (BatchNorm,
# pools) and elementwise ones follow on the slice; before a layer that needs every channel
# and at the segment end the slices are all-gathered along the channel dim.
# The gathered tensor is then identical on every rank and so is everything computed from it:
# each rank's gradient of it is already the whole gradient, and the backward of the gather
# only takes this rank's slice. The input of a split layer is the opposite case: every rank
# contributes part of its gradient, so it goes through copy_to_channel_group (identity
# forward, all-reduce SUM backward; Megatron's "f"). A channel group is therefore
# "replicated" at both ends: whole input and whole output on every rank (see replicate.py).
import collections
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

CHANNEL_SPLIT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# Layers that act on each channel separately (channel dim 1): they can follow a Conv's slice.
CHANNEL_WISE_LAYERS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.MaxPool1d,
                       nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
                       nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
                       nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
# Layers that act on each element separately: they can follow any slice.
ELEMENTWISE_LAYERS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
                      nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish,
                      nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.Identity,
                      nn.Hardshrink, nn.Softshrink, nn.LogSigmoid, nn.Threshold)


def channel_sizes(n, d):
    """n channels over d ranks, as evenly as possible, larger slices first: 8 over 3 is
    [3, 3, 2]. Rank i of the group (in listed order) holds slice i."""
    q, r = divmod(n, d)
    return [q + 1 if i < r else q for i in range(d)]


def _channel_slice(n, rank_index, d):
    sizes = channel_sizes(n, d)
    return sum(sizes[:rank_index]), sizes[rank_index]


def _copy_rows(dst, src, start, size):
    with torch.no_grad():
        dst.copy_(src.narrow(0, start, size))


def shard_linear(full, rank_index, d):
    """A new Linear holding rows [start, start + size) of full's weight and bias, where
    (start, size) is slice rank_index of channel_sizes(full.out_features, d). No random
    numbers are drawn (skip_init), so every rank's generator stays in step."""
    start, size = _channel_slice(full.out_features, rank_index, d)
    w = full.weight
    shard = torch.nn.utils.skip_init(nn.Linear, full.in_features, size,
                                     bias=full.bias is not None, device=w.device, dtype=w.dtype)
    _copy_rows(shard.weight, w, start, size)
    if full.bias is not None:
        _copy_rows(shard.bias, full.bias, start, size)
    return shard


def shard_conv(full, rank_index, d):
    """Conv1d/2d/3d holding output channels slice rank_index of d (weight rows, bias)."""
    if full.groups != 1:
        raise ValueError(f"channel split of a grouped convolution (groups={full.groups}) "
                         "is not supported")
    start, size = _channel_slice(full.out_channels, rank_index, d)
    w = full.weight
    shard = torch.nn.utils.skip_init(
        type(full), full.in_channels, size, full.kernel_size, stride=full.stride,
        padding=full.padding, dilation=full.dilation, groups=1, bias=full.bias is not None,
        padding_mode=full.padding_mode, device=w.device, dtype=w.dtype)
    _copy_rows(shard.weight, w, start, size)
    if full.bias is not None:
        _copy_rows(shard.bias, full.bias, start, size)
    return shard


def shard_batchnorm(full, rank_index, d):
    """BatchNorm over channel slice rank_index of d: its weight, bias and running stats."""
    start, size = _channel_slice(full.num_features, rank_index, d)
    ref = full.running_mean if full.running_mean is not None else full.weight
    shard = torch.nn.utils.skip_init(type(full), size, full.eps, full.momentum, full.affine,
                                     full.track_running_stats, device=ref.device,
                                     dtype=ref.dtype)
    for name, t in list(full.named_parameters(recurse=False)) + list(
            full.named_buffers(recurse=False)):
        if t.dim() == 0:  # num_batches_tracked
            getattr(shard, name).copy_(t)
        else:
            _copy_rows(getattr(shard, name), t, start, size)
    shard.train(full.training)
    return shard


def _group_order(group, order):
    # all_gather fills its list in group-rank order; order (global ranks) is the slice order.
    members = dist.get_process_group_ranks(group)
    order = members if order is None else list(order)
    return [order.index(r) for r in members]


def _all_gather_uneven(x, group, sizes, dim, order=None):
    """Every rank's slice along dim (sizes in slice order), concatenated in slice order.
    gloo's all_gather needs equal sizes, so slices travel padded to the largest."""
    dim = dim % x.dim()
    shape = list(x.shape)
    shape[dim] = max(sizes)
    padded = x.new_zeros(shape)
    padded.narrow(dim, 0, x.shape[dim]).copy_(x)
    bufs = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(bufs, padded, group=group)
    by_slice = [None] * len(sizes)
    for buf, index in zip(bufs, _group_order(group, order)):
        by_slice[index] = buf.narrow(dim, 0, sizes[index])
    return torch.cat(by_slice, dim=dim)


class _GatherChannels(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes, dim, order):
        dim = dim % x.dim()
        index = _group_order(group, order)[dist.get_rank(group)]
        ctx.dim, ctx.start, ctx.size = dim, sum(sizes[:index]), sizes[index]
        return _all_gather_uneven(x, group, sizes, dim, order)

    @staticmethod
    def backward(ctx, grad):
        # Every rank holds the same whole gradient (identical downstream): keep my slice.
        return grad.narrow(ctx.dim, ctx.start, ctx.size).contiguous(), None, None, None, None


def gather_channels(x, group, sizes, dim, order=None):
    """All-gather the channel slices x (this rank's, sizes[i] channels on slice i) along dim;
    every rank gets the whole tensor. order: the group's global ranks in slice order
    (default: group order). Backward: this rank's slice of the (whole, identical) gradient."""
    return _GatherChannels.apply(x, group, list(sizes), dim, order)


class _CopyToChannelGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's part of the input gradient
        return grad, None


def copy_to_channel_group(x, group):
    """Identity forward; backward sums the group's partial input gradients (Megatron f)."""
    return _CopyToChannelGroup.apply(x, group)


class ChannelSplit(nn.Sequential):
    """A segment (the full layers, in order, under their own names) split by channels over
    the global ranks `ranks` (listed order = slice order) of `group`. Children keep the
    layer names; a split layer's child is its shard, any other child is the full layer
    itself (replicated: every rank computes it identically, so its gradients agree and need
    no sync). Input: the whole tensor on every rank; output: the whole tensor on every rank."""

    def __init__(self, layers, group, ranks):
        named = list(layers.named_children()) if isinstance(layers, nn.Module) else list(layers)
        ranks = list(ranks)
        me, d = ranks.index(dist.get_rank()), len(ranks)
        children, plan, split = [], [], None  # split: (dim, sizes) of the current slice
        for name, layer in named:
            if isinstance(layer, CHANNEL_SPLIT_LAYERS):
                is_linear = isinstance(layer, nn.Linear)
                shard = (shard_linear if is_linear else shard_conv)(layer, me, d)
                n = layer.out_features if is_linear else layer.out_channels
                split = (-1 if is_linear else 1, channel_sizes(n, d))
                children.append((name, shard))
                plan.append(("split", split))
            elif split is not None and isinstance(layer, nn.modules.batchnorm._BatchNorm):
                children.append((name, shard_batchnorm(layer, me, d)))
                plan.append(("channelwise", split))
            elif split is not None and isinstance(layer, CHANNEL_WISE_LAYERS):
                children.append((name, layer))
                plan.append(("channelwise", split))
            elif split is not None and isinstance(layer, ELEMENTWISE_LAYERS):
                children.append((name, layer))
                plan.append(("elementwise", split))
            else:  # needs every channel (or nothing is split yet): runs whole
                children.append((name, layer))
                plan.append(("gather" if split is not None else "whole", split))
                split = None
        super().__init__()
        for name, child in children:
            self.add_module(name, child)
        self.group, self.ranks = group, ranks
        self._plan = plan
        self._full = dict(named)  # plain dict: the full layers are not submodules

    def sliced_parameters(self):
        """The parameters of the split layers' shards (this rank's slices)."""
        return [p for name, child in self.named_children() if child is not self._full[name] for p in child.parameters()]

    def _gather(self, x, split):
        return gather_channels(x, self.group, split[1], split[0], self.ranks)

    def forward(self, x):
        sliced = None  # the (dim, sizes) x is split by, None while x is whole
        for layer, (kind, split) in zip(self.children(), self._plan):
            if kind == "split":
                if sliced is not None:
                    x = self._gather(x, sliced)
                x = layer(copy_to_channel_group(x, self.group))
                sliced = split
            elif kind == "channelwise":
                if sliced[0] % x.dim() != 1:  # a Linear's slice of a 3-D (N, L, C) tensor
                    raise ValueError(f"{type(layer).__name__} after a channel-split Linear "
                                     f"needs 2-D input, got {x.dim()}-D")
                x = layer(x)
            elif kind == "elementwise":
                x = layer(x)
            else:
                if kind == "gather":
                    x = self._gather(x, sliced)
                    sliced = None
                x = layer(x)
        return self._gather(x, sliced) if sliced is not None else x


@torch.no_grad()
def unshard_into(full, shard, group, order=None):
    """Write the group's slices of a split layer (parameters and buffers, sliced along dim 0)
    back into the full layer, on every rank of group. A collective: every rank calls it."""
    for name, t in list(full.named_parameters(recurse=False)) + list(
            full.named_buffers(recurse=False)):
        t.copy_(whole_of_slices(getattr(shard, name), t, group, order))


def whole_of_slices(mine, full, group, order=None):
    """The whole of a split layer's tensor `full` (or of its gradient) from this rank's slice
    `mine`: the group's slices, cut along dim 0 as the split cut it, joined in rank order (a
    0-dim tensor is not cut). A collective: every rank of group calls it. Under FSDP2 over the
    data replicas `mine` is a DTensor: its slice is first gathered over the replicas."""
    mine = _whole(mine)
    if full.dim() == 0:
        return mine.detach()
    return _all_gather_uneven(mine.detach(), group, channel_sizes(full.shape[0], dist.get_world_size(group)), 0, order)


def _whole(t):
    """A DTensor (FSDP2's shard of a slice, or of a layer run whole) gathered whole over its
    mesh, a collective; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def channel_grads(split, named, keep):
    """WHOLE_GRADS' entries for a ChannelSplit: each model name of its full layers' parameters
    (`named`: name -> parameter) -> (the parameter this rank trains, keep, how its gradient is
    made whole): a shard's slices joined as channel_unshard joins its values; a layer that runs
    whole has the same gradient on every rank."""
    names = collections.defaultdict(list)
    for n, p in named.items():
        names[id(p)].append(n)
    entries = {}
    for name, child in split.named_children():
        full = split._full[name]
        for attr, p in full.named_parameters():
            mine = child.get_parameter(attr)
            whole = (_whole if hasattr(mine, "full_tensor") else None) if child is full else functools.partial(
                whole_of_slices, full=p, group=split.group, order=split.ranks)
            entries.update({n: (mine, keep, whole) for n in names[id(p)]})
    return entries


def channel_unshard(split):
    """Bring the full layers of a ChannelSplit up to date (for saving: their state_dicts
    then hold the trained values under the original names). Every rank of the group calls."""
    for name, child in split.named_children():
        if child is not split._full[name]:  # a shard
            unshard_into(split._full[name], child, split.group, split.ranks)
