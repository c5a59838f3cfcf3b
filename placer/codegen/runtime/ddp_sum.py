# ddp_sum: data parallel with torch's DistributedDataParallel, gradients SUMMED over the
# group instead of averaged: each rank's loss is already scaled by b / B (its share of the
# global batch), so the sum is exactly the one-device gradient of the whole batch.
# (overlap: false needs no DDP: call all_reduce_grads from buckets after backward.)
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def sum_hook(group, bucket):
    # DDP's default hook divides by the group size; this one only all-reduces (SUM).
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def sum_each_hook(group, bucket):
    # The same sum, one all-reduce per gradient (the same bytes). With more than two ranks the
    # order in which a collective adds the ranks' values depends on where an element sits in
    # the buffer it reduces, and DDP lays its buckets out anew after a process's first step
    # (all parameters in one bucket first, then in the order their gradients arrived): a run
    # resumed from a checkpoint would add that step's gradients in another order than the run
    # it continues. Reduced on its own, each gradient sums the same way in every step.
    works = [dist.all_reduce(grad, group=group, async_op=True) for grad in bucket.gradients()]
    done = torch.futures.collect_all([work.get_future() for work in works])
    return done.then(lambda fut: bucket.buffer())


def ddp_sum(module, group, bucket_mb=25.0, device_ids=None, resumable=False):
    """Wrap module for data parallelism over group (made by dist.new_group). Every
    parameter is used in every step, so find_unused_parameters stays off. `resumable`: the
    run saves checkpoints and may be resumed bit for bit (see sum_each_hook)."""
    ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=group,
                                  bucket_cap_mb=bucket_mb)
    # two ranks add a + b whatever the layout; more, in a run that may resume, take sum_each_hook
    # (it costs more calls: bench/ddp_hook_cost.py)
    each = resumable and dist.get_world_size(group) > 2
    ddp.register_comm_hook(group, sum_each_hook if each else sum_hook)
    return ddp
