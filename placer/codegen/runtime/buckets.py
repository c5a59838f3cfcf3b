# buckets: gradient and parameter collectives over flat buckets of about bucket_mb each,
# so a model with many small tensors makes a few large messages instead of many small ones.
# Gradients are SUMMED, never averaged: each rank's loss is already scaled by b / B (its
# share of the global batch), so the sum over ranks is the gradient of the global mean.
import torch
import torch.distributed as dist


def _buckets(tensors, bucket_mb):
    bucket, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_mb * 2**20 or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def _grads(params):
    # A parameter without a gradient (a server that ran no forward) contributes zeros.
    params = list(params)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    # an FSDP2 shard's gradient (a DTensor): its local piece, summed with the same piece elsewhere
    return [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]


def _collective(tensors, bucket_mb, op, write_back=True):
    # op(flat) runs one collective on a bucket flattened into one tensor.
    for bucket in _buckets(tensors, bucket_mb):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        op(flat)
        if write_back:
            for t, v in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(v.view_as(t))


@torch.no_grad()
def all_reduce_grads(params, group, bucket_mb=25.0):
    """Every rank of group ends with the SUM of the group's gradients."""
    _collective(_grads(params), bucket_mb, lambda f: dist.all_reduce(f, group=group))


@torch.no_grad()
def reduce_grads(params, dst, group, bucket_mb=25.0):
    """Rank dst (a global rank in group) ends with the SUM of the group's gradients."""
    _collective(_grads(params), bucket_mb, lambda f: dist.reduce(f, dst, group=group),
                write_back=dist.get_rank() == dst)


@torch.no_grad()
def broadcast_params(params, src, group, bucket_mb=25.0):
    """Every rank of group ends with rank src's parameter values."""
    _collective(list(params), bucket_mb, lambda f: dist.broadcast(f, src, group=group))
