"""What every parallel mode answers: the `Mode` interface and its defaults.

Each mode file (`single`, `data`, `channel`, `tensor`, `spatial`) defines one subclass and
registers it in `placer.modes.MODES`; validate, plan, estimate and codegen ask the mode of a
segment instead of testing its name. The defaults are those of a segment that runs whole on
one device (`single`). `seg` is a spec Segment in the checks, a plan PlacedSegment in
lowering and memory, and a codegen Seg in emission.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from placer.diagnostics import Diagnostic
from placer.plan.attach import Attached


class Lowering(NamedTuple):
    """What a mode's lowering reads besides the segment: layer -> trainable parameter bytes,
    DDP-like gradient buckets for a bucket size in MB, a Conv/Pool layer's geometry, whether
    a module model runs in lockstep (a group then takes and gives the whole activation), and
    whether the forward runs under bf16 autocast (Linear outputs bfloat16)."""

    sizes: dict
    buckets: Callable[[float], list]
    geometry: Callable[[str], dict | None]
    lockstep: bool = False
    bf16: bool = False
    tied_bytes: int = 0
    """Bytes of the tied parameters' copies the segment holds that its buckets leave out (a tie's
    own all-reduce sums them) but its parameters hold: what ZeRO-1 steps and broadcasts."""
    rows_in: int = 0
    """A 2-D tensor group in lockstep: bytes of the tensor with the batch's rows that arrives from
    another segment and trains (the hidden state, its rows cut there): its gradient's all-gather."""


