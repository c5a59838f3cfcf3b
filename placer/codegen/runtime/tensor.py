# tensor: Megatron-style tensor parallelism with torch's DTensor styles. The plan names the
# Linear pairs of a segment (a Linear, then elementwise or Dropout layers only, then another
# Linear): the first is split by output features (ColwiseParallel), the second by input
# features (RowwiseParallel), and the layers between run on each rank's slice of the
# features. The pair needs one all-reduce forward (the second's partial sums) and one
# backward (the first's input gradient); DTensor inserts both. Every other layer runs whole
# on every rank. Input and output are the whole tensor on every rank ("replicated", see
# replicate.py). The mesh is made from the segment's own process group, so a tensor group
# may be any subset of the world; this works on CPU with gloo.
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module


class OnSlices(nn.Module):
    """An elementwise layer between a pair's halves, run on this rank's slice of the features
    (DTensor has no sharding rule for the backward of some, e.g. Hardshrink, LogSigmoid)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        y = self.layer(x.to_local())
        return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                  stride=x.stride())


def tensor_parallelize(module, group, pairs, device_type="cpu"):
    """Split module's Linear pairs [(column child, row child)] over the ranks of group, in place
    (the layers keep their names; their parameters become DTensors). `group` may be a DeviceMesh
    (a 2-D one's tp dim). Every rank of the group calls it; ranks outside the group do not."""
    mesh = group if isinstance(group, DeviceMesh) else DeviceMesh.from_group(group, device_type)
    plan = {}
    names = [name for name, _ in module.named_children()]
    for col, row in pairs:
        # DTensor between the two (not local shards) keeps uneven splits' true shape
        plan[col] = ColwiseParallel(use_local_output=False)
        plan[row] = RowwiseParallel()
        for name in names[names.index(col) + 1:names.index(row)]:
            setattr(module, name, OnSlices(getattr(module, name)))
    parallelize_module(module, mesh, plan)


HEAD_ATTRS = ("n_heads", "n_head", "num_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads")


def tensor_parallelize_blocks(model, group, groups, device_type="cpu"):
    """Split a model's transformer blocks over the ranks of group, in place: each group
    (("attn.q", "attn.k", "attn.v"), "attn.proj") is its column halves (split by output features, so
    each rank runs 1/d of the heads on the whole input) and its row half (split by input
    features; its partial sums all-reduced). The module holding a group runs 1/d of the heads:
    its head counts are divided (the model reads them to reshape). Every rank of the group calls it."""
    mesh = group if isinstance(group, DeviceMesh) else DeviceMesh.from_group(group, device_type)
    plan = {}
    for cols, row in groups:
        plan.update({col: ColwiseParallel() for col in cols})
        plan[row] = RowwiseParallel()
        holder = model.get_submodule(row.rpartition(".")[0])
        for attr in HEAD_ATTRS:
            if isinstance(getattr(holder, attr, None), int):
                setattr(holder, attr, getattr(holder, attr) // mesh.size())
    parallelize_module(model, mesh, plan)


def whole_params(named):
    """{name: whole tensor} of {name: parameter}: DTensors (tensor parallel, FSDP) gathered
    with full_tensor(), a collective over each one's mesh (every rank of it calls, in the
    same order); plain tensors as they are."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in named.items()}


def unsharded_state_dict(module):
    """module.state_dict() with every DTensor (tensor parallel or FSDP) gathered whole, under
    the same names. A collective over each DTensor's mesh: every rank of it calls."""
    return whole_params(module.state_dict())


def replica_slice(x, replicas, rank):
    """The rows of x that the data replica holding `rank` computes (replicas: lists of ranks,
    rows cut evenly across them in order): a 2-D segment's."""
    i = next(i for i, run in enumerate(replicas) if rank in run)
    size = x.shape[0] // len(replicas)
    return x.narrow(0, i * size, size)


def _slices(tensors, op, write_back=True):
    """op(flat) on the tensors (a DTensor's local slice) in one flat message, copied back unless not `write_back`."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in local])
    op(flat)
    if write_back:
        for t, v in zip(local, flat.split([t.numel() for t in local])):
            t.copy_(v.view_as(t))


@torch.no_grad()
def all_reduce_slices(module, group):
    """SUM each parameter's gradient over group, the ranks that hold the same slices in every
    data replica of a 2-D segment, in one flat message."""
    _slices([p.grad for p in module.parameters()], lambda f: dist.all_reduce(f, group=group))


@torch.no_grad()
def reduce_slices(module, group, root):
    """`sync: broadcast` after backward: rank root (global, the first replica's in group) ends
    with the SUM of group's gradients of the slices, which it alone then steps."""
    _slices([p.grad for p in module.parameters()], lambda f: dist.reduce(f, root, group=group),
            write_back=dist.get_rank() == root)


@torch.no_grad()
def broadcast_slices(module, group, root):
    """`sync: broadcast` before the forward: every rank of group ends with root's slices."""
    _slices(list(module.parameters()), lambda f: dist.broadcast(f, root, group=group))


def norm_share_2d(module, tp_first):
    """FSDP2 x TP: the parameters whose gradients this rank counts in the global norm. A piece
    sharded on both mesh dims (FSDP2's _StridedShard over a column split included) is this rank's
    alone; a piece replicated over tp (a row half's
    bias, a layer tensor parallel leaves whole: sharded over dp only) is counted on the ranks
    at tp position 0 (`tp_first`)."""
    return [p for p in module.parameters() if tp_first or (
        p.device_mesh.ndim == 2 and not any(placement.is_replicate() for placement in p.placements))]
