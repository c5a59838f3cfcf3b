# ddp_sum: data parallel with torch's DistributedDataParallel, gradients SUMMED over the
# group instead of averaged: each rank's loss is already scaled by b / B (its share of the
# global batch), so the sum is exactly the one-device gradient of the whole batch.
# (overlap: false needs no DDP: call all_reduce_grads from buckets after backward.)
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def sum_hook(group, bucket):
    # DDP's default hook divides by the group size; this one only all-reduces (SUM).
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def ddp_sum(module, group, bucket_mb=25.0, device_ids=None):
    """Wrap module for data parallelism over group (made by dist.new_group). Every
    parameter is used in every step, so find_unused_parameters stays off."""
    ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=group,
                                  bucket_cap_mb=bucket_mb)
    ddp.register_comm_hook(group, sum_hook)
    return ddp
