"""Measuring this machine's CPU for the cost model's `cpu` profile (`estimate/hardware.py`).

Everything a CPU worker of a run spends time on, timed as such a worker runs it: Linear and
Conv2d layers' forward and backward by size, memory bandwidth, fixed costs per layer and
optimizer tensor, Adam's update, and between two gloo processes (`probe`, run as `python -m
placer.estimate.calibrate PORT RANK`) message latency and bandwidth, messages, all-reduces,
all-gathers, reduce-scatters and broadcasts by size, how much of an all-reduce a backward hides,
and the fixed costs DDP's gradient buckets, FSDP2, DTensor, torch's pipeline schedules and the
program's spatial halo exchange add. The collectives are timed as a step meets them: each right
after compute, taking turns (`_busy`). Both processes keep the memory they free, as the
program's workers do.
"""
from __future__ import annotations

import functools
import json
import os
import random
import socket
import subprocess
import sys
import time
import warnings

from placer.estimate.hardware import Hardware


def low_quantile(fn, n: int, at: int, before=lambda: None) -> float:
    """Seconds of one call of `fn`: the (1/at)-th quantile of n timed calls after one to warm up
    (other work on a shared machine only adds); `before` runs ahead of each, untimed."""
    fn()
    times = []
    for _ in range(n):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // at]


def _best(fn) -> float:
    """A local figure: the third of five calls."""
    return low_quantile(fn, 5, 3)


LINEAR_SIZES = ((64, 256, 256), (128, 512, 512), (256, 1024, 1024))
"""(rows, in, out) of the Linear layers whose forward and backward calibrate `rates`."""

CONV_SIZES = ((8, 8, 8, 16), (16, 3, 16, 32), (16, 16, 32, 16), (32, 32, 64, 16))
"""(batch, in channels, out channels, height = width) of the 3x3, padding 1 Conv2d layers whose
forward and backward calibrate `conv_rates`: a first layer on an RGB image to wider ones, as
image models (and the bench's spatial spec) have them; in increasing FLOPs."""


def _rates(layer, x, flops: int, layer_overhead: float) -> tuple[float, float, float]:
    """(forward FLOPs, forward FLOP/s, backward FLOP/s) of `layer` on `x` (which requires grad):
    the backward is timed as forward + backward less the forward, and counted as twice the
    forward's FLOPs, as the cost model counts it."""
    import torch

    fwd = _best(lambda: layer(x))
    grad = torch.ones_like(layer(x))
    both = _best(lambda: layer(x).backward(grad))
    return (flops, flops / max(fwd - layer_overhead, 1e-9), 2 * flops / max(both - fwd - layer_overhead, 1e-9))


def calibrate(threads: int) -> Hardware:
    """Measure this machine's CPU with `threads` threads, as one CPU worker of a run: Linear
    layers' forward and backward by size, a big add's bandwidth, a tiny layer's fixed cost, Adam's
    step, Conv2d layers by size, and two gloo processes' message latency and bandwidth (`probe`)."""
    import torch

    from placer.codegen.runtime.host_memory import keep_freed_memory

    keep_freed_memory()  # as the program's workers do (and the probe's processes)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tiny = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(32)])
        inp = torch.randn(2, 4, requires_grad=True)
        layer_overhead = _best(lambda: tiny(inp).sum().backward()) / (2 * len(tiny))
        rates = []
        for rows, i, o in LINEAR_SIZES:
            rates.append(_rates(torch.nn.Linear(i, o), torch.randn(rows, i, requires_grad=True), 2 * rows * i * o,
                                layer_overhead))
        conv_rates = []
        for b, c, o, hw in CONV_SIZES:  # 2 FLOPs per multiply-add: each output element's c * 3 * 3 of them
            conv_rates.append(_rates(torch.nn.Conv2d(c, o, 3, padding=1), torch.randn(b, c, hw, hw, requires_grad=True),
                                     2 * b * o * hw * hw * c * 9, layer_overhead))
        with torch.no_grad():
            x, y = torch.randn(8 << 20), torch.randn(8 << 20)
            mem_bw = 3 * x.numel() * 4 / _best(lambda: x.add_(y))
        big = torch.nn.Parameter(torch.randn(1 << 20))
        big.grad = torch.randn_like(big)
        adam = torch.optim.Adam([big])
        update_s = _best(adam.step) / (3 * big.numel())
        opt = torch.optim.Adam(tiny.parameters())
        tensor_overhead = _best(opt.step) / len(list(tiny.parameters()))
        one = torch.nn.Linear(4, 4)
        sgd = torch.optim.SGD(one.parameters(), lr=0.1)

        def step():
            sgd.zero_grad()
            torch.nn.functional.cross_entropy(one(torch.randn(2, 4)), torch.tensor([0, 1])).backward()
            sgd.step()

        step_overhead = max(0.0, _best(step) - 2 * layer_overhead - 2 * tensor_overhead)
    finally:
        torch.set_num_threads(before)
    link = _probe_gloo()
    return Hardware(name="cpu", flops=rates[-1][1], rates=tuple(rates), conv_rates=tuple(conv_rates),
                    bf16_flops=rates[-1][1], mem_bw=mem_bw,
                    link_bw=link["bandwidth"], host_bw=mem_bw, latency=link["latency"],
                    collective_s=link["collective"], sharded_s=link["sharded"], split_s=link["split"],
                    split_grad_s=link["split_grad"], bucket_s=link["bucket"],
                    action_s=link["action"],
                    reduce_times=_table(link["reduce_times"]), gather_times=_table(link["gather_times"]),
                    scatter_times=_table(link["scatter_times"]),
                    broadcast_times=_table(link["broadcast_times"]), send_times=_table(link["send_times"]),
                    sharded_times=_table(link["sharded_times"]),
                    split_times=_table(link["split_times"]), split_grad_times=_table(link["split_grad_times"]),
                    overlap=link["overlap"], halo_s=link["halo"],
                    layer_overhead=layer_overhead, update_s=update_s, tensor_overhead=tensor_overhead,
                    step_overhead=step_overhead,
                    source=f"measured on this machine, {threads} thread(s) per worker, gloo between 2 processes")


