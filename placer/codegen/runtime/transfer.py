# transfer: move a split activation from one device group to another (copy, split, merge,
# re-split), and its gradient back. Each group holds `full_shape` cut along `dim` into
# equal contiguous slices, one per rank in group order. Every rank of the program calls
# these at the same point of the step; a rank in neither group returns at once.
import torch
import torch.distributed as dist


def even_slices(ranks, n):
    """{rank: (start, stop)}: n rows cut into equal contiguous slices, in rank-list order."""
    if n % len(ranks):
        raise ValueError(f"cannot split {n} rows evenly over ranks {ranks}")
    size = n // len(ranks)
    return {r: (i * size, (i + 1) * size) for i, r in enumerate(ranks)}


class Posted:
    """Point-to-point messages posted now and waited on together: posting everything before
    waiting on anything means no order of ranks deadlocks. A `via_host` message leaves the
    device through host memory and arrives in host memory (device -> host -> wire)."""

    def __init__(self, route):
        self.route, self.works, self.keep = route, [], []  # keep: send buffers stay alive

    def send(self, piece, peer, tag=0):
        piece = (piece.cpu() if self.route == "via_host" else piece).contiguous()
        self.keep.append(piece)
        self.works.append(dist.isend(piece, peer, tag=tag))

    def recv(self, shape, dtype, peer, device, tag=0):
        buf = torch.empty(shape, dtype=dtype, device="cpu" if self.route == "via_host" else device)
        self.works.append(dist.irecv(buf, peer, tag=tag))
        return buf

    def wait(self):
        for w in self.works:
            w.wait()

    def done(self):
        """Whether every message has gone (its buffers may be let go without waiting)."""
        return all(w.is_completed() for w in self.works)


def redistribute(x, src_ranks, dst_ranks, full_shape, dim=0, dtype=torch.float32,
                 route="direct", device="cpu", pending=None, tag=0):
    """Send this rank's slice `x` (None if not in src_ranks) to the ranks of dst_ranks that
    need it; return this rank's slice for dst_ranks (None if not in dst_ranks), a new
    tensor on `device`. full_shape is the whole batch's shape, dtype the activation's.
    `pending` (a list): a rank that only sends appends its messages there to be waited on
    later, instead of waiting now (placer's loops in a schedule's order: no send blocks);
    `tag` tells its messages from others between the same ranks (a rank with several stages)."""
    rank = dist.get_rank()
    n = full_shape[dim]
    src, dst = even_slices(src_ranks, n), even_slices(dst_ranks, n)
    pieces, posted = {}, Posted(route)  # pieces: start index -> tensor
    with torch.no_grad():
        if rank in src:  # post a send for every overlap of my slice with a dst slice
            lo, hi = src[rank]
            for peer, (a, b) in dst.items():
                start, stop = max(lo, a), min(hi, b)
                if start >= stop:
                    continue
                piece = x.narrow(dim, start - lo, stop - start)
                if peer == rank:  # in both groups: no message (torch.cat below copies)
                    pieces[start] = piece
                else:
                    posted.send(piece, peer, tag)
        if rank in dst:  # post a receive for every overlap held by another rank
            a, b = dst[rank]
            for peer, (lo, hi) in src.items():
                start, stop = max(lo, a), min(hi, b)
                if start >= stop or peer == rank:
                    continue
                shape = list(full_shape)
                shape[dim] = stop - start
                pieces[start] = posted.recv(shape, dtype, peer, device, tag)
        if rank not in dst and pending is not None:
            pending.append(posted)
            return None
        posted.wait()
        if rank not in dst:
            return None
        return torch.cat([pieces[s].to(device) for s in sorted(pieces)], dim=dim)


def redistribute_grad(grad, src_ranks, dst_ranks, full_shape, dim=0, dtype=torch.float32,
                      route="direct", device="cpu", pending=None, tag=0):
    """Backward of redistribute(x, src_ranks, dst_ranks, ...): the dst ranks send the
    gradient of their slice back; return the gradient of this rank's src slice."""
    return redistribute(grad, dst_ranks, src_ranks, full_shape, dim, dtype, route, device, pending, tag)
