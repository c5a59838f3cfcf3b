"""Data parallelism with DistributedDataParallel: each rank trains on its half of the batch."""
import torch
from common import LR, mlp, start, train_on_rows
from torch.nn.parallel import DistributedDataParallel

args, rank, world = start()
model = DistributedDataParallel(mlp())
opt = torch.optim.Adam(model.parameters(), lr=LR)
train_on_rows(args, rank, world, model, opt)
