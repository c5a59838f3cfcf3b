# sharding: data segments with `shard: optimizer` (ZeRO-1) and `shard: full` (FSDP2).
# Our data convention: each rank's loss is scaled by b / B (its share of the global batch)
# and gradients are SUMMED over the group.
# - optimizer: torch's ZeroRedundancyOptimizer on the data group; gradients are summed first
#   (ddp_sum, or buckets.all_reduce_grads with overlap: false), then each rank steps its
#   shard of the parameters and ZeRO broadcasts them, so every rank ends the step with all
#   parameters current. Its state lives sharded: consolidate_state_dict(to=rank) gathers it.
# - full: torch's fully_shard on a DeviceMesh made from the data group. FSDP divides the
#   reduced gradient by the group size; every FSDP module gets divide factor 1 instead, and
#   SUM reductions (gloo has no PREMUL_SUM, which the factor would otherwise use). Works on
#   CPU with gloo, no offload policy needed. Parameters are DTensor shards: save with
#   tensor.unsharded_state_dict (a collective over the group).
from collections import Counter

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer


def zero_optimizer(params, group, optimizer_class, **defaults):
    """ZeRO-1 over group: optimizer_class(params, **defaults) with its state sharded.
    Step it after the gradients are summed over group; every rank of group calls step.
    The parameters live in one flat bucket per rank (parameters_as_bucket_view), so that each
    rank broadcasts its updated shard as one message, not one per tensor: the bench's ZeRO-1
    step took 0.7x the time on CPU workers. A bucket holds one dtype."""
    params = list(params)
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=group,
                                   parameters_as_bucket_view=len({p.dtype for p in params}) == 1,
                                   **defaults)


def fsdp_units(module):
    """The submodules FSDP2 shards one by one before the whole segment, as torch's recipes do:
    each ModuleList/ModuleDict element (a transformer block), and every other child with
    parameters; a child holding such a container is opened instead (a wrapper's blocks get one
    unit each). fully_shard refuses a bare ModuleList: it has no forward. A child sharing a
    parameter with a module outside it (GPT-2's wte and lm_head) is left to the segment's own
    unit, which shards the tied parameter once: one FSDP group may manage it. (path, module) pairs."""
    def uses(m):
        return Counter(id(p) for _, p in m.named_parameters(remove_duplicate=False))
    total = uses(module)
    return [(path, unit) for path, unit in _candidates(module, "")
            if all(total[i] == n for i, n in uses(unit).items())]


def _candidates(module, prefix):
    units = []
    for name, child in module.named_children():
        path = prefix + name
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += [(f"{path}.{n}", m) for n, m in child.named_children() if _has_params(m)]
        elif any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in child.modules()):
            units += _candidates(child, path + ".")
        elif _has_params(child):
            units.append((path, child))
    return units


def _has_params(module):
    return any(True for _ in module.parameters())


def fully_shard_segment(module, group, device_type="cpu", reshard_after_forward=True, ignored=None):
    """FSDP2 over group, in place: one FSDP unit per block and per other child that has
    parameters (fsdp_units), then the segment itself; gradients SUMMED over group. Returns
    module (now an FSDPModule); make its optimizer afterwards, from module.parameters().
    `group` may be a DeviceMesh: a 2-D one's dp dim, over tensor-parallel DTensors (FSDP2 x TP).
    Every rank of the group calls it. `ignored`: parameters FSDP2 leaves alone (each rank's own
    experts under expert parallelism)."""
    mesh = group if isinstance(group, DeviceMesh) else DeviceMesh.from_group(group, device_type)
    ignored = set(ignored) if ignored else None
    for _, unit in fsdp_units(module):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    for m in module.modules():
        if isinstance(m, FSDPModule):  # the factor is per FSDP unit, not inherited
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return module


def no_prefetch_across_micro_batches(module):
    """FSDP2 in placer's micro-batch loops: each micro-batch's backward is its own, and FSDP2
    reshards every unit after it. The first unit's implicit backward prefetch would gather the
    previous micro-batch's last unit, to be resharded unused; an explicit prefetch of itself
    (already gathered then: a no-op) turns that off. One forward a backward never prefetches
    from the first unit, so this changes nothing there."""
    units = [unit for _, unit in fsdp_units(module)] or [module]
    units[0].set_modules_to_backward_prefetch([units[0]])


def fully_shard_layers(stage, names, group, device_type="cpu"):
    """FSDP2 over group on each of a lockstep segment's placed layers that has parameters: the
    modules the model's own forward calls (the stage container, which nothing calls, gets no
    unit). Each unit is then its own root; reshard_after_forward=True keeps it resharding after
    its forward as the plan counts (a root would keep its parameters gathered). Gradients SUMMED
    over group (or a DeviceMesh: a 2-D one's dp dim, FSDP2 x TP). Returns stage; make its optimizer
    afterwards, from stage.parameters()."""
    mesh = group if isinstance(group, DeviceMesh) else DeviceMesh.from_group(group, device_type)
    for name in names:
        layer = stage.get_submodule(name)
        if _has_params(layer):
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
            layer.set_gradient_divide_factor(1.0)
            layer.set_force_sum_reduction_for_comms(True)
    return stage
