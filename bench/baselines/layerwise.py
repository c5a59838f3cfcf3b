"""Layer-wise model parallelism on two ranks: rank 0 runs the first two Linears and sends the
activation to rank 1, which runs the rest and the loss and sends the activation's gradient back."""
import torch
import torch.distributed as dist
import torch.nn as nn
from common import BATCH_SIZE, LR, Clock, batch, mlp, start

args, rank, world = start()
model = mlp()
cut = 4  # Linear, ReLU, Linear, ReLU | Linear, ReLU, Linear
part = model[:cut] if rank == 0 else model[cut:]
opt = torch.optim.Adam(part.parameters(), lr=LR)
loss_fn = nn.CrossEntropyLoss()
hidden = torch.empty(BATCH_SIZE, model[cut].in_features)
clock = Clock()
for step in range(args.steps):
    x, y = batch(step)
    opt.zero_grad(set_to_none=True)
    if rank == 0:
        h = part(x)
        dist.send(h.detach(), 1)
        grad = torch.empty_like(h)
        dist.recv(grad, 1)
        h.backward(grad)
    else:
        dist.recv(hidden, 0)
        a = hidden.clone().requires_grad_()
        loss = loss_fn(part(a), y)
        loss.backward()
        dist.send(a.grad, 0)
    opt.step()
    clock.tick()
clock.finish(args, rank)
