"""ZeRO-1: DDP with the Adam state sharded by ZeroRedundancyOptimizer."""
import torch
import torch.nn as nn
from common import BATCH_SIZE, LR, Clock, batch, mlp, start
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

args, rank, world = start()
model = DistributedDataParallel(mlp())
opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
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
