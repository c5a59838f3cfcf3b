"""FLOPs per device, load balance, and `estimate`: the whole per-step estimate of a plan.

FLOPs: a forward chunk costs its layers' forward FLOPs, a backward twice that
(a zero-bubble schedule's input and weight halves once each), times the
device's share of the work (1/d in every parallel mode: its slice of the
batch, the rows, or the channels) and per micro-batch 1/m.
Balance: the busiest device's FLOPs over the mean of the devices that compute.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from placer.estimate.comm import Communication, communication
from placer.estimate.memory import DeviceMemory, memory, state_slots
from placer.model.graph import ModelGraph
from placer.modes import MODES
from placer.plan.ir import OpKind, Plan
from placer.spec.types import Optimizer

BACKWARD_FACTOR = {"fwd": 1, "bwd": 2, "bwd_input": 1, "bwd_weight": 1}


def flops(plan: Plan, graph: ModelGraph) -> dict[str, int]:
    """FLOPs per device per step (forward + backward)."""
    out = {}
    for dev in plan.devices:
        total = 0
        for op in plan.ops.get(dev, ()):
            if op.kind == OpKind.COMPUTE:
                seg = plan.segments[op.segment]
                fwd = sum(graph.layer(l).flops for l in plan.chunk_layers(op))
                # a recomputed segment's backward runs its forward again first
                factor = BACKWARD_FACTOR[op.phase] + (seg.recompute and op.phase in ("bwd", "bwd_input"))
                total += factor * fwd // (seg.degree * plan.microbatches)
        out[dev] = total
    return out


def balance(per_device: dict[str, int]) -> tuple[float, str | None, float]:
    """(busiest / mean, busiest device, mean) over devices that compute; (1.0, None, 0) if none do."""
    busy = {d: f for d, f in per_device.items() if f > 0}
    if not busy:
        return 1.0, None, 0.0
    mean = sum(busy.values()) / len(busy)
    top = max(busy, key=lambda d: (busy[d], -list(busy).index(d)))
    return busy[top] / mean, top, mean


@dataclass(frozen=True, kw_only=True)
class DeviceEstimate(DeviceMemory):
    device: str
    flops: int = 0
    sent_bytes: int = 0
    payload_bytes: int = 0
    """What it hands to torch.distributed per step: what `placer run` measures as bytes sent."""
    recv_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class Estimate:
    per_device: dict
    """device -> DeviceEstimate, in plan order."""
    comm: Communication
    balance: float
    busiest: str | None
    mean_flops: float
    optimizer: str
    optimizer_slots: int
    optimizer_known: bool
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Assumptions a reader should know (an optimizer whose state size is assumed, ...)."""

    @property
    def memory(self) -> dict:
        return self.per_device


def estimate(plan: Plan, graph: ModelGraph, optimizer: Optimizer, prefetch: int | str = "auto",
             geometry=lambda name: None) -> Estimate:
    """Memory, communication and FLOPs of one step of the plan, per device and in total
    (`prefetch`: training.prefetch, the batches made ahead; `geometry`: as `memory` takes it)."""
    mem = memory(plan, graph, optimizer, prefetch, geometry)
    fl = flops(plan, graph)
    comm = communication(plan)
    slots, known = state_slots(optimizer)
    per = {d: DeviceEstimate(device=d, flops=fl[d], sent_bytes=comm.sent.get(d, 0), payload_bytes=comm.payload.get(d, 0),
                             recv_bytes=comm.received.get(d, 0), **vars(mem[d])) for d in plan.devices}
    ratio, busiest, mean = balance(fl)
    notes = []
    if not known:
        notes.append(f"optimizer {optimizer.op}: state size unknown, assumed {slots} parameter-sized buffers")
    moe = [(l.name, e, k) for l in graph.layers for _, e, k in l.experts]
    if moe:
        kinds = sorted({(e, k) for _, e, k in moe})
        what = ", ".join(f"{e} experts, top {k}" if k else f"{e} experts" for e, k in kinds)
        notes.append(f"mixture of experts in {len(moe)} layer{'s' * (len(moe) > 1)} ({what}): FLOPs and activations "
                     "count the experts each token visits (top k of them), exact for any routing while a layer's "
                     "experts sit on one device")
    notes += [note for s in plan.segments if len(s.devices) > 1 and (note := MODES[s.mode].plan_note(s))]
    return Estimate(per_device=per, comm=comm, balance=ratio, busiest=busiest, mean_flops=mean,
                    optimizer=optimizer.op, optimizer_slots=slots, optimizer_known=known, notes=tuple(notes))
