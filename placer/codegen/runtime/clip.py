# clip: training.clip_grad_norm over the whole model when its parameters live on several
# ranks. Each rank adds the squared gradients of the parameters it counts (every slice it
# holds; a parameter every rank of its group holds alike, on one of them), one all-reduce
# over all ranks gives the global norm, and every rank scales its gradients by the same
# factor as torch.nn.utils.clip_grad_norm_ on one device.
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def norm_share(module, owner):
    """The parameters of `module` whose gradients this rank counts in the global norm: the
    slices it holds (DTensor shards of FSDP and tensor parallel, a ChannelSplit's shards)
    always, the whole ones only on the group's `owner` (their gradients agree on every rank)."""
    sliced = {id(p) for p in module.sliced_parameters()} if hasattr(module, "sliced_parameters") else set()
    return [p for p in module.parameters() if owner or id(p) in sliced
            or (isinstance(p, DTensor) and any(placement.is_shard() for placement in p.placements))]


def local_grad(p):
    return p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad


def clip_global_grad_norm(counted, params, max_norm):
    """Scale the gradients of `params` (this rank's) so that the norm over every rank's
    `counted` ones is at most max_norm; returns that norm (before clipping), on every rank."""
    counted, params = {id(p): p for p in counted}.values(), {id(p): p for p in params}.values()  # each once
    squares = [local_grad(p).detach().float().pow(2).sum().cpu() for p in counted if p.grad is not None]
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    dist.all_reduce(total)  # over every rank: the model's parameters, each counted once
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as clip_grad_norm_ computes it
    for p in params:
        if p.grad is not None:
            local_grad(p).mul_(coef.to(p.grad.device))
    return norm.item()
