"""Hardware profiles for the cost model: what one device computes, copies and sends per second.

GPU profiles come from the vendors' data sheets (peak dense FP32 and BF16 FLOP/s, memory
bandwidth, NVLink / PCIe bandwidth per direction) times `SUSTAINED`, the fraction of a peak that
training kernels reach in practice; their fixed costs (latency, per layer, per collective) are
assumed, not measured. The `cpu` profile is measured
on this machine by `estimate/calibrate.py` (about 20 s, with the thread count each CPU worker
gets) and cached under ~/.cache/placer (XDG_CACHE_HOME), keyed by the machine, the CPU count, torch's
version and the threads. `placer plan --hardware cpu` then times the plan's own layers and
optimizer steps at each device's shapes (`estimate/layertime.py`, cached beside it per layer):
`layer_times` and `step_times`, which replace the rates and the update cost where present.
"""
from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUSTAINED = 0.6
"""Fraction of a data-sheet peak (FLOP/s and bandwidth) the cost model assumes training reaches."""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    flops: float
    """Sustained FP32 FLOP/s of one device on large dense layers (matmuls, convolutions)."""
    rates: tuple = ()
    """Measured ((FLOPs of a layer, forward FLOP/s, backward FLOP/s), ...) by size: small layers
    run far below the peak. Empty: `flops` at every size."""
    conv_rates: tuple = ()
    """The same for convolutions (Conv1d-3d, ConvTranspose1d-3d), measured on Conv2d layers: their
    kernels (im2col / oneDNN) run at other rates than a matmul of as many FLOPs. Empty: `rates`."""
    bf16_flops: float
    mem_bw: float
    """Bytes/s through device memory: elementwise layers and the optimizer step."""
    link_bw: float
    """Bytes/s one device sends to another (one direction)."""
    host_bw: float
    """Bytes/s between a device and its host's memory (copies via_host)."""
    latency: float
    """Seconds per message: each copy or send."""
    collective_s: float
    """Fixed seconds of a small collective (an all-reduce of one float)."""
    reduce_times: tuple = ()
    """Measured ((bytes each process sends, seconds), ...) of an all-reduce between two processes
    by size: its bytes cost more than the link's bandwidth says (chunks, the sums). Empty:
    `link_bw` alone."""
    gather_times: tuple = ()
    """The same of an all-gather (FSDP2's parameters)."""
    scatter_times: tuple = ()
    """The same of a reduce-scatter (FSDP2's gradients)."""
    send_times: tuple = ()
    """The same of one message between two processes, keyed by its bytes: a copy's or a
    pipeline's send, after compute (the receiver's wait)."""
    broadcast_times: tuple = ()
    """The same of a broadcast, keyed by the bytes its root sends (ZeRO-1's parameters after
    the step, a parameter server's)."""
    overlap: float = 1.0
    """The fraction of an all-reduce's time that a backward running meanwhile hides (DDP's
    overlap): 1 where the link has its own engine; measured on CPU workers, whose gloo threads
    share the cores with the compute."""
    sharded_s: float
    """Fixed seconds of each all-gather / reduce-scatter a fully sharded (FSDP2) layer runs."""
    sharded_times: tuple = ()
    """Measured ((a layer's parameter bytes, seconds), ...) of each FSDP2 collective of a layer by
    its size, its bytes, FSDP2's copies and its gloo thread's share of the core included: these
    replace `sharded_s` and the collective's bytes where present."""
    bucket_s: float = 0.0
    """Fixed seconds of each all-reduce of a bucket of gradients, as DDP runs it (its hooks, the
    gradients copied into the bucket and back); 0: `collective_s`."""
    split_s: float
    """Fixed seconds of a tensor-parallel (DTensor) pair's forward all-reduce, with DTensor's
    dispatch on the pair's layers forward and backward (measured on a column-row pair with its
    activation between, its input not training)."""
    split_grad_s: float = 0.0
    """Fixed seconds of the backward all-reduce of a pair whose input trains (what such a pair
    adds); 0: `split_s`."""
    split_times: tuple = ()
    """Measured ((the all-reduced activation's bytes, seconds), ...) of a pair's forward all-reduce
    as `split_s` counts it, by size, its bytes included: these replace `split_s` and the bytes."""
    split_grad_times: tuple = ()
    """The same of a pair's backward all-reduce (`split_grad_s`)."""
    action_s: float
    """Fixed seconds of each pipeline action (a stage's forward or backward of one micro-batch):
    the schedule's own machinery; its messages are the plan's sends and receives."""
    halo_s: float = 0.0
    """Fixed seconds of each spatial halo exchange as the program runs it (its autograd Function,
    a message each way, the rows put together); 0: `latency`, as any message."""
    layer_overhead: float
    """Seconds per layer per pass that do not depend on its size (kernel launch, Python, autograd)."""
    update_s: float
    """Optimizer step seconds per parameter element and buffer it reads (the parameter and each
    state slot: Adam's is 3)."""
    tensor_overhead: float
    """Seconds per parameter tensor in an optimizer step."""
    step_overhead: float
    """Seconds per training step outside the layers: the batch, the loss, zero_grad, bookkeeping."""
    source: str
    layer_times: dict = field(default_factory=dict, compare=False, repr=False)
    """(segment, layer) -> (forward, backward) seconds of one call on one device of the plan's
    segment, measured (estimate/layertime.py; the cpu profile), then the same with its weights
    still in cache where a step repeats it (micro-batches); these replace the layer's rate model
    and fixed cost. Empty: the rates serve every layer (data-sheet profiles)."""
    step_times: dict = field(default_factory=dict, compare=False, repr=False)
    """device -> measured seconds of its optimizer step (all it steps), in place of `update_s` and
    `tensor_overhead` (estimate/layertime.py; the cpu profile)."""
    batch_s: float = 0.0
    """Measured seconds each rank spends making the step's batch (the spec's synthetic data, as
    the program makes it; estimate/layertime.py); 0: not measured."""


