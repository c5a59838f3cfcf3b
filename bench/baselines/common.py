"""What every hand-written baseline shares: the bench's MLP, the data, start-up and timing.

The baselines are plain torch, written the way a PyTorch user would, to compare placer's
generated programs with (bench/vs_torch.py). Each runs under torchrun:

    torchrun --nproc-per-node 2 bench/baselines/data_ddp.py --steps 30 --out times.json

and rank 0 writes the time at the end of every step (seconds since the loop began) to --out.
With BENCH_DEVICE=cuda each rank runs on GPU LOCAL_RANK and the ranks join over NCCL (the data
made on the host, as the generated program makes it, and moved to the GPU each step); the
default, cpu, is gloo with each worker's share of the cores.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

# the model of bench/specs/*.yaml (mlp): 256 -> 512 -> 512 -> 512 -> 10
WIDTHS = [256, 512, 512, 512, 10]
BATCH_SIZE = 256
SEED = 0
LR = 0.001
CUDA = os.environ.get("BENCH_DEVICE", "cpu") == "cuda"


def device() -> torch.device:
    """This rank's device: GPU LOCAL_RANK with BENCH_DEVICE=cuda, else the host."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if CUDA else torch.device("cpu")


def mlp() -> nn.Sequential:
    """Linear, ReLU, ..., Linear, initialised from the seed as the generated program does."""
    torch.manual_seed(SEED)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(WIDTHS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(device())


def batch(step: int, shape=(BATCH_SIZE, WIDTHS[0]), classes: int = 10):
    """Step `step`'s whole batch, the same on every rank."""
    gen = torch.Generator().manual_seed(SEED * 2**32 + step)
    return torch.randn(shape, generator=gen), torch.randint(0, classes, (shape[0],), generator=gen)


def start() -> tuple[argparse.Namespace, int, int]:
    """Parse --steps/--out, give this worker its share of the cores (or its GPU), join the group."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", help="rank 0 writes the end time of every step here (JSON)")
    args = parser.parse_args()
    if CUDA:
        torch.cuda.set_device(device())
        dist.init_process_group("nccl", device_id=device())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
        dist.init_process_group("gloo")
    return args, dist.get_rank(), dist.get_world_size()


class Clock:
    """Seconds since the loop began at the end of each step; rank 0 writes them at the end."""

    def __init__(self):
        self.start, self.ends = time.perf_counter(), []

    def tick(self):
        self.ends.append(time.perf_counter() - self.start)

    def finish(self, args, rank):
        if CUDA:  # a step's end above is when the host queued it; wall_s waits for the GPU
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.start
        if rank == 0 and args.out:
            with open(args.out, "w") as f:
                json.dump({"step_ends_s": self.ends, "wall_s": wall}, f)
        dist.barrier()
        dist.destroy_process_group()
        # leave without Python's shutdown, as placer's programs do: gloo's threads may still be
        # freeing the last collective's tensors, and that during shutdown now and then aborts the
        # process ("terminate called without an active exception"; ZeRO-1's most often)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def train_on_rows(args, rank: int, world: int, model: nn.Module, opt) -> None:
    """The data-parallel loop (DDP, ZeRO-1, FSDP2): each rank trains on its rows of every batch,
    the wrapper and optimizer combine what the ranks computed; then the times are written."""
    loss_fn = nn.CrossEntropyLoss()
    rows = slice(rank * BATCH_SIZE // world, (rank + 1) * BATCH_SIZE // world)
    clock = Clock()
    for step in range(args.steps):
        x, y = batch(step)
        x, y = x[rows].to(device()), y[rows].to(device())
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        clock.tick()
    clock.finish(args, rank)
