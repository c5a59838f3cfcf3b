"""What summing each gradient on its own costs DDP (ddp_sum's sum_each_hook, used on groups of
more than two ranks so that a resumed run adds in the same order) against one all-reduce per
bucket (sum_hook): seconds per step of a DDP MLP on CPU workers over gloo, and whether the
first step's bucket layout changes the result.

    python bench/ddp_hook_cost.py                 # 4 ranks, 12 layers of 256, 30 steps
    python bench/ddp_hook_cost.py --ranks 3 --layers 24 --width 512

Prints, per hook, the median seconds per step after 5 warm-up steps and the parameters'
checksum after a fresh process's steps 1..N versus a resumed one's (a hook whose sums depend on
the bucket layout differs there).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from placer.codegen.runtime.ddp_sum import sum_each_hook, sum_hook  # noqa: E402


def model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])


def steps(ddp, opt, rank, world, width, first, last, times=None):
    for step in range(first, last):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(16 * world, width, generator=gen)[rank * 16:(rank + 1) * 16]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        (ddp(x).square().mean() / world).backward()
        opt.step()
        if times is not None:
            times.append(time.perf_counter() - t0)


def worker(rank, world, args, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for name, hook in (("bucket", sum_hook), ("each", sum_each_hook)):
        def make():
            m = model(args.layers, args.width)
            ddp = DistributedDataParallel(m, bucket_cap_mb=args.bucket_mb)
            ddp.register_comm_hook(None, hook)
            return m, ddp, torch.optim.SGD(m.parameters(), lr=0.01)
        m, ddp, opt = make()
        times = []
        steps(ddp, opt, rank, world, args.width, 0, 5)
        steps(ddp, opt, rank, world, args.width, 5, 5 + args.steps, times)
        whole = [p.detach().clone() for p in m.parameters()]
        # a "resumed" process: a fresh DDP from the parameters after step 5 (SGD has no state)
        m2, ddp2, opt2 = make()
        steps(ddp2, opt2, rank, world, args.width, 0, 5)
        state = {k: v.clone() for k, v in m2.state_dict().items()}
        m3, ddp3, opt3 = make()
        m3.load_state_dict(state)
        steps(ddp3, opt3, rank, world, args.width, 5, 5 + args.steps)
        same = all(torch.equal(a, b) for a, b in zip(whole, m3.parameters()))
        if rank == 0:
            out[name] = (statistics.median(times), same)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bucket-mb", type=float, default=0.5)
    args = parser.parse_args()
    out = mp.Manager().dict()
    mp.spawn(worker, args=(args.ranks, args, 29500 + os.getpid() % 1000, out), nprocs=args.ranks)
    params = args.layers * (args.width * args.width + args.width)
    print(f"{args.ranks} ranks, {args.layers} Linear({args.width}, {args.width}) ({params / 1e6:.1f}M parameters, "
          f"{2 * args.layers} tensors), bucket_cap_mb {args.bucket_mb}")
    for name, (seconds, same) in out.items():
        print(f"  {name:<7} {seconds * 1e3:8.2f} ms/step   resumed run equal to the uninterrupted one: {same}")


if __name__ == "__main__":
    main()
