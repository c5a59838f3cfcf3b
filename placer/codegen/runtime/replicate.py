# replicate: copies into and out of replicated groups (channel and tensor segments): groups
# whose ranks all hold the whole activation and, after backward, the same whole gradient of
# it. A replicated source lets each destination rank that holds a copy take its part from
# it, and sends the rest from its ranks in turn; a replicated destination gets the whole
# tensor on every rank. The gradient goes back the same way with the roles swapped: a replicated
# destination's gradient is whole (and equal) on each of its ranks, and a replicated source
# needs it whole on each of its ranks. A group that is not replicated holds slices along dim
# exactly as in transfer.redistribute (a single rank is both: it holds the whole).
from typing import NamedTuple

import torch
import torch.distributed as dist

from .transfer import Posted, even_slices, redistribute


class Layout(NamedTuple):
    """How a group of ranks holds a tensor, in torch's words: Shard(dim, ranks) cuts dim into
    even contiguous slices, one per rank in order; Replicate(ranks) is the whole tensor on each;
    Replicas(ranks, n) is n data replicas of consecutive ranks, rows cut across them, each
    replica's rows whole on each of its ranks (a 2-D segment), or with dim cut into even bands
    along dim over its ranks (spatial x data)."""

    ranks: list
    dim: int
    replicated: bool
    replicas: int = 1


def Shard(dim, ranks):
    return Layout(list(ranks), dim, False)


def Replicate(ranks):
    return Layout(list(ranks), 0, True)


def _settle(posted, receives, pending):
    """Wait for `posted`, or (a rank that only sends, given a `pending` list) leave it there to be
    waited on later: placer's loops in a schedule's order let no send hold a rank up."""
    if not receives and pending is not None:
        pending.append(posted)
    else:
        posted.wait()


def Replicas(ranks, n, dim=0):
    return Layout(list(ranks), dim, not dim, n)


