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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer


def zero_optimizer(params, group, optimizer_class, **defaults):
    """ZeRO-1 over group: optimizer_class(params, **defaults) with its state sharded.
    Step it after the gradients are summed over group; every rank of group calls step."""
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class,
                                   process_group=group, **defaults)


def fully_shard_segment(module, group, device_type="cpu", reshard_after_forward=True):
    """FSDP2 over group, in place: one FSDP unit per child that has parameters, then the
    segment itself; gradients SUMMED over group. Returns module (now an FSDPModule); make
    its optimizer afterwards, from module.parameters(). Every rank of the group calls it."""
    mesh = DeviceMesh.from_group(group, device_type)
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for m in module.modules():
        if isinstance(m, FSDPModule):  # the factor is per FSDP unit, not inherited
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return module
