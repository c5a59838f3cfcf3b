"""What the code generator needs to know about each segment, in rank terms.

`program_segments(plan, spec, graph)` turns the lowered plan's segments into `Seg`s: global ranks
instead of device names (rank r runs `rank_order(spec.devices)[r]`), the rows each rank
computes, the shape of the activation that enters the segment, whether its parameters
need an optimizer and who keeps the authoritative copy. Modes the generator does not
write yet raise a PlanError naming the segment.
"""
from __future__ import annotations

import keyword
import re
from dataclasses import dataclass

from placer.device import Device
from placer.diagnostics import Diagnostic, PlanError
from placer.model.graph import ModelGraph
from placer.modes import MODES, tensor
from placer.plan import crossings
from placer.plan.ir import TRANSFERS, OpKind, Plan
from placer.plan.layout import in_layout
from placer.plan.place import segment_params
from placer.spec.check import own_loops_blocker, torch_pipeline_blocker
from placer.spec.types import DEFAULT_PARALLEL, Spec

FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}


def rank_order(devices) -> tuple[str, ...]:
    """Devices in rank order: node by node (torchrun numbers ranks that way), spec order within a node."""
    return tuple(sorted(devices, key=lambda d: Device.parse(d).node))


@dataclass(frozen=True)
class Seg:
    k: int
    name: str
    layers: tuple[str, ...]
    ranks: tuple[int, ...]
    """Global ranks of the group, in group order (slices of the batch go in this order)."""
    mode: str
    """none | data | channel | tensor | spatial."""
    sync: str | None = None
    """data: allreduce | parameter_server | broadcast."""
    server: int | None = None
    bucket_mb: float = DEFAULT_PARALLEL.bucket_mb
    overlap: bool = DEFAULT_PARALLEL.overlap
    sync_batchnorm: bool = DEFAULT_PARALLEL.sync_batchnorm
    route: str = "direct"
    """How the segment's input arrives: direct | via_host."""
    has_params: bool = True
    in_shape: tuple = ()
    """The entering activation on the global batch (the model input for segment 0)."""
    in_dtype: str = "float32"
    out_shape: tuple = ()
    """The activation leaving the segment, on the global batch (a micro-batch in a pipeline)."""
    out_dtype: str = "float32"
    rows: int = 0
    """Rows of the batch each rank of the group computes."""
    grad_in: bool = False
    """Whether a gradient flows back out of this segment's input (to the previous segment)."""
    shard: str = "none"
    """data: none | optimizer (ZeRO-1) | full (FSDP2)."""
    dim: int | None = None
    """The activation dim the group's ranks hold slices of, from the plan's layout (0: rows of a
    data group; a spatial group's bands); None: whole on each rank."""
    moved_in: bool = False
    """The plan moves the previous segment's output into this one (a transfer op, or a
    pipeline's sends); otherwise both hold it alike and the program copies nothing."""
    loss_gather: bool = False
    """The plan gathers this (last) segment's output on its first rank for the loss (a spatial
    group's bands: the loss takes rows)."""
    pairs: tuple = ()
    """tensor: the Linear pairs the plan all-reduces, as (column, row) child names of the stage;
    a module model's blocks: ('q+k+v', 'proj') module paths."""
    blocks: bool = False
    """tensor over a module model's blocks (placer.modes.tensor.groups)."""
    recompute: bool = False
    """Activation checkpointing: the forward runs again in backward (torch.utils.checkpoint)."""
    chained: bool = False
    """A module model's chain group (channel, spatial) in lockstep: the model's forward runs its
    split (runtime/lockstep.py run_as_chain)."""
    replicas: int = 1
    """A 2-D segment's data replicas (its `data` option): runs of consecutive ranks, each split by the mode."""
    experts: tuple = ()
    """expert: the experts modules' names in the model, each cut over the group."""
    rows_in: tuple = ()
    """A 2-D tensor group in lockstep: (layer, leaf) of what it receives with the batch's rows, which
    each rank cuts to its replica's rows (runtime bands.py replica_rows_around); the first
    segment's is ("", 0), the model's input (the batch itself)."""

    @property
    def replicated(self) -> bool:
        """Every rank of the group holds the whole input and output activation (channel, tensor)."""
        return len(self.ranks) > 1 and self.dim is None

    @property
    def split_dim(self) -> int:
        """The activation dim the group's ranks hold slices of (0, rows, when whole)."""
        return self.dim or 0

    @property
    def layout(self) -> tuple:
        """(ranks, dim, replicated, replicas): how the group holds the activations that enter and leave it."""
        return (list(self.ranks), self.split_dim, self.replicated, self.replicas)

    @property
    def sharded_params(self) -> bool:
        """Whether the parameters are DTensors (tensor parallel, FSDP) or channel shards, so the
        whole values are gathered (a collective over the group) before they are saved."""
        return self.replicated or self.shard == "full" or MODES[self.mode].splits_params

    @property
    def slice_server(self) -> bool:
        """`sync: parameter_server` on a 2-D tensor or channel segment: the server keeps copies of
        every position's slices (SliceServer). spatial x data's devices hold the whole weights, so
        its server keeps them whole too, as data's does."""
        return self.sync == "parameter_server" and self.replicas > 1 and MODES[self.mode].holds_slices

    @property
    def holders(self) -> tuple[int, ...]:
        """Ranks that keep a copy of the segment's layers (a parameter server outside the group too)."""
        extra = (self.server,) if self.server is not None and self.server not in self.ranks and \
            not self.slice_server else ()  # (a 2-D segment's server keeps copies of slices: SliceServer)
        return self.ranks + extra

    @property
    def owner(self) -> int:
        """The rank whose parameters are the result (the one that steps, or the first replica)."""
        if self.sync != "parameter_server" or self.slice_server:  # (a 2-D server sends every slice back)
            return self.ranks[0]
        assert self.server is not None  # set with sync parameter_server
        return self.server

    @property
    def steppers(self) -> tuple[int, ...]:
        """Ranks that keep an optimizer for the segment."""
        if self.slice_server:  # stepping its copies of the slices
            assert self.server is not None  # set with sync parameter_server
            return (self.server,)
        if self.sync == "broadcast" and self.replicas > 1:  # each position's root: the first replica
            return tuple(tensor.runs(self.ranks, self.replicas)[0])
        if self.sync in ("parameter_server", "broadcast"):
            return (self.owner,)
        return self.ranks

    @property
    def func(self) -> str:
        """Name of the stage function: `stage_1_middle`, or `stage_1` for an unnamed segment."""
        if self.name == f"s{self.k}":
            return f"stage_{self.k}"
        ident = re.sub(r"\W", "_", self.name)
        return f"stage_{self.k}_{ident}" if (f"_{ident}").isidentifier() else f"stage_{self.k}"