def _leaders(layout):
    """A 2-D layout's first rank of each replica, holding its replica's rows (else the layout)."""
    if layout.replicas == 1:
        return layout
    return Shard(0, layout.ranks[:: len(layout.ranks) // layout.replicas])


def _runs(layout):
    t = len(layout.ranks) // layout.replicas
    return [layout.ranks[i : i + t] for i in range(0, len(layout.ranks), t)]


def _by_replicas(x, src, dst, full_shape, dtype, route, device, pending=None, tag=0):
    """relayout where a side is 2-D: it sends from its replicas' first ranks (each first gathering
    its replica's bands, spatial x data) and receives on them, and each of those then copies its
    replica's rows (or their bands) to the rest of its replica. With `pending` (placer's loops
    in a schedule's order) only the hop between the replicas' first ranks is left pending:
    the hops within a group run in the same action on all of its ranks."""
    if src.replicas > 1 and not src.replicated:  # bands of each replica's rows onto its first rank
        rows = [full_shape[0] // src.replicas, *full_shape[1:]]
        for run in _runs(src):
            got = redistribute(x, run, run[:1], rows, src.dim, dtype, route, device)
            x = got if dist.get_rank() in run else x
    lead = _leaders(src)
    mine = relayout(x if dist.get_rank() in lead.ranks else None, lead, _leaders(dst), full_shape,
                    dtype, route, device, pending, tag)
    if dst.replicas == 1:
        return mine
    rows = [full_shape[0] // dst.replicas, *full_shape[1:]]
    for run in _runs(dst):
        got = _from_copies(mine, run[:1], run, rows, dst.dim, dst.replicated, dtype, route, device)
        mine = got if dist.get_rank() in run else mine
    return mine


def _from_copies(x, holders, dst_ranks, full_shape, dim, whole, dtype, route, device, pending=None, tag=0):
    """x is the whole tensor on every rank of holders: each rank of dst_ranks gets its slice
    along dim (the whole tensor if `whole`) from its own copy if it holds one, else from a
    holder, the i-th destination from holders[i % len(holders)] (placer plan's choice).
    Returns this rank's part, None outside dst_ranks."""
    rank, n = dist.get_rank(), full_shape[dim]
    parts = {r: (0, n) for r in dst_ranks} if whole else even_slices(dst_ranks, n)
    sender = {r: r if r in holders else holders[i % len(holders)] for i, r in enumerate(dst_ranks)}
    posted, mine = Posted(route), None
    with torch.no_grad():
        for peer, (a, b) in parts.items():
            if sender[peer] == rank and peer != rank:
                posted.send(x.narrow(dim, a, b - a), peer, tag)
        if rank in parts:
            a, b = parts[rank]
            if rank in holders:
                mine = x.narrow(dim, a, b - a).clone()
            else:
                shape = list(full_shape)
                shape[dim] = b - a
                mine = posted.recv(shape, dtype, sender[rank], device, tag)
        _settle(posted, rank in parts, pending)
    return None if mine is None else mine.to(device)


def redistribute_replicated(x, src_ranks, dst_ranks, full_shape, dim=0, src_replicated=False,
                            dst_replicated=False, dtype=torch.float32, route="direct",
                            device="cpu", pending=None, tag=0):
    """redistribute, where either side may be replicated. Returns this rank's tensor for
    dst_ranks (the whole tensor when dst_replicated), None outside dst_ranks. Every rank of
    the program calls it (or, with `pending`, each side in its own turn: see redistribute)."""
    if src_replicated:
        return _from_copies(x, src_ranks, dst_ranks, full_shape, dim, dst_replicated, dtype,
                            route, device, pending, tag)
    if not dst_replicated:
        return redistribute(x, src_ranks, dst_ranks, full_shape, dim, dtype, route, device, pending, tag)
    mine = None
    for r in dst_ranks:  # one whole copy per destination rank, gathered from the slices
        got = redistribute(x, src_ranks, [r], full_shape, dim, dtype, route, device, pending, tag)
        if got is not None:
            mine = got
    return mine


def redistribute_replicated_grad(grad, src_ranks, dst_ranks, full_shape, dim=0,
                                 src_replicated=False, dst_replicated=False,
                                 dtype=torch.float32, route="direct", device="cpu", pending=None, tag=0):
    """Backward of redistribute_replicated with the same arguments: grad is this rank's
    gradient of what it received (the same whole gradient on every rank of a replicated
    destination). Returns the gradient of what this rank sent (the whole gradient on every
    rank of a replicated source), None outside src_ranks."""
    return redistribute_replicated(grad, dst_ranks, src_ranks, full_shape, dim, dst_replicated,
                                   src_replicated, dtype, route, device, pending, tag)


def _via(src, dst):
    """How relayout moves between two Layouts: the dim both sides cut,
    or None when they cut different dims (rows on one side, bands on the other)."""
    (sr, sd, srep, _), (dr, dd, drep, _) = src, dst
    src_whole, dst_whole = srep or len(sr) == 1, drep or len(dr) == 1
    if src_whole or dst_whole or sd == dd:
        return dd if src_whole else sd
    return None


def _across(x, src, dst, full_shape, dtype, route, device, pending=None, tag=0):
    """src and dst cut different dims (rows and bands): each src rank sends every dst rank the
    block where their slices meet, and each dst rank joins its blocks along src's dim."""
    (sr, sd, _, _), (dr, dd, _, _) = src, dst
    rank = dist.get_rank()
    rows, bands = even_slices(sr, full_shape[sd]), even_slices(dr, full_shape[dd])
    posted, blocks = Posted(route), {}  # blocks: start along sd -> tensor
    with torch.no_grad():
        if rank in rows:
            for peer, (a, b) in bands.items():
                block = x.narrow(dd, a, b - a)
                if peer == rank:
                    blocks[rows[rank][0]] = block
                else:
                    posted.send(block, peer, tag)
        if rank in bands:
            a, b = bands[rank]
            for peer, (lo, hi) in rows.items():
                if peer != rank:
                    shape = list(full_shape)
                    shape[sd], shape[dd] = hi - lo, b - a
                    blocks[lo] = posted.recv(shape, dtype, peer, device, tag)
        _settle(posted, rank in bands, pending)
        if rank not in bands:
            return None
        # inside no_grad: a view of x made under no_grad still requires grad, and the result
        # must be a fresh leaf, like a received tensor
        return torch.cat([blocks[k].to(device) for k in sorted(blocks)], dim=sd)


def relayout(x, src, dst, full_shape, dtype=torch.float32, route="direct", device="cpu",
             pending=None, tag=0):
    """Move an activation between two groups' Layouts: Shard (slices along dim over ranks: rows
    of a data group, bands of a spatial one) or Replicate (the whole tensor on every rank:
    channel and tensor groups, or one rank) or Replicas (2-D segments). Every rank of the program
    calls; with `pending` (placer's loops in a schedule's order) the senders call in their turn and
    the receivers in theirs, a sender's messages left in `pending`, told from others by `tag`
    (a 2-D side: through its replicas' first ranks, `_by_replicas`)."""
    if src.replicas > 1 or dst.replicas > 1:
        return _by_replicas(x, src, dst, full_shape, dtype, route, device, pending, tag)
    dim = _via(src, dst)
    if dim is None:
        return _across(x, src, dst, full_shape, dtype, route, device, pending, tag)
    return redistribute_replicated(x, src[0], dst[0], full_shape, dim, src[2], dst[2], dtype,
                                   route, device, pending, tag)


def relayout_grad(grad, src, dst, full_shape, dtype=torch.float32, route="direct", device="cpu",
                  pending=None, tag=0):
    """Backward of relayout with the same arguments: grad is this rank's gradient of what it
    received; returns the gradient of what it sent (None outside src's ranks)."""
    if src.replicas > 1 or dst.replicas > 1:  # every rank of a 2-D replica holds the same gradient
        return _by_replicas(grad, dst, src, full_shape, dtype, route, device, pending, tag)
    dim = _via(src, dst)
    if dim is None:
        return _across(grad, dst, src, full_shape, dtype, route, device, pending, tag)
    return redistribute_replicated_grad(grad, src[0], dst[0], full_shape, dim, src[2], dst[2],
                                        dtype, route, device, pending, tag)
