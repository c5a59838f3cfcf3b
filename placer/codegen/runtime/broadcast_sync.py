# broadcast_sync: data parallel where the first rank of the group owns the weights and the
# optimizer: every step starts by copying its parameters to the others, and ends with the
# gradients summed onto it and it alone stepping. After the last step only the root is
# current; call broadcast_sync_before_forward once more before saving from other ranks.
import torch.distributed as dist

from .buckets import broadcast_params, reduce_grads


def broadcast_sync_before_forward(params, group, root, bucket_mb=25.0):
    broadcast_params(params, root, group, bucket_mb)


def broadcast_sync_after_backward(params, optimizer, group, root, bucket_mb=25.0):
    """optimizer is None except on root."""
    params = list(params)
    reduce_grads(params, root, group, bucket_mb)
    if dist.get_rank() == root:
        optimizer.step()
