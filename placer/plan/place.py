"""Placement: the spec's segments on a model graph, as a compute-only plan.

`place(spec, graph)` resolves every segment's layers, fills in its mode
options and route, and gives each device its COMPUTE ops in execution order
(forward of every segment, backward in reverse, then optimizer STEPs; in a
pipeline, the order its schedule runs micro-batches in) - no communication
yet: that is what the lowering passes add.
"""
from __future__ import annotations

from placer.diagnostics import Diagnostic, PlanError, SpecError
from placer.model.graph import ModelGraph
from placer.modes import MODES
from placer.plan.ir import Op, OpKind, PlacedSegment, Plan, layer_range
from placer.plan.schedules import action_orders
from placer.plan.ties import copy_elements
from placer.spec import shapes
from placer.spec.check import resolve_segments
from placer.spec.types import Spec

PHASE_OF_ACTION = {"F": "fwd", "B": "bwd", "I": "bwd_input", "W": "bwd_weight"}


def segment_params(seg: PlacedSegment, graph: ModelGraph) -> tuple[int, int]:
    """(trainable parameter elements, their bytes) of a segment, root parameters it consumes included."""
    names = set(seg.layers)
    n = sum(graph.layer(l).params for l in seg.layers)
    b = sum(graph.layer(l).param_bytes for l in seg.layers)
    for r in graph.root_params:
        if r.trainable and r.consumer in names:
            n, b = n + r.numel, b + r.bytes
    tn, tb = copy_elements(seg, graph)  # its copy of a parameter tied to another segment's layer
    return n + tn, b + tb


def steppers(seg: PlacedSegment) -> tuple[str, ...]:
    """Devices that run the optimizer step for a segment's parameters."""
    return MODES[seg.mode].steppers(seg)


def _layers_per_segment(spec: Spec, graph: ModelGraph) -> list[list[str]]:
    """Layer names per segment (what `placer.model.build.segment_layers` does, without importing torch)."""
    groups, diags = resolve_segments(spec, graph.names)
    if diags:
        raise SpecError(diags)
    return [[graph.names[i] for i in idx] for idx in groups]


def placed_segments(spec: Spec, graph: ModelGraph, layers: list[list[str]] | None = None) -> tuple:
    layers = _layers_per_segment(spec, graph) if layers is None else layers
    return tuple(
        PlacedSegment(index=seg.index, name=seg.name, layers=tuple(names), devices=tuple(seg.devices),
                      mode=seg.mode, options=MODES[seg.mode].options(seg.parallel, names, graph),
                      route=seg.route or spec.route,
                      stage=seg.index if spec.pipeline else None, recompute=seg.recompute)
        for seg, names in zip(spec.placement, layers))


def _compute(seg: PlacedSegment, device: str, phase: str, microbatch: int | None = None) -> Op:
    return Op(kind=OpKind.COMPUTE, devices=(device,), segment=seg.index, phase=phase,
              tensor=layer_range(seg.layers), microbatch=microbatch)


def _sequential(segments) -> list[Op]:
    """One step without a pipeline: every forward in model order, then every backward in reverse."""
    prog = [_compute(s, d, "fwd") for s in segments for d in s.devices]
    return prog + [_compute(s, d, "bwd") for s in reversed(segments) for d in s.devices]


def _pipelined(segments, schedule: str, m: int) -> list[Op]:
    """Each device group runs its stages' actions in the order torch's schedule runs them."""
    groups: list[tuple] = []
    for s in segments:
        if s.devices not in groups:
            groups.append(s.devices)
    orders = action_orders(schedule, len(groups), len(segments), m)
    prog = []
    for g, order in enumerate(orders):
        for d in groups[g]:
            prog += [_compute(segments[a.stage], d, PHASE_OF_ACTION[a.kind], a.microbatch) for a in order]
    return prog


def place(spec: Spec, graph: ModelGraph, layers: list[list[str]] | None = None) -> Plan:
    """The compute-only plan: resolved segments, and each device's COMPUTE and STEP ops.

    `layers` (names per segment) defaults to `placer.model.build.segment_layers`."""
    segments = placed_segments(spec, graph, layers)
    empty = [s for s in segments if not s.layers]
    if empty:
        raise PlanError(Diagnostic("P070", f"segment {empty[0].name!r} has no layers",
                                   spec.placement[empty[0].index].loc, "give every segment at least one layer"))
    pl = spec.pipeline
    prog = _pipelined(segments, pl.schedule, pl.microbatches) if pl else _sequential(segments)
    prog += [Op(kind=OpKind.STEP, devices=(d,), segment=s.index, phase="step", tensor="params")
             for s in segments if segment_params(s, graph)[0] for d in steppers(s)]
    ops: dict[str, list[Op]] = {d: [] for d in spec.devices}
    for op in prog:
        ops[op.devices[0]].append(op)
    plan = Plan(name=spec.name, devices=tuple(spec.devices), segments=segments,
                microbatches=pl.microbatches if pl else 1, schedule=pl.schedule if pl else None,
                batch_size=spec.training.batch_size, accumulate=spec.training.accumulate,
                precision=spec.training.precision)
    return plan.with_ops(ops)


def layer_geometry(spec: Spec, name: str) -> dict | None:
    """kernel / stride / padding / dilation per spatial dim of an inline Conv or Pool layer, else None."""
    if spec.model.layers is None:
        return None
    layer = next((l for l in spec.model.layers if l.name == name), None)
    w = shapes.window(layer) if layer is not None else None
    if w is None or not w.static:
        return None  # padding="same" and friends: no static halo
    return {"kernel": w.kernel, "stride": w.stride, "padding": w.padding, "dilation": w.dilation}
