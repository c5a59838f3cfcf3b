# replicate: copies into and out of replicated groups (channel and tensor segments): groups
# whose ranks all hold the whole activation and, after backward, the same whole gradient of
# it. A replicated source sends from its first rank only; a replicated destination gets the
# whole tensor on every rank. Backward mirrors that: a replicated destination sends the
# gradient back from its first rank only (the others hold the same values); a replicated
# source gets it on its first rank, which broadcasts it over src_group, since every rank of
# the group needs the whole gradient. A group that is not replicated holds slices along dim
# exactly as in transfer.redistribute (a single rank is both: it holds the whole).
import torch
import torch.distributed as dist

from .transfer import redistribute, redistribute_grad


def redistribute_replicated(x, src_ranks, dst_ranks, full_shape, dim=0, src_replicated=False,
                            dst_replicated=False, src_group=None, dtype=torch.float32,
                            route="direct", device="cpu"):
    """redistribute, where either side may be replicated. Returns this rank's tensor for
    dst_ranks (the whole tensor when dst_replicated), None outside dst_ranks. Every rank of
    the program calls it. src_group is used by the gradient only."""
    src = src_ranks[:1] if src_replicated else src_ranks
    if not dst_replicated:
        return redistribute(x, src, dst_ranks, full_shape, dim, dtype, route, device)
    mine = None
    for r in dst_ranks:  # one whole copy per destination rank
        got = redistribute(x, src, [r], full_shape, dim, dtype, route, device)
        if got is not None:
            mine = got
    return mine


def redistribute_replicated_grad(grad, src_ranks, dst_ranks, full_shape, dim=0,
                                 src_replicated=False, dst_replicated=False, src_group=None,
                                 dtype=torch.float32, route="direct", device="cpu"):
    """Backward of redistribute_replicated with the same arguments: grad is this rank's
    gradient of what it received. Returns the gradient of what this rank sent (the whole
    gradient on every rank of a replicated source), None outside src_ranks."""
    src = src_ranks[:1] if src_replicated else src_ranks
    if dst_replicated:  # every dst rank holds the same gradient: the first one sends it
        grad = grad if dist.get_rank() == dst_ranks[0] else None
        dst_ranks = dst_ranks[:1]
    g = redistribute_grad(grad, src, dst_ranks, full_shape, dim, dtype, route, device)
    if not src_replicated or dist.get_rank() not in src_ranks:
        return g
    if g is None:
        g = torch.empty(full_shape, dtype=dtype, device=device)
    dist.broadcast(g, src[0], group=src_group)
    return g


def _via(src, dst):
    """How relayout moves between layouts (ranks, dim, replicated): the dim both sides cut,
    or None when they cut different dims (then the tensor goes whole through dst's first rank)."""
    (sr, sd, srep), (dr, dd, drep) = src, dst
    src_whole, dst_whole = srep or len(sr) == 1, drep or len(dr) == 1
    if src_whole or dst_whole or sd == dd:
        return dd if src_whole else sd
    return None


def relayout(x, src, dst, full_shape, src_group=None, dtype=torch.float32, route="direct",
             device="cpu"):
    """Move an activation between two groups' layouts, each (ranks, dim, replicated): slices
    along dim over ranks (rows of a data group, bands of a spatial one), or the whole tensor
    on every rank (replicated: channel and tensor groups). Every rank of the program calls."""
    dim = _via(src, dst)
    if dim is None:  # rows -> bands (or back): merge on one rank, then cut the other dim
        mid = ([dst[0][0]], dst[1], False)
        x = relayout(x, src, mid, full_shape, src_group, dtype, route, device)
        return relayout(x, mid, dst, full_shape, src_group, dtype, route, device)
    return redistribute_replicated(x, src[0], dst[0], full_shape, dim, src[2], dst[2], src_group,
                                   dtype, route, device)


def relayout_grad(grad, src, dst, full_shape, src_group=None, dtype=torch.float32,
                  route="direct", device="cpu"):
    """Backward of relayout with the same arguments: grad is this rank's gradient of what it
    received; returns the gradient of what it sent (None outside src's ranks)."""
    dim = _via(src, dst)
    if dim is None:
        mid = ([dst[0][0]], dst[1], False)
        grad = relayout_grad(grad, mid, dst, full_shape, src_group, dtype, route, device)
        return relayout_grad(grad, src, mid, full_shape, src_group, dtype, route, device)
    return redistribute_replicated_grad(grad, src[0], dst[0], full_shape, dim, src[2], dst[2],
                                        src_group, dtype, route, device)
