"""Tensor parallelism with DTensor: up/down Linear pairs split Colwise/Rowwise over two ranks,
then the head on rank 0, which sends the gradient of the blocks' output to rank 1."""
import torch
import torch.distributed as dist
import torch.nn as nn
from common import LR, SEED, Clock, batch, start
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

args, rank, world = start()
torch.manual_seed(SEED)
blocks = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256),
                       nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
head = nn.Linear(256, 10)
mesh = init_device_mesh("cpu", (world,))
parallelize_module(blocks, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                  "3": ColwiseParallel(), "5": RowwiseParallel()})
params = list(blocks.parameters()) + (list(head.parameters()) if rank == 0 else [])
opt = torch.optim.Adam(params, lr=LR)
loss_fn = nn.CrossEntropyLoss()
clock = Clock()
for step in range(args.steps):
    x, y = batch(step)
    opt.zero_grad(set_to_none=True)
    h = blocks(x)  # whole on every rank
    grad = torch.empty_like(h)
    if rank == 0:
        a = h.detach().requires_grad_()
        loss_fn(head(a), y).backward()
        grad = a.grad
    dist.broadcast(grad, 0)
    h.backward(grad)
    opt.step()
    clock.tick()
clock.finish(args, rank)
