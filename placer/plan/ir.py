"""The plan IR: what every device does in one training step.

A `Plan` holds the resolved segments (which layers, which devices, which
mode) and, per device, its ops in execution order. `placer.plan.place` makes
a compute-only placement; lowering passes (`placer.plan.lower`) add copies,
splits, merges, collectives and pipeline sends; `placer.plan.verify` checks
the invariants. `placer.plan.text` writes and reads the compact text form that
tests and golden files use (`format_plan` / `parse_plan`); the IR does not import it.

Where a tensor lives is a `Layout`: a device group and the dim it is cut
along (contiguous equal slices in group order), or no dim (every device
holds all of it). A segment's input and output layouts follow from its mode.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace


class OpKind(enum.Enum):
    COMPUTE = "compute"  # forward/backward of a run of a segment's layers on one device
    COPY = "copy"  # activation (fwd) / gradient (bwd) crosses from one device to another
    SPLIT = "split"  # one device -> a group: scatter along dst_dim (or the whole tensor to each)
    MERGE = "merge"  # a group -> one device: gather along src_dim (or sum, attrs reduce)
    RESPLIT = "resplit"  # group -> group re-distribution (src_dim -> dst_dim)
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"  # from attrs root to the rest of the op's devices
    REDUCE = "reduce"  # to attrs root: gradients to one device (parameter server, broadcast sync)
    SEND = "send"  # pipeline stage boundary, one micro-batch; listed on the sender
    RECV = "recv"  # its matching half, listed on the receiver
    ALL_TO_ALL = "all_to_all"  # each device sends rows to each (expert parallelism's dispatch / combine)
    HALO = "halo"  # spatial halo rows exchanged with neighbours along `dim`
    STEP = "step"  # optimizer step of a segment's parameters (or this device's shard of them)


TRANSFERS = frozenset({OpKind.COPY, OpKind.SPLIT, OpKind.MERGE, OpKind.RESPLIT})
"""Ops that move a segment-boundary activation (tensor `act`) or its gradient (`grad`)."""
P2P = frozenset({OpKind.SEND, OpKind.RECV})
COLLECTIVES = frozenset({OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.BROADCAST,
                         OpKind.REDUCE, OpKind.HALO, OpKind.ALL_TO_ALL})
PHASES = ("fwd", "bwd", "bwd_input", "bwd_weight", "step")
"""bwd_input / bwd_weight: the two halves of a backward in zero-bubble pipeline schedules."""


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
    """Mode options, defaults filled. data: sync, bucket_mb, overlap, shard, sync_batchnorm
    (+ server for parameter_server); spatial: dim (as written) and axis (the tensor dim index it
    splits); channel: axis (the channel dim of the segment's output)."""
    route: str = "direct"
    """How this segment's input arrives: direct | via_host."""
    stage: int | None = None
    """Pipeline stage index, when the spec has a pipeline."""
    recompute: bool = False
    """Activation checkpointing: forward keeps the segment's input only; backward recomputes
    the forward (one more forward's FLOPs) and holds its activations while it runs."""

    @property
    def degree(self) -> int:
        """How many devices share the segment's work (1 without a parallel mode)."""
        return len(self.devices) if self.mode != "none" else 1

    @property
    def server(self) -> str | None:
        return self.options.get("server") if self.options.get("sync") == "parameter_server" else None


@dataclass(frozen=True)
class Layout:
    """Where a tensor lives: on `devices`, cut along `dim` (None: whole on each device). With
    `replicas` (a 2-D segment), the devices are that many runs of consecutive devices: rows
    (dim 0) are cut across the runs, and `dim` within each run."""

    devices: tuple[str, ...]
    dim: int | None = None
    replicas: int = 1

    def leaders(self) -> "Layout":
        """The first device of each replica, holding its rows (a 2-D layout whole within each replica)."""
        t = len(self.devices) // self.replicas
        return Layout(self.devices[::t], 0) if self.replicas > 1 else self

    def runs(self) -> list[tuple[str, ...]]:
        """The replicas' devices, in order (one run: the whole group)."""
        t = len(self.devices) // self.replicas
        return [self.devices[i:i + t] for i in range(0, len(self.devices), t)]


def transfer_kind(src: tuple, dst: tuple) -> OpKind:
    if len(src) == 1:
        return OpKind.COPY if len(dst) == 1 else OpKind.SPLIT
    return OpKind.MERGE if len(dst) == 1 else OpKind.RESPLIT


def union(*groups) -> tuple[str, ...]:
    """Devices of several groups, each once, in order of first appearance."""
    return tuple(dict.fromkeys(d for g in groups for d in g))


def layer_range(layers) -> str:
    """`fc1` or `fc1..act2`: how a COMPUTE op names the run of layers it computes."""
    layers = list(layers)
    return layers[0] if len(layers) == 1 else f"{layers[0]}..{layers[-1]}"


@dataclass(frozen=True, kw_only=True)
class Op:
    kind: OpKind
    devices: tuple[str, ...]
    """Device(s) taking part: one for COMPUTE/STEP, src + dst for transfers and SEND/RECV, the
    group (in group order) for collectives."""
    segment: int
    """Index of the segment the op belongs to (for transitions: the consuming segment)."""
    phase: str = "fwd"
    """fwd | bwd | bwd_input | bwd_weight | step."""
    tensor: str = ""
    """What moves or is computed: `act`, `grad` (segment boundaries), `params`, `grads`,
    `stats`, a layer name, or a layer range `a..b` (COMPUTE)."""
    bytes: int = 0
    """Payload per step in bytes on the global batch (per micro-batch in pipelines): the
    whole tensor for transfers and gathers, the bucket for all-reduce / reduce / broadcast,
    what one SEND carries. What actually moves between which devices: plan.layout.moves."""
    dim: int | None = None
    """Tensor dim of a collective: gathered / scattered dim, or HALO's split dim."""
    route: str | None = None
    """Transfers: direct | via_host."""
    microbatch: int | None = None
    src: tuple[str, ...] = ()
    """Transfers, SEND, RECV: the devices data leaves from (in their layout's order)."""
    dst: tuple[str, ...] = ()
    src_dim: int | None = None
    """Transfers: the dim the source layout is cut along (None: whole on each source device)."""
    dst_dim: int | None = None
    attrs: dict = field(default_factory=dict)
    """Extra facts: bucket, layers (a bucket's layer range), root (BROADCAST/REDUCE),
    shard (ZeRO's broadcast of one device's parameters), prev_rows / next_rows (HALO)."""

    def with_(self, **kw) -> "Op":
        return replace(self, **kw)

    @property
    def owner(self) -> str:
        """The one device whose list counts this op (ops shared by devices sit in each list)."""
        return self.devices[-1] if self.kind == OpKind.RECV else self.devices[0]


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
    accumulate: int = 1
    precision: str = "fp32"
    """training.precision: bf16 keeps the activations autocast makes in bfloat16 (half the bytes)."""
    """training.accumulate: micro-steps per step, each on batch_size / accumulate rows; ops once
    per step, their bytes summed over the micro-steps (a per-micro-step gather N times)."""

    def rank(self, device: str) -> int:
        return self.devices.index(device)

    def with_ops(self, ops: dict) -> "Plan":
        return replace(self, ops={d: tuple(ops.get(d, ())) for d in self.devices})

    def unique_ops(self) -> list[Op]:
        """Every op once: each from its owner's list, in the owner's order, owners in device order."""
        return [op for d in self.devices for op in self.ops.get(d, ()) if op.owner == d]

    def chunk_layers(self, op: Op) -> tuple[str, ...]:
        """The layers a COMPUTE op runs (its `tensor` range within its segment)."""
        layers = self.segments[op.segment].layers
        a, _, b = op.tensor.partition("..")
        i = layers.index(a)
        return layers[i:layers.index(b) + 1] if b else layers[i:i + 1]