def _unsupported(spec: Spec, k: int, what: str, hint: str) -> PlanError:
    seg = spec.placement[k]
    return PlanError(Diagnostic("G001", f"segment {seg.name!r}: {what} is not generated by this version of "
                                "placer", seg.loc, hint + " (`placer plan` still shows this spec)"))


def torch_schedules_take(spec: Spec) -> bool:
    """Whether torch's pipeline schedules run the spec's stages (check.torch_pipeline_blocker).
    Otherwise placer's own micro-batch loops run them (GPipe's, or codegen/loops.py's in the
    schedule's order), and what those cannot run stops with G001 (which validate announces as
    W005)."""
    blocker = torch_pipeline_blocker(spec)
    if blocker is None:
        return True
    assert spec.pipeline is not None  # asked only of a spec with a pipeline
    own = own_loops_blocker(spec)
    if own is None:
        return False
    k, what = own
    hint = ("torch's schedules take stages that are one device each, or data parallel with sync allreduce on "
            "equally many devices, copied directly; placer's own loops take any stages under gpipe, and stages "
            "split one way (one device, data, channel, tensor, spatial) under every schedule")
    if k is not None:
        raise _unsupported(spec, k, f"{what} under schedule {spec.pipeline.schedule!r}", hint)
    raise PlanError(Diagnostic("G001", f"{what} under schedule {spec.pipeline.schedule!r} are not generated by this "
                               "version of placer", spec.pipeline.loc, hint))