def _table(rows) -> tuple:
    """A JSON list of rows as the profile keeps it: a tuple of tuples."""
    return tuple(tuple(r) for r in rows)


def _probe_gloo() -> dict:
    """Latency and bandwidth of gloo between two local processes (what CPU workers use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "placer.estimate.calibrate", str(port)]
    procs = [subprocess.Popen([*cmd, str(r)], env=env, stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"the gloo probe failed: {outs}")
    return json.loads(outs[0])


def _busy(fns, n: int) -> list[float]:
    """Seconds of one call of each of `fns` (collectives) as a training step meets it: each call
    right after about a millisecond of compute on both processes, the mean of the middle 80% of
    n. Back to back, a 256 KiB all-reduce between two gloo processes took 0.4 ms on the 2-core
    bench machine; after compute, anywhere from 0.2 to 5 ms: its threads and the peer's are
    woken from sleep, the peer may still be computing, and for a few dozen calls at a time
    every such all-reduce took about 3.5 ms instead of 0.4. So the calls take turns, n rounds
    of one each in a shuffled order, and each meets those spells alike; a mean, since a step's time adds up its
    calls (a median of so wide a spread moved twofold between runs). The slowest tenth are
    left out: other work on a shared machine only adds."""
    import statistics

    import torch

    a, w = torch.randn(64, 512), torch.randn(512, 512)
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    order = random.Random(0)  # the same on both processes: they must call the collectives alike
    turns = list(range(len(fns)))
    for _ in range(n):
        order.shuffle(turns)  # what follows what varies too (an exchange can slow the next call)
        for i in turns:
            for _ in range(3):  # about 1 ms on one thread of a 2-core machine
                a @ w
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return [statistics.mean(sorted(t)[n // 10:n - n // 10]) for t in times]


def _low(fn, n: int) -> float:
    """The tenth of n calls: the two processes share the cores with whatever else runs on the
    machine, which only adds, and stalls every message whose peer is not running then: a quiet
    machine's figure."""
    return low_quantile(fn, n, 10)


