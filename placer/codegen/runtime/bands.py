# bands: a spatial group in lockstep (a module model: lockstep.py) takes the whole activation on
# each of its ranks and gives the whole output on each, as a tensor or channel group does. Each
# rank cuts its band of the input (in backward the bands' gradients are all-gathered, so every
# rank holds the whole input gradient and the first sends it back), runs SpatialSplit on it, and
# the output bands are all-gathered (in backward each keeps its band of the whole gradient, which
# every rank holds alike).
import torch
import torch.distributed as dist
import torch.nn as nn

from .channel import _all_gather_uneven
from .channel import gather_channels
from .spatial import band_ranges


class _Band(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, ranks, dim):
        bands = band_ranges(x.shape[dim], len(ranks))
        start, stop = bands[ranks.index(dist.get_rank())]
        ctx.group, ctx.ranks, ctx.dim, ctx.sizes = group, ranks, dim, [b - a for a, b in bands]
        return x.narrow(dim, start, stop - start).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_uneven(grad.contiguous(), ctx.group, ctx.sizes, ctx.dim, ctx.ranks), None, None, None


class SpatialWhole(nn.Module):
    """A SpatialSplit that takes and gives whole tensors on every rank of its group."""

    def __init__(self, split):
        super().__init__()
        self.split = split

    def forward(self, x):
        s = self.split
        band = _Band.apply(x, s.group, s.ranks, s.dim)
        sizes = [b - a for a, b in band_ranges(s.out_size, len(s.ranks))]
        return gather_channels(s(band), s.group, sizes, s.dim, s.ranks)


class ReplicaRows(nn.Module):
    """A 2-D chain group (channel or spatial x data) in lockstep: each rank takes its replica's
    rows of the whole input (in backward their gradients are all-gathered over `group`, the ranks
    at its place in every replica, so every rank holds the whole input gradient), runs `inner` (its
    replica's split, whole rows in and out) on them, and the replicas' outputs are all-gathered by
    rows, whole on every rank."""

    def __init__(self, inner, group, ranks):
        super().__init__()
        self.inner, self.group, self.ranks = inner, group, ranks

    def forward(self, x):
        sizes = [b - a for a, b in band_ranges(x.shape[0], len(self.ranks))]
        rows = _Band.apply(x, self.group, self.ranks, 0)
        return gather_channels(self.inner(rows), self.group, sizes, 0, self.ranks)
