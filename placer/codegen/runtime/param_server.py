# param_server: data parallel where one server rank owns the optimizer. After backward the
# gradients are summed onto the server, only the server steps, and the new weights are
# broadcast back. `group` is the data ranks plus the server; a server outside the data
# ranks keeps its own copy of the segment's parameters and runs no forward.
import torch.distributed as dist

from .buckets import broadcast_params, reduce_grads


def param_server_step(params, optimizer, group, server, bucket_mb=25.0,
                      buffers=(), buffers_from=None):
    """Call on every rank of group after backward; optimizer is None except on server.
    A server outside the data ranks ran no forward, so its buffers (BatchNorm running
    statistics) are stale: pass them, with buffers_from = the first data rank."""
    params = list(params)
    reduce_grads(params, server, group, bucket_mb)
    if dist.get_rank() == server:
        optimizer.step()
    broadcast_params(params, server, group, bucket_mb)
    if buffers_from is not None:
        broadcast_params(buffers, buffers_from, group, bucket_mb)