def probe(port: int, rank: int) -> None:
    """One side of `_probe_gloo`: ping-pong 1-float and 16 MiB tensors with the other rank, time a
    small all-reduce, and the fixed costs FSDP2 and DTensor tensor parallelism add to tiny layers."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from placer.codegen.runtime.host_memory import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        def pingpong(t, n):
            for _ in range(n):
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)

        small, big = torch.zeros(1), torch.zeros(4 << 20)
        pingpong(small, 20)
        dist.barrier()
        trips = []
        for _ in range(200):
            t0 = time.perf_counter()
            pingpong(small, 1)
            trips.append(time.perf_counter() - t0)
        latency = sorted(trips)[len(trips) // 10] / 2  # a round trip needs both processes running
        pingpong(big, 1)
        dist.barrier()
        t0 = time.perf_counter()
        pingpong(big, 4)
        bandwidth = big.numel() * 4 * 8 / (time.perf_counter() - t0)
        # an all-reduce by size: gloo's chunks and its sums on the CPU cost more than the bytes
        # on the wire, the more so the smaller the tensor
        # each kind by size, keyed by the bytes each process sends: a whole tensor of n floats
        # for an all-reduce, half of it for an all-gather or a reduce-scatter (two processes)
        warnings.simplefilter("ignore", FutureWarning)  # *_into_tensor's newer names: not in older torch
        fns, keys = [], []
        for n in REDUCE_SIZES:
            whole, half = torch.zeros(n), torch.zeros(n // 2)
            fns += [functools.partial(dist.all_reduce, whole),
                    functools.partial(dist.all_gather_into_tensor, whole, half),
                    functools.partial(dist.reduce_scatter_tensor, half, whole),
                    functools.partial(dist.broadcast, whole, 0)]
            keys += [4 * n, 2 * n, 2 * n, 4 * n]
        *sized, halo_s = _busy([*fns, _halo()], 40)  # all taking turns: each meets the same spells
        got = list(zip(keys, sized))
        reduce_times, gather_times, scatter_times, broadcast_times = (got[k::4] for k in range(4))
        collective = reduce_times[0][1]  # an all-reduce of 2 floats
        send_times = _send_times(rank)
        overlap = _overlap(dist, nn)

        def train(*runs):
            """Seconds of a forward and backward of each (model, input), taking turns (`_busy`):
            its collectives after compute, as in a step."""
            return _busy([functools.partial(lambda m, x: m(x).sum().backward(), m, x) for m, x in runs], 40)

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        def fsdp2(width: int, rows: int) -> tuple[int, float]:
            """(a layer's parameter bytes, seconds of each of its FSDP2 collectives) on four
            Linear layers: per layer an all-gather forward, again backward, and a reduce-scatter,
            as FSDP2 runs them beside the compute (on CPU workers its gloo thread shares the
            core with it), with their copies in and out."""
            xs = torch.randn(rows, width)
            sharded = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
            for layer in sharded:
                fully_shard(layer)
            fully_shard(sharded)
            plain, whole = train((nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]), xs), (sharded, xs))
            return 4 * (width * width + width), (whole - plain) / 12

        sharded_times = [fsdp2(w, r) for w, r in SHARDED_SIZES]
        sharded_s = sharded_times[0][1]
        x = torch.randn(8, 64)
        # a bucket of gradients all-reduced as DDP does it (its hooks, the gradients copied into
        # the bucket and back, the all-reduce of 16 KiB): what a step's all-reduce of gradients
        # costs beyond its bytes
        from torch.nn.parallel import DistributedDataParallel

        plain, ddp = train((nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), x),
                           (DistributedDataParallel(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])), x))
        bucket_s = ddp - plain
        mesh = init_device_mesh("cpu", (2,))
        # a column-row pair with its activation between, as an MLP block has it. On an input
        # that does not train it runs DTensor's dispatch on each layer, forward and backward,
        # and the forward's all-reduce: what the plan's forward all-reduce of a pair stands for
        # (every pair has one). One whose input trains adds the backward's all-reduce.
        # By size: (the all-reduced activation's bytes, forward's, backward's seconds).
        split_times = []
        for width, rows in SPLIT_SIZES:
            # against what one device of the two computes plainly: half of each layer
            mine = nn.Sequential(nn.Linear(width, width // 2), nn.ReLU(), nn.Linear(width // 2, width))
            still, trains = torch.randn(rows, width), torch.randn(rows, width, requires_grad=True)
            pair = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
            parallelize_module(pair, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            alone, alone_trains, split, split_trains = train((mine, still), (mine, trains), (pair, still), (pair, trains))
            fwd = split - alone
            split_times.append((4 * rows * width, fwd, split_trains - alone_trains - fwd))
        (_, split_s, split_grad_s), *_ = split_times
        action_s = _pipeline_action(rank)
        if rank == 0:
            print(json.dumps({"latency": latency, "bandwidth": bandwidth, "collective": collective,
                              "reduce_times": reduce_times, "gather_times": gather_times,
                              "scatter_times": scatter_times, "broadcast_times": broadcast_times,
                              "send_times": send_times,
                              "overlap": overlap,
                              "sharded": max(sharded_s, collective), "sharded_times": sharded_times,
                              "split": max(split_s, collective),
                              "split_times": [(b, max(f, collective)) for b, f, _ in split_times],
                              "split_grad_times": [(b, max(g, collective)) for b, _, g in split_times],
                              "split_grad": max(split_grad_s, collective), "bucket": max(bucket_s, collective),
                              "action": action_s, "halo": halo_s}))
    finally:
        dist.destroy_process_group()


SHARDED_SIZES = ((64, 8), (512, 64))
"""(width, rows) of the Linear layers whose FSDP2 collectives calibrate `sharded_times`: 16 KiB
and 1 MiB of parameters a layer."""
SPLIT_SIZES = ((64, 8), (512, 128))
"""(width, rows) of the tensor-parallel pairs that calibrate `split_times`: activations of 2 KiB
and 256 KiB all-reduced."""
REDUCE_SIZES = (2, 1 << 16, 1 << 20)
"""Floats of the whole tensors whose all-reduce, all-gather and reduce-scatter calibrate
`reduce_times`, `gather_times`, `scatter_times` and `broadcast_times`: 8 B, 256 KiB, 4 MiB."""


SEND_SIZES = (1 << 12, 1 << 16, 1 << 20)
"""Bytes of the messages that calibrate `send_times`: 4 KiB, 64 KiB, 1 MiB."""


def _send_times(rank: int) -> list:
    """((bytes, seconds), ...) of one message from rank 0 to rank 1 after compute (`_busy`), the
    slower of the two sides (the receiver waits for the sender's compute too). On the 2-core
    bench machine 0.08 ms for 4 KiB but 0.5-0.7 ms for 64 KiB to 1 MiB, where back to back
    the link's 4.6 GB/s would take 0.01-0.2 ms."""
    import torch
    import torch.distributed as dist

    tensors = [torch.zeros(n // 4) for n in SEND_SIZES]
    one = functools.partial(dist.send, dst=1) if rank == 0 else functools.partial(dist.recv, src=0)
    slower = torch.tensor(_busy([functools.partial(one, t) for t in tensors], 40), dtype=torch.float64)
    dist.all_reduce(slower, op=dist.ReduceOp.MAX)
    return list(zip(SEND_SIZES, slower.tolist()))


def _overlap(dist, nn) -> float:
    """The fraction of a 4 MiB all-reduce hidden behind a backward that runs meanwhile, as DDP
    overlaps them: 1 where the wire has its own engine; on CPU workers gloo's threads take
    their time from the same cores."""
    import torch

    layer, x = nn.Linear(512, 512), torch.randn(128, 512, requires_grad=True)
    grad, t = torch.ones(128, 512), torch.zeros(1 << 20)

    def work():
        for _ in range(4):
            layer(x).backward(grad)

    def both():
        w = dist.all_reduce(t, async_op=True)
        work()
        w.wait()

    alone, reduce, together = _busy([work, lambda: dist.all_reduce(t), both], 20)
    return min(1.0, max(0.0, (alone + reduce - together) / reduce))


def _halo():
    """One halo exchange as a spatial segment's program runs it (the runtime's own
    `halo_exchange`: its autograd Function, a message posted each way and waited on, the rows
    put together) on a band of an image model's size (a row of 16 KiB: one of 2 KiB was five
    times faster, rows of 16-64 KiB took alike); timed as a step meets it, after compute, with
    the collectives (`_busy`). The forward's: the backward's exchange also follows a layer's
    compute, and moves as many rows."""
    import torch

    from placer.codegen.runtime.spatial import halo_exchange

    band = torch.randn(64, 4, 8, 16)
    owned, needed = [(0, 8), (8, 16)], [(0, 9), (7, 16)]  # one row from the other rank each
    return functools.partial(halo_exchange, band, [0, 1], owned, needed, 2)


def _pipeline_action(rank: int, microbatches: int = 4) -> float:
    """Seconds per action that torch's 1F1B schedule adds to its stage's work: a one-stage
    pipeline on each process (a group of its own) against the same forwards and backwards run
    plainly, the tenth-fastest of 30 steps each. Its messages are not in it: the plan's sends
    and receives cost `latency` each (a two-stage probe mixed in the other process's stalls,
    and varied fivefold from one probe to the next on a shared machine)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    solo = [dist.new_group([r]) for r in (0, 1)][rank]  # every process makes every group
    layer = nn.Linear(64, 64)
    loss = lambda y, target: (y - target).pow(2).mean()  # noqa: E731
    schedule = Schedule1F1B(PipelineStage(layer, 0, 1, torch.device("cpu"), group=solo), microbatches, loss_fn=loss)
    x, target = torch.randn(8 * microbatches, 64), torch.zeros(8 * microbatches, 64)

    def plain():
        for xm, tm in zip(x.chunk(microbatches), target.chunk(microbatches)):
            loss(layer(xm), tm).backward()

    piped = _low(lambda: schedule.step(x, target=target), 30)
    return max(piped - _low(plain, 30), 0.0) / (2 * microbatches)


if __name__ == "__main__":
    probe(int(sys.argv[1]), int(sys.argv[2]))
