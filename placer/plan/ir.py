"""The plan IR: what every device does in one training step.

A `Plan` holds the resolved segments (which layers, which devices, which
mode) and, per device, its ops in execution order. Lowering passes
(`placer.plan.lower`) turn a compute-only placement into a plan with copies,
splits, merges and collectives; `placer.plan.verify` checks the invariants.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace


class OpKind(enum.Enum):
    COMPUTE = "compute"  # forward/backward of a segment's layers on one device
    COPY = "copy"  # activation (fwd) / gradient (bwd) crosses from one device to another
    SPLIT = "split"  # scatter along `dim` from one device to a group
    MERGE = "merge"  # gather along `dim` from a group to one device
    RESPLIT = "resplit"  # group -> group re-split along `dim`
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    REDUCE = "reduce"  # gradients to one device (parameter server, broadcast sync)
    SEND = "send"  # pipeline stage boundary, one micro-batch
    RECV = "recv"
    HALO = "halo"  # spatial halo rows exchanged with neighbours
    STEP = "step"  # optimizer step


@dataclass(frozen=True, kw_only=True)
class PlacedSegment:
    """A segment of the spec with its layers resolved."""

    index: int
    name: str
    layers: tuple[str, ...]
    """Layer (module path) names in model order."""
    devices: tuple[str, ...]
    mode: str = "none"
    options: dict = field(default_factory=dict)
    """Mode options as the spec gives them, defaults filled (sync, bucket_mb, dim, ...)."""
    route: str = "direct"
    """How this segment's input arrives: direct | via_host."""
    stage: int | None = None
    """Pipeline stage index, when the spec has a pipeline."""


@dataclass(frozen=True, kw_only=True)
class Op:
    kind: OpKind
    devices: tuple[str, ...]
    """Device(s) taking part: one for COMPUTE, (src, dst) for COPY/SEND/RECV, the group for collectives."""
    segment: int
    """Index of the segment the op belongs to (for transitions: the consuming segment)."""
    phase: str = "fwd"
    """fwd | bwd | step."""
    tensor: str = ""
    """What moves or is computed: `act`, `grad`, `params`, `grads`, layer names ..."""
    bytes: int = 0
    """Payload per step in bytes (per device pair for copies, bucket bytes for collectives)."""
    dim: int | None = None
    route: str | None = None
    microbatch: int | None = None
    attrs: dict = field(default_factory=dict)

    def with_(self, **kw) -> "Op":
        return replace(self, **kw)


@dataclass(frozen=True, kw_only=True)
class Plan:
    name: str
    devices: tuple[str, ...]
    """Devices in spec order; rank r owns devices[r]."""
    segments: tuple[PlacedSegment, ...]
    ops: dict = field(default_factory=dict)
    """device -> tuple[Op, ...] in execution order on that device."""
    microbatches: int = 1
    schedule: str | None = None
    batch_size: int = 0

    def rank(self, device: str) -> int:
        return self.devices.index(device)

    def with_ops(self, ops: dict) -> "Plan":
        return replace(self, ops={d: tuple(ops.get(d, ())) for d in self.devices})
