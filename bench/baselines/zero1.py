"""ZeRO-1: DDP with the Adam state sharded by ZeroRedundancyOptimizer."""
import torch
from common import LR, mlp, start, train_on_rows
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

args, rank, world = start()
model = DistributedDataParallel(mlp())
opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
train_on_rows(args, rank, world, model, opt)
