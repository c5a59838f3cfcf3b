"""Spatial parallelism by hand: each rank convolves its band of rows (H), taking one halo row
from each neighbour before a 3x3 conv; the bands meet on rank 0 for the head and the loss, and
the convolutions' gradients are summed over the ranks."""
import torch
import torch.distributed as dist
import torch.nn as nn
from common import LR, SEED, Clock, batch, start

BATCH_SIZE = 64


def exchange(sends, shape):
    """Send sends[peer] to each peer and receive a tensor of `shape` from each; {peer: tensor}."""
    got = {peer: torch.empty(shape) for peer in sends}
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for peer, t in sends.items()]
    ops += [dist.P2POp(dist.irecv, got[peer], peer) for peer in sends]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return got


def edge_rows(t, rank, world):
    """{neighbour: the edge row of t it needs}: the first row up, the last row down."""
    sends = {}
    if rank > 0:
        sends[rank - 1] = t[:, :, :1]
    if rank < world - 1:
        sends[rank + 1] = t[:, :, -1:]
    return sends


class Halo(torch.autograd.Function):
    """A band with one row of each neighbour's band above and below it (zeros at the edges: the
    conv's padding). Backward returns each halo row's gradient to the rank that owns the row."""

    @staticmethod
    def forward(ctx, x):
        rank, world = dist.get_rank(), dist.get_world_size()
        got = exchange(edge_rows(x, rank, world), x[:, :, :1].shape)
        zero = torch.zeros_like(x[:, :, :1])
        return torch.cat([got.get(rank - 1, zero), x, got.get(rank + 1, zero)], 2)

    @staticmethod
    def backward(ctx, g):
        rank, world = dist.get_rank(), dist.get_world_size()
        got = exchange(edge_rows(g, rank, world), g[:, :, :1].shape)
        gx = g[:, :, 1:-1].clone()
        if rank > 0:
            gx[:, :, :1] += got[rank - 1]
        if rank < world - 1:
            gx[:, :, -1:] += got[rank + 1]
        return gx


args, rank, world = start()
torch.manual_seed(SEED)
conv1, conv2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1)
head = nn.Linear(8192, 10)
conv1.padding = conv2.padding = (0, 1)  # H padding comes with the halo rows
features = [conv1, conv2]
params = [p for c in features for p in c.parameters()] + (list(head.parameters()) if rank == 0 else [])
opt = torch.optim.Adam(params, lr=LR)
loss_fn = nn.CrossEntropyLoss()
band = 32 // world  # input rows per rank
clock = Clock()
for step in range(args.steps):
    x, y = batch(step, (BATCH_SIZE, 3, 32, 32))
    opt.zero_grad(set_to_none=True)
    h = torch.relu(conv1(Halo.apply(x[:, :, rank * band:(rank + 1) * band])))
    h = torch.max_pool2d(h, 2)
    h = torch.relu(conv2(Halo.apply(h)))
    if rank == 0:  # the bands meet here for the head
        bands = [h.detach()] + [torch.empty_like(h) for _ in range(1, world)]
        for peer in range(1, world):
            dist.recv(bands[peer], peer)
        a = torch.cat(bands, 2).requires_grad_()
        loss_fn(head(a.flatten(1)), y).backward()
        for peer in range(1, world):
            dist.send(a.grad.chunk(world, 2)[peer].contiguous(), peer)
        grad = a.grad.chunk(world, 2)[0]
    else:
        dist.send(h.detach(), 0)
        grad = torch.empty_like(h)
        dist.recv(grad, 0)
    h.backward(grad)
    for p in features:
        for q in p.parameters():
            dist.all_reduce(q.grad)
    opt.step()
    clock.tick()
clock.finish(args, rank)
