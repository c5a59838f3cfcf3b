# ddp_sum: data parallel with torch's DistributedDataParallel, gradients SUMMED over the
# group instead of averaged: each rank's loss is already scaled by b / B (its share of the
# global batch), so the sum is exactly the one-device gradient of the whole batch.
# (overlap: false needs no DDP: call all_reduce_grads from buckets after backward.)
import time
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


def timed(hook, timing):
    # The hook, adding to timing["overlapped"] the time an all-reduce of this group is in flight:
    # from a bucket's launch to its completion (the future's callback), intervals that overlap
    # counted once. DDP launches buckets while backward still computes, so this time is not a
    # wait of the step: it is the communication the step hid. Buckets complete in launch order.
    last = [0.0]  # when the previous bucket completed

    def run(group, bucket):
        start = time.perf_counter()

        def done(fut):
            end = time.perf_counter()
            timing["overlapped"] += end - max(start, last[0])
            last[0] = end
            return fut.value()

        return hook(group, bucket).then(done)

    return run


def ddp_sum(module, group, bucket_mb=25.0, device_ids=None, resumable=False, timing=None):
    """Wrap module for data parallelism over group (made by dist.new_group). Every
    parameter is used in every step, so find_unused_parameters stays off. `resumable`: the
    run saves checkpoints and may be resumed bit for bit (see sum_each_hook). `timing`: a
    Counter that gets the all-reduce's time in flight (see timed)."""
    ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=group,
                                  bucket_cap_mb=bucket_mb)
    # two ranks add a + b whatever the layout; more, in a run that may resume, take sum_each_hook
    # (it costs more calls: bench/ddp_hook_cost.py)
    each = resumable and dist.get_world_size(group) > 2
    hook = sum_each_hook if each else sum_hook
    ddp.register_comm_hook(group, hook if timing is None else timed(hook, timing))
    return ddp
