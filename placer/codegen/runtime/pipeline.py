# pipeline: segments as stages of torch.distributed.pipelining, on a process group of one
# rank per stage group. With data-parallel stages (every stage on d ranks) there are d
# pipelines, pipeline j made of the j-th rank of every stage group; pipeline j takes slice
# j of every microbatch of the global batch, and after the schedule's step each stage's
# gradients are summed over its data group (buckets.all_reduce_grads, one call per stage).
# Loss: the schedule calls the loss once per microbatch and, with scale_grads=True, divides
# the gradients by the number of microbatches. We pass scale_grads=False and a loss that is
# the microbatch mean times mb / B (its share of the global batch B): then the gradients,
# summed over microbatches and pipelines, and the losses, summed the same way, are exactly
# the one-device gradient and loss of the global mean.
# Which rank holds which stage: gpipe and 1f1b one stage per rank in order; interleaved_1f1b,
# looped_bfs and interleaved_zero_bubble stage s on rank s % P (P ranks); zbv_zero_bubble
# and dualpipev two stages per rank in a V: rank r holds stages r and 2P - 1 - r.
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.pipelining import ScheduleDualPipeV
from torch.distributed.pipelining import ScheduleGPipe
from torch.distributed.pipelining import ScheduleInterleaved1F1B
from torch.distributed.pipelining import ScheduleInterleavedZeroBubble
from torch.distributed.pipelining import ScheduleLoopedBFS
from torch.distributed.pipelining import ScheduleZBVZeroBubble

PIPELINE_SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
ONE_STAGE_PER_RANK = ("gpipe", "1f1b")
V_SHAPED = ("zbv_zero_bubble", "dualpipev")


def pipeline_stage_owner(schedule, stage, pp_size):
    """Position, in the pipeline's rank list, of the rank that runs `stage`."""
    if schedule in V_SHAPED:
        return stage if stage < pp_size else 2 * pp_size - 1 - stage
    return stage % pp_size


def pipeline_group(ranks, timeout=None):
    """The pipeline's process group with group rank i = ranks[i] (the stage owners in
    pipeline order), which is what the schedules assume; new_group would sort them. `timeout`:
    how long its collectives wait (None: torch's default, not the default group's)."""
    return dist.new_group(ranks, sort_ranks=False, timeout=timeout)


def pipeline_stages(stage_modules, num_stages, group, device="cpu", shapes=None):
    """{stage index: module} of this rank -> its PipelineStages, by stage index. `shapes`:
    {stage index: ((input shape, dtype), (output shape, dtype))} of one micro-batch; stages
    given them skip torch's shape inference, which sends extra messages at the first step."""
    stages = []
    for index, module in sorted(stage_modules.items()):
        io = {}
        if shapes and index in shapes:
            (ins, idt), (outs, odt) = shapes[index]
            x = torch.empty(ins, dtype=getattr(torch, idt), device="meta")
            y = torch.empty(outs, dtype=getattr(torch, odt), device="meta")
            # a later stage's float input takes a gradient, which goes back to the stage before
            x.requires_grad_(index > 0 and x.is_floating_point())
            io = {"input_args": x, "output_args": y.requires_grad_(y.is_floating_point())}
        stages.append(PipelineStage(module, index, num_stages, torch.device(device), group=group, **io))
    return stages


def pipeline_loss(loss_fn, batch_size):
    """The loss the schedule calls per microbatch: mean over the microbatch times its share
    of the global batch (see the top of this piece; use with scale_grads=False)."""
    def microbatch_loss(output, target):
        return loss_fn(output, target) * (output.shape[0] / batch_size)
    return microbatch_loss


def make_pipeline_schedule(schedule, stages, n_microbatches, loss_fn, batch_size):
    """The torch schedule named `schedule` (a PIPELINE_SCHEDULES key) over this rank's
    stages, with the global-mean loss scaling."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; schedules are "
                         f"{', '.join(PIPELINE_SCHEDULES)}")
    one = schedule in ONE_STAGE_PER_RANK
    if one and len(stages) != 1:
        raise ValueError(f"{schedule} runs one stage per rank, this rank holds {len(stages)}")
    return PIPELINE_SCHEDULES[schedule](stages[0] if one else stages, n_microbatches,
                                        loss_fn=pipeline_loss(loss_fn, batch_size),
                                        scale_grads=False)


def pipeline_local_batch(x, n_microbatches, d, j):
    """Pipeline j's rows of the global batch x when the stages are data parallel over d:
    slice j (of d) of every microbatch, so microbatch m is the same rows as on one device."""
    mb = x.shape[0] // n_microbatches
    rows = x.reshape(n_microbatches, mb, *x.shape[1:]).narrow(1, j * (mb // d), mb // d)
    return rows.reshape(-1, *x.shape[1:])


def pipeline_step(schedule, x=None, target=None):
    """One forward/backward over all microbatches: x on the rank holding the first stage,
    target on the one holding the last (None elsewhere). Gradients accumulate into .grad
    (zero them before). Returns the sum of this rank's microbatch losses, a 0-dim tensor
    (zero unless this rank holds the last stage)."""
    losses = []
    schedule.step(*(() if x is None else (x,)), target=target, losses=losses,
                  return_outputs=False)
    return torch.stack([l.detach() for l in losses]).sum() if losses else torch.zeros(())