class Mode:
    name = "none"
    options_keys: tuple[str, ...] = ()
    """The `parallel` options the mode takes (fields of spec.types.Parallel; the JSON Schema's
    per-mode properties are tested equal to them)."""
    whole_on_each = False
    """Every device of the group holds the whole input and output activation (channel, tensor)."""
    forward_sends_activations = False
    """Whether the group's forward communicates activations (channel, tensor, spatial)."""
    lockstep_group = False
    """Whether a module model's segment of this mode over several devices runs in lockstep beside
    other segments (codegen/runtime/lockstep.py): every device of the group runs the segment's
    layers on the whole activation (tensor, channel), so what enters is sent to each, what leaves
    is sent from the first, and its gradient to each."""
    chain = False
    """Whether the program runs the segment as a chain of its layers (nn.Sequential), not the
    model's own forward: a module model's segment must then be one (channel)."""
    holds_slices = False
    """Whether a 2-D segment's devices hold slices of its parameters (tensor, channel), so that a
    `sync: parameter_server` keeps a copy of every position's (SliceServer); spatial's hold the
    whole weights, which its server keeps whole, as data's does."""
    splits_params = False
    """Whether the group's devices hold parts of some parameters while each runs its rows of the
    batch (expert: its experts), so the whole values are gathered before they are saved."""
    rows_around = False
    """Whether a module model's 2-D group in lockstep cuts its replica's rows where tensors enter
    it and gathers them after its last layer (replica_rows_around: tensor), not inside a chain
    of its layers (ReplicaRows: channel, spatial)."""

    # -- validate -----------------------------------------------------------------------------------
    def module_model_blocker(self, spec, seg) -> str | None:
        """Why the program cannot split a module model's (`model.module`) segment `seg` (a spec
        Segment over several devices) this way, as words after the mode's name; None if it can."""
        return None

    def check_module(self, seg, info, locs, degree: int) -> list[Diagnostic] | None:
        """The mode's rules on a module model's segment (its LayerInfos and each one's spec loc),
        or None: `check` on the layers' classes, as for inline layers."""
        return None

    def check_options(self, spec, seg) -> list[Diagnostic]:
        """The mode's options against the spec (devices, batch), before layers are known."""
        return []

    def check(self, seg, seg_layers, kinds: Sequence[str], pipelined: bool) -> list[Diagnostic]:
        """The mode's rules on the segment's layers (spec Layers and their kinds)."""
        return []

    def check_shapes(self, seg, seg_layers, shapes_in: dict) -> list[Diagnostic]:
        """The mode's rules on an inline model's layer input shapes (name -> shape without batch)."""
        return []

    def recompute_blocker(self, p) -> str | None:
        """Why a segment of this mode (`p`: its Parallel options) cannot be recomputed
        (`recompute: true`), or None: recomputing a forward that communicates would repeat
        its collectives in backward, which neither the program nor the plan does yet."""
        return None

    def data_degree(self, n: int, replicas: int = 1) -> int:
        """Into how many parts the segment's group of n devices cuts the batch (`replicas`: its
        `data` option, a 2-D segment's replicas)."""
        return 1

    def torch_pipeline_blocker(self, p) -> str | None:
        """Why torch's pipeline schedules cannot run a stage of this mode over several devices
        (`p`: its Parallel options), or None. (Stages that all hold the whole activation on as
        many devices, `whole_on_each`, run as one pipeline per rank: the caller's rule.)"""
        return f"a pipeline stage of mode {self.name!r} beside stages of other modes or sizes"

    def rough_sync_bytes(self, param_bytes: int, out_bytes: int, n: int, options: dict) -> float:
        """About how many bytes each of the segment's n devices moves over its link a step to keep
        it in sync (`out_bytes`: its layers' outputs on the global batch): the placement search's
        quick bound, which orders candidates for the step-time model. One device: none."""
        return 0.0

    def state_share(self, n: int, options: dict) -> float:
        """The fraction of the segment's optimizer state each of its n devices keeps."""
        return 1.0

    dcp_names = True
    """Whether its ranks hold whole tensors of the model or DTensor shards of them, which
    torch.distributed.checkpoint saves under the model's names and reshards into any other such
    layout (not slices or copies of the program's own)."""

    def reshard_blocker(self, seg) -> str | None:
        """Why a checkpoint of a segment of this mode (`seg`: codegen's Seg) cannot resume under
        another placement, as words after "segment K (NAME)", or None (`dcp_names`)."""
        return None if self.dcp_names else f"is {self.name} parallel, whose slices are this program's own"

    def replica_blocker(self, p) -> str | None:
        """Why a module model's segment of this mode over several devices cannot be a group of
        replica pipelines in lockstep (plan/crossings.py), as words after "segment NAME is", or
        None: its layers run inside the whole model's forward, so the group syncs after the
        lockstep backward. By default where torch's schedules could not run it either."""
        return self.torch_pipeline_blocker(p)

    # -- plan ---------------------------------------------------------------------------------------
    def options(self, p, layers, graph) -> dict:
        """The plan's options of a segment (defaults filled), from its spec Parallel options."""
        return {}

    def layout_dim(self, seg) -> int | None:
        """The activation dim the group's devices hold slices of; None: whole on each device."""
        return None

    def steppers(self, seg) -> tuple[str, ...]:
        """Devices that run the optimizer step for the segment's parameters (a 2-D segment's
        under `sync: broadcast`: its first replica, the first n / D devices; under
        `sync: parameter_server`: the server, which steps a copy of every position's slices)."""
        if seg.options.get("sync") == "parameter_server":
            return (seg.options["server"],)
        if seg.options.get("sync") == "broadcast":
            return seg.devices[:len(seg.devices) // seg.options["data"]]
        return seg.devices

    def collectives(self, a: Attached, seg, info, grads: Sequence[bool], op, ctx: Lowering) -> None:
        """The collectives the mode adds in and around the segment (`op` makes a group op)."""

    def work_cut(self, seg) -> dict[int, int]:
        """{input dim: parts}: the input a device's call of one of the segment's layers computes on,
        as the cost model times it (estimate/layertime.py): by default the batch's rows cut into
        the segment's degree, exact for data parallelism; a tensor or channel device's slice of
        the weights is timed as the whole layer on its share of the rows (as many FLOPs)."""
        return {0: seg.degree}

    def sliced_dims(self, seg, info) -> list[int | None]:
        """Per layer (LayerInfo), the dim of its output each device holds a slice of (None: whole)."""
        return [self.layout_dim(seg)] * len(info)

    def held_modules(self, layers, info) -> tuple[str, ...]:
        """Names in the model of the modules whose parameters the program cuts over the group
        while the rows are cut too (expert: each mixture's experts); () for other modes."""
        return ()

    def device_notes(self, seg) -> list[str]:
        """What each device of the plan's segment holds, for the diagram's header (expert: its
        experts); [] when every device holds the same layers."""
        return []

    # -- estimate -----------------------------------------------------------------------------------
    def plan_note(self, seg) -> str | None:
        """A note for the plan about an assumption the mode's numbers make (expert: uniform routing)."""
        return None

    def held(self, seg, info, d: int, r: int, share) -> list[tuple[int, int]]:
        """(parameter elements, buffer bytes) of each layer that rank r of the d devices holds
        (`share(n, d, r)`: its part of n split d ways)."""
        return [(l.params, l.buffer_bytes) for l in info]

    def fsdp_rows(self, seg, info, d: int, r: int) -> list[tuple[int, int] | None]:
        """Per layer (LayerInfo), (dim-0 length, bytes per dim-0 row) of the parameters that rank r
        of the d devices holds, where they share one (a Linear / Conv / BatchNorm's output
        channels): FSDP2 pads each parameter's dim 0 to a multiple of its group's size, and gathers
        and reduce-scatters the padded shards. None: counted as held, unpadded."""
        return [None] * len(info)

    def saved_copies(self, seg, info, d: int, geometry) -> list[int]:
        """Per layer (LayerInfo), bytes (global batch) that a device of the d keeps for backward
        beyond what the one-device trace counted: copies the mode makes of a layer's input and the
        layer saves (`geometry(name)`: a Conv/Pool's kernel, stride, padding, dilation, or None)."""
        return [0] * len(info)

    def comm_buffers(self, seg, held: int, largest: int) -> int:
        """Bytes of communication buffers a device of the segment holds through a step, given the
        parameter bytes it holds and those of its largest layer."""
        return 0

    def zero_whole(self, seg) -> bool:
        """Whether `shard: optimizer` runs torch's ZeroRedundancyOptimizer over whole parameters
        (its greedy partition: memory.zero_partition), not an even share of slices (ZeroSlices)."""
        return False

    def unit_buffers(self, seg, units: list[int], shards: int) -> int:
        """Bytes of buffers in flight at a device's backward peak only (freed before the optimizer
        step), given the parameter bytes of each layer it holds before sharding: FSDP2's
        (`shard: full`, over `shards` devices), `fsdp_in_flight`."""
        return fsdp_in_flight(units, shards) if seg.options.get("shard") == "full" else 0

    # -- the program --------------------------------------------------------------------------------
    def describe(self, seg, devices) -> str:
        """What the group does, for the program's comments ('' for one device)."""
        return ""

    def runtime(self, seg, torch_pipeline: bool) -> set[str]:
        """The runtime pieces the program pastes for this segment."""
        return set()

    def emit_stage(self, seg, resumable: bool) -> list[str]:
        """The lines that make seg{k} from the segment's `stage` over its group g{k}."""
        return [f"seg{seg.k} = stage"]

    def emit_sync(self, seg) -> tuple[tuple[int, ...], list[str]]:
        """(ranks that run them, lines): the gradient sync and optimizer step after backward."""
        return seg.ranks, [f"opt{seg.k}.step()"]

    def emit_norm_share(self, seg) -> str:
        """Under `clip_grad_norm`, the line adding the segment's gradients to `norm_params`: its
        slices on every rank, its whole parameters on its owner."""
        return f"norm_params += norm_share(seg{seg.k}, owner=rank == {seg.owner})"

    def emit_norm_share_sharded(self, seg, leaders: tuple[int, ...]) -> str:
        """Under `clip_grad_norm`, the line adding a 2-D segment's `shard: full` gradients (FSDP2
        over its replicas) to `norm_params`, each piece once; `leaders`: each replica's first rank.
        FSDP2 x TP's pieces: norm_share_2d."""
        return f"norm_params += norm_share_2d(seg{seg.k}, tp_first=rank in {leaders})"

    def chain_call(self, seg) -> str:
        """In lockstep, what the model's forward calls for a chain group (`run_as_chain`): its
        split, taking and giving the whole activation on each rank."""
        return f"seg{seg.k}"

    def emit_gather(self, seg) -> list[str]:
        """Lines that set `whole` to the segment's whole parameters (by name) when they are split."""
        return [f"whole = named_params(seg{seg.k}, model)  # segment {seg.k}: DTensors, each gathered whole as finish",
                "GATHERED.update(whole)  # writes it, one at a time (every rank of the group takes part)"]

    def emit_whole_grads(self, seg) -> list[str]:
        """Lines that name the split parameters whose first-step gradients run --check gathers whole
        (WHOLE_GRADS): DTensors here, by full_tensor; the group's first rank keeps them."""
        return [f"WHOLE_GRADS.update({{n: (p, rank == {seg.owner}) for n, p in named_params(seg{seg.k}, model).items()}})"
                "  # run --check"]


def fsdp_in_flight(units: list[int], shards: int) -> int:
    """The most FSDP2 holds while one unit (a placed layer with parameters, of `units` bytes
    whole) runs backward: its gathered parameters and its whole gradients, the unit before it
    gathered ahead (backward prefetch), and the unit after it's whole gradients, the input of
    the reduce-scatter that FSDP2 waits for only at this unit's own. Less this unit's gradient
    shard, counted as made when its backward runs: it exists only after the reduce-scatter."""
    units = [b for b in units if b]
    return max((2 * p - p // shards + (units[i - 1] if i else 0) + (units[i + 1] if i + 1 < len(units) else 0)
                for i, p in enumerate(units)), default=0)
