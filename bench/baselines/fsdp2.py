"""FSDP2: fully_shard on every Linear, then on the whole model."""
import torch
import torch.nn as nn
from common import BATCH_SIZE, LR, Clock, batch, mlp, start
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

args, rank, world = start()
model = mlp()
mesh = init_device_mesh("cpu", (world,))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.Adam(model.parameters(), lr=LR)
loss_fn = nn.CrossEntropyLoss()
rows = slice(rank * BATCH_SIZE // world, (rank + 1) * BATCH_SIZE // world)
clock = Clock()
for step in range(args.steps):
    x, y = batch(step)
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x[rows]), y[rows])
    loss.backward()
    opt.step()
    clock.tick()
clock.finish(args, rank)
