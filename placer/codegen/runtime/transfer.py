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


def redistribute(x, src_ranks, dst_ranks, full_shape, dim=0, dtype=torch.float32,
                 route="direct", device="cpu"):
    """Send this rank's slice `x` (None if not in src_ranks) to the ranks of dst_ranks that
    need it; return this rank's slice for dst_ranks (None if not in dst_ranks), a new
    tensor on `device`. full_shape is the whole batch's shape, dtype the activation's."""
    rank = dist.get_rank()
    n = full_shape[dim]
    src, dst = even_slices(src_ranks, n), even_slices(dst_ranks, n)
    pieces, works, keep = {}, [], []  # pieces: start index -> tensor; keep: send buffers alive
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
                    continue
                if route == "via_host":  # device -> host memory -> (wire) -> device
                    piece = piece.cpu()
                piece = piece.contiguous()
                keep.append(piece)
                works.append(dist.isend(piece, peer))
        if rank in dst:  # post a receive for every overlap held by another rank
            a, b = dst[rank]
            for peer, (lo, hi) in src.items():
                start, stop = max(lo, a), min(hi, b)
                if start >= stop or peer == rank:
                    continue
                shape = list(full_shape)
                shape[dim] = stop - start
                buf = torch.empty(shape, dtype=dtype,
                                  device="cpu" if route == "via_host" else device)
                works.append(dist.irecv(buf, peer))
                pieces[start] = buf
        # Everything is posted before anything is waited on, so no order of ranks deadlocks.
        for w in works:
            w.wait()
        if rank not in dst:
            return None
        return torch.cat([pieces[s].to(device) for s in sorted(pieces)], dim=dim)


def redistribute_grad(grad, src_ranks, dst_ranks, full_shape, dim=0, dtype=torch.float32,
                      route="direct", device="cpu"):
    """Backward of redistribute(x, src_ranks, dst_ranks, ...): the dst ranks send the
    gradient of their slice back; return the gradient of this rank's src slice."""
    return redistribute(grad, dst_ranks, src_ranks, full_shape, dim, dtype, route, device)