def _gpu(name, fp32_tflops, bf16_tflops, mem_tbps, link_gbps, pcie_gbps, source) -> Hardware:
    s = SUSTAINED
    return Hardware(name=name, flops=fp32_tflops * 1e12 * s, bf16_flops=bf16_tflops * 1e12 * s,
                    mem_bw=mem_tbps * 1e12 * s, link_bw=link_gbps * 1e9 * s, host_bw=pcie_gbps * 1e9 * s,
                    latency=10e-6, collective_s=30e-6, sharded_s=60e-6, split_s=40e-6, action_s=50e-6, layer_overhead=20e-6, update_s=16 / (mem_tbps * 1e12 * s),
                    tensor_overhead=5e-6, step_overhead=2e-3,
                    source=source)


# Data-sheet figures: FP32 (non-tensor-core) and dense BF16 TFLOP/s, memory TB/s, NVLink GB/s per
# direction (half the quoted bidirectional figure), PCIe GB/s per direction.
PROFILES = {
    "h100": _gpu("h100", 67, 989, 3.35, 450, 64, "NVIDIA H100 SXM5 data sheet"),
    "h100-pcie": _gpu("h100-pcie", 51, 756, 2.0, 300, 64, "NVIDIA H100 PCIe data sheet"),
    # NVIDIA H200 SXM data sheet (nvidia.com/en-us/data-center/h200): 67 TFLOP/s FP32, 989 dense
    # BF16 (1,979 is with sparsity), 141 GB of HBM3e at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s
    # (both bidirectional: 450 and 64 per direction)
    "h200": _gpu("h200", 67, 989, 4.8, 450, 64, "NVIDIA H200 SXM data sheet"),
    "a100": _gpu("a100", 19.5, 312, 2.04, 300, 32, "NVIDIA A100 SXM4 80GB data sheet"),
    "l4": _gpu("l4", 30.3, 121, 0.3, 32, 32, "NVIDIA L4 data sheet (PCIe only)"),
    "v100": _gpu("v100", 15.7, 15.7, 0.9, 150, 16, "NVIDIA V100 SXM2 data sheet (no BF16: FP32 rate)"),
}
CHOICES = ("cpu", *PROFILES)
CALIBRATION = 15
"""What `calibrate` measures, in the cache's key: a profile cached by an older calibration
(1: no `conv_rates`; 2: no `reduce_times` nor `overlap`; 3: no `halo_s`; 4: the gloo figures'
medians, not low quantiles; 5: no `gather_times` nor `scatter_times`; 6: `action_s` with two
processes' stalls; 7: `halo_s` after a layer; 8: `split_s` without the pair's activation; 9:
`split_s` halved over both all-reduces, no `split_grad_s`; 10: no `bucket_s`; 11: no
`sharded_times`; 12: no `split_times`; 13: `split_times` against a whole pair's compute; 14:
the collectives back to back, at a low quantile, each call's freed memory handed back to the
kernel, no `broadcast_times` nor `send_times`) is measured again."""