def program_segments(plan: Plan, spec: Spec, graph: ModelGraph, loops: bool = False) -> list[Seg]:
    """The lowered plan's segments in rank terms. `loops`: a gpipe pipeline written as
    micro-batch loops (no DDP: it would all-reduce after every micro-batch's backward)."""
    devices = rank_order(spec.devices)
    # the rows one forward sees: a pipeline's micro-batch, or one of accumulate's micro-steps
    m = (spec.pipeline.microbatches if spec.pipeline else 1) * spec.training.accumulate

    def per_step(shape) -> tuple:
        """A global-batch shape as one forward sees it: a micro-batch's (or micro-step's) rows."""
        return (shape[0] // m, *shape[1:]) if shape else ()
    out: list[Seg] = []
    any_params = False
    gathered = {op.segment for op in plan.unique_ops() if op.attrs.get("loss")}
    moved = {op.segment for op in plan.unique_ops() if op.phase == "fwd" and not op.attrs.get("loss") and (
        op.kind in TRANSFERS or op.kind == OpKind.SEND)}
    for placed in plan.segments:
        k = placed.index
        opts = placed.options
        mode = placed.mode if len(placed.devices) > 1 else "none"  # a mode over one device: the layers whole
        why = MODES[mode].module_model_blocker(spec, spec.placement[k]) if not spec.model.inline else None
        if why:
            raise _unsupported(spec, k, f"mode {mode!r} of a module model (`model.module`) {why}",
                               "give the model as inline `layers`, or use mode data / none here")
        ranks = tuple(devices.index(d) for d in placed.devices)
        first = graph.layer(placed.layers[0])
        shape: tuple | None
        if k == 0:
            shape, dtype = tuple(spec.model.input.concrete(spec.training.batch_size)), spec.model.input.dtype
        else:
            prev = graph.layer(out[-1].layers[-1])
            shape = first.in_shape or prev.out_shape
            dtype = prev.out_dtype
            if shape is None:
                raise PlanError(Diagnostic("G002", f"the shape of the activation entering segment {placed.name!r} "
                                           "is unknown", spec.placement[k].loc,
                                           "make the model trace with torch.fx (`placer validate --deep` shows why)"))
        n_params = segment_params(placed, graph)[0]
        dim = in_layout(placed).dim if mode != "none" else None  # options below: data's (absent elsewhere)
        out.append(Seg(
            k=k, name=placed.name, layers=tuple(placed.layers), ranks=ranks, mode=mode,
            sync=opts.get("sync"),
            server=devices.index(opts["server"]) if opts.get("sync") == "parameter_server" else None,
            bucket_mb=float(opts.get("bucket_mb", DEFAULT_PARALLEL.bucket_mb)),
            overlap=bool(opts.get("overlap", DEFAULT_PARALLEL.overlap)) and not loops,
            sync_batchnorm=bool(opts.get("sync_batchnorm", DEFAULT_PARALLEL.sync_batchnorm)), route=placed.route,
            has_params=n_params > 0, in_shape=per_step(shape), in_dtype=dtype,
            out_shape=per_step(graph.layer(placed.layers[-1]).out_shape or ()),
            out_dtype=graph.layer(placed.layers[-1]).out_dtype,
            rows=spec.training.batch_size // m // MODES[mode].data_degree(len(ranks), opts.get("data", 1)),
            grad_in=k > 0 and any_params and dtype in FLOAT_DTYPES,
            shard=opts.get("shard", "none"),
            dim=None if dim is None else dim % len(shape),  # -1 is W of NCHW: 3
            moved_in=k in moved, loss_gather=k in gathered,
            pairs=tuple(tensor.planned_pairs(plan, k) if opts.get("blocks") else  # () but in tensor
                        tensor.emit_pairs(placed.layers, tensor.planned_pairs(plan, k))),
            experts=MODES[mode].held_modules(placed.layers, [graph.layer(n) for n in placed.layers]),
            recompute=placed.recompute, blocks=bool(opts.get("blocks")), replicas=opts.get("data", 1),
            chained=MODES[mode].chain and len(ranks) > 1 and crossings.lockstep(spec, plan.segments),
            rows_in=(tuple((layer, leaf) for layer, leaf, _ in crossings.rows_entering(
                plan.segments, graph, k, spec.training.batch_size)) if k else (("", 0),))
            if MODES[mode].rows_around and opts.get("data", 1) > 1 and crossings.lockstep(spec, plan.segments)
            else (),
        ))
        any_params |= n_params > 0
        # the plan moves what the program copies: a move exactly where the layouts differ
        assert k == 0 or out[-1].moved_in == (out[-2].layout != out[-1].layout), (placed.name, out[-1].moved_in)
    return out


def identifier(name: str, taken=()) -> bool:
    """Whether `name` can be a Python global of the program."""
    return name.isidentifier() and not keyword.iskeyword(name) and name not in taken
