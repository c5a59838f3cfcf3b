"""FSDP2: fully_shard on every Linear, then on the whole model."""
import torch
import torch.nn as nn
from common import LR, device, mlp, start, train_on_rows
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

args, rank, world = start()
model = mlp()
mesh = init_device_mesh(device().type, (world,))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.Adam(model.parameters(), lr=LR)
train_on_rows(args, rank, world, model, opt)