def profile(name: str, workers_per_host: int = 1) -> Hardware:
    """A named profile; `cpu` is measured on this machine (cached) for `workers_per_host` workers."""
    if name != "cpu":
        return PROFILES[name]
    return cached_cpu(threads(workers_per_host))


def threads(workers_per_host: int) -> int:
    """The threads each CPU worker of a run gets: this machine's cores shared among its workers."""
    return max(1, (os.cpu_count() or 1) // max(1, workers_per_host))


def is_cached(workers_per_host: int) -> bool:
    return _cache_path(threads(workers_per_host)).exists()


def _cache_path(threads: int) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "placer"
    # the calibration in the name too: placer versions that measure differently keep their own
    return base / f"cpu-{platform.node() or 'host'}-{threads}t-c{CALIBRATION}.json"


def layers_cache_path(threads: int) -> Path:
    """Where the plan's layers timed with `threads` threads are kept (estimate/layertime.py)."""
    return _cache_path(threads).with_name(f"layers-{platform.node() or 'host'}-{threads}t-c{CALIBRATION}.json")


def cached_cpu(threads: int) -> Hardware:
    import torch

    key = {"torch": torch.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
           "calibration": CALIBRATION}
    path = _cache_path(threads)
    try:
        doc = json.loads(path.read_text())
        if doc.get("key") == key:
            fields = doc["profile"]
            tables = ("rates", "conv_rates", "reduce_times", "gather_times", "scatter_times", "send_times", "broadcast_times",
                      "sharded_times", "split_times", "split_grad_times")
            return Hardware(**{**fields, **{k: tuple(tuple(r) for r in fields[k]) for k in tables}})
    except (OSError, ValueError, TypeError, KeyError):  # none yet, or unreadable: measure again
        pass
    from placer.estimate.calibrate import calibrate

    hw = calibrate(threads)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fields = {k: v for k, v in asdict(hw).items() if k not in ("layer_times", "step_times", "batch_s")}  # the plan's
        tmp.write_text(json.dumps({"key": key, "profile": fields}, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: calibrate again next time
    return hw


def reduce_seconds(hw: Hardware, nbytes: float) -> float:
    """An all-reduce's bytes (`sized_seconds` on `reduce_times`)."""
    return sized_seconds(hw.reduce_times, hw, nbytes)


CONV_OPS = frozenset(f"{p}{n}d" for p in ("Conv", "ConvTranspose", "LazyConv", "LazyConvTranspose") for n in "123")
"""Layers whose FLOPs run at `conv_rates` (transformers' `Conv1D` is a Linear: not one of them)."""


def sized_seconds(pts: tuple, hw: Hardware, nbytes: float) -> float:
    """Seconds of the bytes of a collective that sends `nbytes` from each device, beyond the
    smallest one's, from its measured times by size `pts` (reduce_times, gather_times,
    scatter_times, broadcast_times, send_times): interpolated linearly between the sizes (past
    the largest, at its last step's rate); `link_bw` where the profile has no such table."""
    if len(pts) < 2:
        return nbytes / hw.link_bw
    (b0, t0), *rest = pts
    for (b1, t1), (b2, t2) in zip(pts, rest):
        if nbytes <= b2 or (b2, t2) == pts[-1]:
            return max(0.0, t1 + (t2 - t1) * (nbytes - b1) / (b2 - b1) - t0)
    return 0.0


def rate(hw: Hardware, flops: float, backward: bool = False, conv: bool = False) -> float:
    """FLOP/s of a layer of `flops` forward FLOPs: interpolated (log-log) between measured sizes,
    a convolution's (`conv`) between those of `conv_rates` where the profile has them."""
    table = hw.conv_rates if conv and hw.conv_rates else hw.rates
    if not table:
        return hw.flops
    pts = [(f, b if backward else r) for f, r, b in table]
    if flops <= pts[0][0]:
        return pts[0][1]
    for (f0, r0), (f1, r1) in zip(pts, pts[1:]):
        if flops <= f1:
            w = math.log(flops / f0) / math.log(f1 / f0)
            return math.exp(math.log(r0) + w * math.log(r1 / r0))
    return pts[-1][1]
