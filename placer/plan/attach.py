"""`Attached`: the collectives a segment's mode needs, by where they run relative to its layers.

A mode's lowering (placer.modes.<mode>.collectives) fills one; `placer.plan.lower` splits
the segment's COMPUTE ops at its cuts and puts the ops in every participant's list.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from placer.plan.ir import Op, layer_range


@dataclass
class Attached:
    """Collectives of one segment, by where they run relative to its layers.

    Layer-level ops hang on chunks (runs of layers computed without a break; `cuts` are the
    layer indices where chunks start): `pre_fwd[i]` / `pre_bwd[i]` run before the forward /
    backward of the chunk starting at layer i, `post_fwd[i]` / `post_bwd[i]` after those of
    the chunk holding layer i.
    Each entry is (op, scale, weight): entries repeat for every micro-batch, `scale` ones
    (activations) with bytes / m; `weight` ones go with a zero-bubble schedule's weight half."""

    cuts: set = field(default_factory=set)
    pre_fwd: dict = field(default_factory=dict)
    post_fwd: dict = field(default_factory=dict)
    pre_bwd: dict = field(default_factory=dict)
    post_bwd: dict = field(default_factory=dict)
    seg_pre_fwd: list = field(default_factory=list)
    """Once per step, before the segment's first forward on the device."""
    seg_post_bwd: list = field(default_factory=list)
    """Once per step, after the segment's last backward on the device (gradient sync)."""
    step_pre: list = field(default_factory=list)
    step_post: list = field(default_factory=list)
    step_devices: tuple = ()

    def add(self, table: str, layer: int, op: Op, scale: bool = True, weight: bool = False) -> None:
        getattr(self, table).setdefault(layer, []).append((op, scale, weight))

    def empty(self) -> bool:
        return not (self.pre_fwd or self.post_fwd or self.pre_bwd or self.post_bwd or self.seg_pre_fwd
                    or self.seg_post_bwd or self.step_pre or self.step_post)


def bucket_ops(kind, seg, group, phase, tensor, bks, root=None, reverse=False) -> list[Op]:
    """One op per gradient bucket (bytes, layers), in bucket order or `reverse`d; `root` for a broadcast/reduce."""
    order = list(enumerate(bks))
    order = order[::-1] if reverse else order
    extra = {"root": root} if root else {}
    return [Op(kind=kind, devices=group, segment=seg.index, phase=phase, tensor=tensor, bytes=b,
               attrs={"bucket": k, "layers": layer_range(names), **extra}) for k, (b, names) in order]
