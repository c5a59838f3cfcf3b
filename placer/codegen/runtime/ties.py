# ties: a parameter that layers of several segments use (tied input and output embeddings)
# has a copy in each segment's stage module (torch's pipeline tracer copies it into every
# stage that uses it). The copies start equal (every rank builds the model from the seed);
# summing their gradients before every step keeps them equal, and equal to the one
# parameter of a one-device run, as Megatron does for its word embeddings.
import torch
import torch.distributed as dist
import torch.nn as nn


def tied_copies(held):
    """{name: this rank's copy} of one tied parameter; `held` maps the parameter's name under
    each stage that uses it to that stage module (None where this rank lacks the stage)."""
    return {name: stage.get_parameter(name) for name, stage in held.items() if stage is not None}


def sum_tied_grads(copies, group=None):
    """Give every copy of one tied parameter the sum of all copies' gradients: this rank's
    added here, then over `group` (the ranks holding a copy; None: all on this rank)."""
    copies = list({id(p): p for p in copies}.values())  # in lockstep, segments on one rank share one
    if not copies:
        return
    grad = sum(p.grad if p.grad is not None else torch.zeros_like(p) for p in copies)
    if group is not None:  # FSDP2: a DTensor, whose local shard is summed with the same shard elsewhere
        dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=group)
    for p in copies:
        p.grad = grad.clone() if len(copies) > 1 else grad


def untied(params, *ties):
    """The parameters no tie holds: with data-parallel segments in lockstep, a tie's all-reduce
    sums every copy of every replica, so the segments' own all-reduce leaves them out."""
    held = {id(p) for copies in ties for p in copies.values()}
    return [p for p in params if id(p) not in held]


def untie(model, copies):
    """In lockstep (every rank builds the whole model), give each segment after the first that
    uses a tied parameter its own copy, under every name the parameter has in that segment (each
    of `copies` lists them), as stages cut apart hold one: each segment's optimizer steps its own
    copy once (two segments on one rank would step one shared tensor twice), and the copies stay
    equal by summing their gradients."""
    for names in copies:
        copy = nn.Parameter(model.get_parameter(names[0]).detach().clone())
        for name in names:
            path, _, last = name.rpartition(".")
            setattr(model.get_submodule(path), last, copy)
