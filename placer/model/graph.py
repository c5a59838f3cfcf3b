"""ModelGraph: the placeable layers of a model with their shapes, sizes and FLOPs.

Produced by `placer.model.build.build_graph(spec)` from a meta-device model
(no weight memory is spent), consumed by placement, estimates and codegen.
All sizes are for one training step on the *global* batch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LayerInfo:
    name: str
    """Layer name: inline name (`block.2`) or module path (`blocks.2`)."""
    op: str
    """Module class name (`Linear`, `TransformerEncoderLayer`, user class)."""
    params: int
    """Number of trainable parameter elements (owned by this layer, counted once)."""
    param_bytes: int
    buffer_bytes: int
    in_shape: tuple | None
    """Shape of the (first) input, batch dim included, on the global batch; None if unknown."""
    out_shape: tuple | None
    out_dtype: str = "float32"
    out_bytes: int = 0
    """Bytes of the output activation on the global batch (what a copy moves forward)."""
    in_bytes: int = 0
    saved_bytes: int = 0
    """Activation bytes kept for backward (global batch)."""
    flops: int = 0
    """Forward FLOPs on the global batch (backward is counted as 2x forward by estimates)."""


@dataclass(frozen=True, kw_only=True)
class ModelGraph:
    layers: tuple[LayerInfo, ...]
    """Placeable layers in execution order."""
    batch_size: int
    input_shape: tuple
    input_dtype: str
    traced_with: str = "inline"
    """How shapes were found: inline | fx | export | hooks."""

    @property
    def names(self) -> list[str]:
        return [l.name for l in self.layers]

    def layer(self, name: str) -> LayerInfo:
        return next(l for l in self.layers if l.name == name)

    @property
    def total_params(self) -> int:
        return sum(l.params for l in self.layers)
