# tensor: Megatron-style tensor parallelism with torch's DTensor styles. In a segment, a
# Linear followed (through elementwise layers only) by another Linear is a pair: the first
# is split by output features (ColwiseParallel), the second by input features
# (RowwiseParallel). The pair needs one all-reduce forward (the second's partial sums) and
# one backward (the first's input gradient); DTensor inserts both. Every other layer runs
# whole on every rank. Input and output are the whole tensor on every rank ("replicated",
# see replicate.py). The mesh is made from the segment's own process group, so a tensor
# group may be any subset of the world; this works on CPU with gloo.
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module

# Layers that act on each element separately: they may sit between the two Linears of a pair.
TENSOR_PAIR_BETWEEN = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
                       nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish,
                       nn.Hardsigmoid, nn.Softplus, nn.Identity)


def tensor_pairs(module):
    """[(column name, row name)]: the Linear pairs among module's children, in order."""
    pairs, first = [], None
    for name, layer in module.named_children():
        if isinstance(layer, nn.Linear):
            if first is None:
                first = name
            else:
                pairs.append((first, name))
                first = None
        elif not isinstance(layer, TENSOR_PAIR_BETWEEN):
            first = None  # a layer that needs every feature breaks a pair
    return pairs


def tensor_parallelize(module, group, device_type="cpu"):
    """Split module's Linear pairs over the ranks of group, in place (the layers keep their
    names; their parameters become DTensors). Returns the pairs. Every rank of the group
    calls it; ranks outside the group do not."""
    mesh = DeviceMesh.from_group(group, device_type)
    pairs = tensor_pairs(module)
    plan = {}
    for col, row in pairs:
        # DTensor between the two (not local shards) keeps uneven splits' true shape
        plan[col] = ColwiseParallel(use_local_output=False)
        plan[row] = RowwiseParallel()
    parallelize_module(module, mesh, plan)
    return pairs


def whole_params(named):
    """{name: whole tensor} of {name: parameter}: DTensors (tensor parallel, FSDP) gathered
    with full_tensor(), a collective over each one's mesh (every rank of it calls, in the
    same order); plain tensors as they are."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in named.items()}


def unsharded_state_dict(module):
    """module.state_dict() with every DTensor (tensor parallel or FSDP) gathered whole, under
    the same names. A collective over each DTensor's mesh: every rank of it calls."""
    return whole_params(module.state_dict())
