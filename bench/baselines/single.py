"""One device, no parallelism: the whole model and the whole batch in one process, a plain
torch training loop (the generated program of a one-device spec against it)."""
import torch
from common import LR, mlp, start, train_on_rows

args, rank, world = start()
model = mlp()
opt = torch.optim.Adam(model.parameters(), lr=LR)
train_on_rows(args, rank, world, model, opt)
