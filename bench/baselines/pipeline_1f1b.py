"""1F1B with torch.distributed.pipelining: two stages (the layer-wise cut), four micro-batches."""
import torch
import torch.nn as nn
from common import LR, Clock, batch, mlp, start
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

MICROBATCHES = 4
args, rank, world = start()
model = mlp()
cut = 4
part = model[:cut] if rank == 0 else model[cut:]
stage = PipelineStage(part, rank, world, torch.device("cpu"))
schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=nn.CrossEntropyLoss())
opt = torch.optim.Adam(part.parameters(), lr=LR)
clock = Clock()
for step in range(args.steps):
    x, y = batch(step)
    opt.zero_grad(set_to_none=True)
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)
    opt.step()
    clock.tick()
clock.finish(args, rank)
