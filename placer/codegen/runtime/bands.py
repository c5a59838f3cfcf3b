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


def replica_rows_around(model, entering, layers, group, ranks):
    """A 2-D tensor group (tensor x data) in lockstep: the model's forward calls its layers (the
    blocks) one by one, with the parent's glue between and around them, so the rows are cut where
    the batch arrives rather than around one call. Each leaf in `entering` ((layer, leaf) of
    another segment: the hidden state received here) is cut to this rank's replica's rows (its
    gradient all-gathered over `group` in backward, whole on every rank, as ReplicaRows), the glue
    and the replica's split layers run on those rows (the parent's own parameters there train on
    them, and are summed over the replicas with the slices), and `last`'s output is all-gathered
    by rows, whole on every rank, before lockstep sends it on. A tensor with the whole batch's rows
    that reaches the layers otherwise (made from the batch by the parent's glue: a mask) was not
    cut: stop rather than let it broadcast against the replica's rows. The first segment reads
    the batch itself (`entering` ("", 0): the model's input): it is cut as the model's forward
    begins, so all the parent's glue (TinyGPT's `+ pos`, masks) runs on the replica's rows."""
    whole = []  # the rows of the running forward, as they arrived

    def cut(leaves):
        def hook(module, args, out):
            parts = [out] if isinstance(out, torch.Tensor) else list(out)
            for i in leaves:
                whole[:] = [parts[i].shape[0]]
                parts[i] = _Band.apply(parts[i], group, ranks, 0)
            return parts[0] if isinstance(out, torch.Tensor) else type(out)(parts)
        return hook

    def cut_batch(module, args):
        whole[:] = [args[0].shape[0]]
        return (_Band.apply(args[0], group, ranks, 0), *args[1:])

    def gather(module, args, out):
        sizes = [b - a for a, b in band_ranges(whole[0], len(ranks))]
        if isinstance(out, torch.Tensor):
            return gather_channels(out, group, sizes, 0, ranks)
        return type(out)(gather_channels(t, group, sizes, 0, ranks) if isinstance(t, torch.Tensor) else t
                         for t in out)

    def uncut(name):
        def hook(module, args, kwargs):
            for t in [*args, *kwargs.values()]:
                for x in t if isinstance(t, (tuple, list)) else (t,):
                    if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == whole[0]:
                        raise RuntimeError(f"{name} reads a tensor of shape {list(x.shape)} with the whole batch's "
                                           f"{whole[0]} rows: a tensor x data group beside other segments cuts its "
                                           "replica's rows only of what arrives from other segments")
        return hook

    for name in dict.fromkeys(layer for layer, _ in entering):
        if not name:  # the model's input (Lockstep's hook, prepended, still counts the whole batch's rows)
            model.register_forward_pre_hook(cut_batch)
            continue
        model.get_submodule(name).register_forward_hook(cut([i for n, i in entering if n == name]))
    for name in layers:
        model.get_submodule(name).register_forward_pre_hook(uncut(name), with_kwargs=True)
    model.get_submodule(layers[-1]).register_forward_hook(gather, prepend=True)  # before lockstep sends it
