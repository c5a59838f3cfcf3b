"""The spec as frozen, typed objects, each carrying where the user wrote it.

Built from a schema-valid `Document` by `from_document`. The field defaults here
are the one Python source of placer's defaults: `from_document` leaves out what
the user did not write, consumers that read options from a plan fall back on
`DEFAULT_PARALLEL`, and a unit test holds the JSON Schema's `default`s equal to them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from placer.diagnostics import Loc
from placer.spec.load import Document

MODES = ("none", "data", "channel", "tensor", "spatial", "expert")


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    shape: tuple
    """Entries are positive ints or "B" (the global batch size)."""
    dtype: str = "float32"
    high: int | None = None
    """Integer tensors are drawn in [low, high)."""
    low: int = 0
    loc: Loc = field(default_factory=Loc, compare=False)

    def concrete(self, batch: int) -> tuple:
        return tuple(batch if d == "B" else d for d in self.shape)


@dataclass(frozen=True, kw_only=True)
class Layer:
    name: str
    """Expanded name (`block.2` for the third of `repeat: 4`)."""
    op: str
    """A `torch.nn` class name."""
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    loc: Loc = field(default_factory=Loc, compare=False)
    norms: tuple[int, ...] = field(default=(), compare=False)
    """A module model's layer once built: its BatchNorms' channels, nested ones included
    (`LayerInfo.norms`), so that W002/W006 see a BatchNorm inside a user block."""

    @property
    def batchnorm(self) -> str | None:
        """How it is a BatchNorm for the warnings: `is` (its op), `holds` (nested), or None."""
        return "is" if self.op.startswith("BatchNorm") else "holds" if self.norms else None


@dataclass(frozen=True, kw_only=True)
class Model:
    layers: tuple[Layer, ...] | None = None
    """Inline layers, expanded (repeat), in model order; None for a module model."""
    module: str | None = None
    """`path/to/file.py:Class` (relative to the spec) or `pkg.mod:Class`."""
    kwargs: dict = field(default_factory=dict)
    output: str | None = None
    """The field of a mapping or `ModelOutput` the loss takes (`logits`); None: the output itself."""
    input: TensorSpec
    """The one input tensor; with `inputs`, the first of them (its dim 0 is the batch's)."""
    target: TensorSpec
    """With `output: loss`, a placeholder of one value a row: the batch still yields (input, target)."""
    loss: str
    """A torch.nn loss; "" with `output: loss` (the model's own)."""
    inputs: tuple[tuple[str, TensorSpec], ...] = ()
    """`model.inputs`: (name, tensor) of each input forward takes by keyword; () for `input`."""
    loc: Loc = field(default_factory=Loc, compare=False)

    @property
    def inline(self) -> bool:
        return self.layers is not None

    @property
    def own_loss(self) -> bool:
        """`output: loss`: forward computes the loss (HF's from `labels`), no `loss:` or `target:`."""
        return self.output == "loss"


@dataclass(frozen=True, kw_only=True)
class Parallel:
    mode: str = "none"
    sync: str = "allreduce"
    server: str | None = None
    bucket_mb: float = 25.0
    overlap: bool = True
    shard: str = "none"
    sync_batchnorm: bool = False
    dim: str | int = "H"
    """`spatial` split dim: "H", "W" or a tensor dim index."""
    data: int = 1
    """`tensor`, `channel`, `spatial`: data replicas of consecutive devices, each split by the mode (a 2-D segment)."""
    loc: Loc = field(default_factory=Loc, compare=False)


DEFAULT_PARALLEL = Parallel()
"""The mode options a segment has when the spec gives none (`bucket_mb` 25 as in DDP, ...)."""


@dataclass(frozen=True, kw_only=True)
class Selector:
    text: str
    loc: Loc = field(default_factory=Loc, compare=False)


@dataclass(frozen=True, kw_only=True)
class Segment:
    index: int
    name: str
    """User name, or `s{index}`."""
    selectors: tuple[Selector, ...]
    devices: tuple[str, ...]
    """One device for `device:`, the group for `devices:`."""
    parallel: Parallel
    route: str | None = None
    """Per-segment copy route for its input; None means the spec-wide route."""
    recompute: bool = False
    """Activation checkpointing: the segment's activations are recomputed in backward."""
    loc: Loc = field(default_factory=Loc, compare=False)
    device_locs: tuple[Loc, ...] = ()

    @property
    def mode(self) -> str:
        return self.parallel.mode


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    microbatches: int
    schedule: str = "1f1b"
    loc: Loc = field(default_factory=Loc, compare=False)


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    op: str
    lr: float | None = None
    kwargs: dict = field(default_factory=dict)
    loc: Loc = field(default_factory=Loc, compare=False)


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    op: str
    """A `torch.optim.lr_scheduler` class name."""
    kwargs: dict = field(default_factory=dict)
    loc: Loc = field(default_factory=Loc, compare=False)


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    every: int
    dir: str = "ckpt"
    """Relative paths are under the run directory."""
    keep: int | None = None
    """How many complete checkpoints to keep, newest first; None (the schema's default) keeps all."""
    loc: Loc = field(default_factory=Loc, compare=False)


@dataclass(frozen=True, kw_only=True)
class Data:
    module: str | None = None
    """None for synthetic data; else `file.py:function` returning an iterator of (input, target)."""
    kwargs: dict = field(default_factory=dict)
    loc: Loc = field(default_factory=Loc, compare=False)


@dataclass(frozen=True, kw_only=True)
class Training:
    batch_size: int
    steps: int
    optimizer: Optimizer
    seed: int = 0
    data: Data = field(default_factory=Data)
    prefetch: int | str = "auto"
    """Batches made ahead in a background thread; `auto`: `batches_ahead` says how many."""
    checkpoint: Checkpoint | None = None
    precision: str = "fp32"
    """fp32 | bf16 (autocast; parameters, gradients and optimizer state stay float32)."""
    accumulate: int = 1
    """Micro-steps per optimizer step, each on batch_size / accumulate rows."""
    clip_grad_norm: float | None = None
    """The global gradient norm is clipped to this; None: no clipping."""
    lr_schedule: LRSchedule | None = None
    loc: Loc = field(default_factory=Loc, compare=False)

def batches_ahead(prefetch: int | str, device_is_cpu: bool) -> int:
    """What training.prefetch makes ahead on a device. `auto`: 2 on a GPU, whose rank mostly waits
    on the GPU; none on a CPU worker, which already has its share of the cores: a thread there only
    takes turns with the compute (bench/vs_torch.py measured steps 3-8% slower with it)."""
    return int(prefetch) if prefetch != "auto" else 0 if device_is_cpu else 2


@dataclass(frozen=True, kw_only=True)
class Runtime:
    backend: str = "auto"
    simulate: str = "auto"
    """auto | always | never."""
    timeout_s: float = 300.0
    max_restarts: int = 0
    loc: Loc = field(default_factory=Loc, compare=False)


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """A listed device with what the spec states about it (`{name: cuda:0, memory: 80GiB, hardware: h100}`)."""
    name: str
    memory: int | None = None
    """Bytes a plan may use on it (what `plan` estimates as its total); None: no limit stated."""
    hardware: str | None = None
    """The hardware profile it is scored on (estimate/hardware.py); None: the command's choice."""
    loc: Loc = field(default_factory=Loc, compare=False)


SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_size(value: int | str) -> int:
    """`80GiB`, `16 GB`, `512MiB` or an integer, in bytes (the schema's `memory_size`)."""
    if isinstance(value, int):
        return value
    number, unit = re.fullmatch(r"([0-9.]+)\s*([A-Za-z]+)", value.strip()).groups()  # type: ignore[union-attr]
    return int(float(number) * SIZE_UNITS[unit])


@dataclass(frozen=True, kw_only=True)
class Spec:
    name: str
    description: str | None
    model: Model
    devices: tuple[str, ...]
    """The listed devices' names, in order (a mapping's `name`)."""
    placement: tuple[Segment, ...]
    """() with `auto`: the search (placer/search) fills it in."""
    pipeline: Pipeline | None
    route: str = "direct"
    """Spec-wide copy route: direct | via_host."""
    training: Training
    runtime: Runtime
    file: str
    """The spec file (for resolving relative module paths)."""
    doc: Document = field(repr=False, compare=False)
    """The loaded document, for locations of anything else."""
    device_specs: tuple[DeviceSpec, ...] = ()
    """Each listed device with its stated memory and hardware (None where not stated)."""
    auto: bool = False
    """`placement: auto` or no placement: the search chooses it."""

    def device_loc(self, device: str) -> Loc:
        return self.doc.loc(("devices", self.devices.index(device)))


def _expand_layers(doc: Document, raw: list) -> tuple[Layer, ...]:
    out = []
    for i, l in enumerate(raw):
        loc = doc.loc(("model", "layers", i))
        common = dict(op=l["op"], args=tuple(l.get("args", ())), kwargs=dict(l.get("kwargs", {})), loc=loc)
        if "repeat" in l:
            out += [Layer(name=f"{l['name']}.{k}", **common) for k in range(l["repeat"])]
        else:
            out.append(Layer(name=l["name"], **common))
    return tuple(out)


def _device(doc: Document, i: int, raw: str | dict) -> DeviceSpec:
    if isinstance(raw, str):
        return DeviceSpec(name=raw, loc=doc.loc(("devices", i)))
    return DeviceSpec(name=raw["name"], memory=parse_size(raw["memory"]) if "memory" in raw else None,
                      hardware=raw.get("hardware"), loc=doc.loc(("devices", i)))


def _given(raw: dict, *keys: str) -> dict:
    """The keys the user wrote: the others take the dataclass's defaults."""
    return {k: raw[k] for k in keys if k in raw}


def _tensor(doc: Document, path: tuple, raw: dict) -> TensorSpec:
    return TensorSpec(shape=tuple(raw["shape"]), **_given(raw, "dtype", "high", "low"), loc=doc.loc(path))


def _parallel(doc: Document, path: tuple, raw) -> Parallel:
    if raw is None:
        return Parallel(loc=doc.loc(path))
    if isinstance(raw, str):
        return Parallel(mode=raw, loc=doc.loc(path))
    return Parallel(loc=doc.loc(path), **raw)


def from_document(doc: Document) -> Spec:
    """Typed spec from a document that already passed the JSON Schema."""
    d = doc.data
    m = d["model"]
    model = Model(
        layers=_expand_layers(doc, m["layers"]) if "layers" in m else None,
        module=m.get("module"),
        kwargs=dict(m.get("kwargs", {})),
        output=m.get("output"),
        input=_tensor(doc, ("model", "input"), m["input"]) if "input" in m else
        _tensor(doc, ("model", "inputs", next(iter(m["inputs"]))), next(iter(m["inputs"].values()))),
        inputs=tuple((k, _tensor(doc, ("model", "inputs", k), v)) for k, v in m.get("inputs", {}).items()),
        target=_tensor(doc, ("model", "target"), m["target"]) if "target" in m else TensorSpec(shape=("B",)),
        loss=m.get("loss", ""),
        loc=doc.loc(("model",)),
    )
    segments = []
    auto = d.get("placement", "auto") == "auto"
    for i, s in enumerate([] if auto else d["placement"]):
        p = ("placement", i)
        if "devices" in s:
            devs, dlocs = tuple(s["devices"]), tuple(doc.loc(p + ("devices", k)) for k in range(len(s["devices"])))
        else:
            devs, dlocs = (s["device"],), (doc.loc(p + ("device",)),)
        sels = s["layers"] if isinstance(s["layers"], list) else [s["layers"]]
        sel_paths = [p + ("layers", k) for k in range(len(sels))] if isinstance(s["layers"], list) else [p + ("layers",)]
        segments.append(Segment(
            index=i,
            name=s.get("name", f"s{i}"),
            selectors=tuple(Selector(text=t, loc=doc.loc(sp)) for t, sp in zip(sels, sel_paths)),
            devices=devs,
            device_locs=dlocs,
            parallel=_parallel(doc, p + ("parallel",), s.get("parallel")),
            route=s.get("copies", {}).get("route"),
            **_given(s, "recompute"),
            loc=doc.loc(p),
        ))
    t = d["training"]
    opt = t["optimizer"]
    data = t.get("data")  # absent or "synthetic": Data(); else the user's module
    ck = t.get("checkpoint")
    sched = t.get("lr_schedule")
    rt = dict(d.get("runtime", {}))
    if "simulate" in rt:
        rt["simulate"] = {True: "always", False: "never"}.get(rt["simulate"], rt["simulate"])
    if "timeout_s" in rt:
        rt["timeout_s"] = float(rt["timeout_s"])
    pl = d.get("pipeline")
    return Spec(
        name=d["name"],
        description=d.get("description"),
        model=model,
        devices=tuple(x if isinstance(x, str) else x["name"] for x in d["devices"]),
        device_specs=tuple(_device(doc, i, x) for i, x in enumerate(d["devices"])),
        auto=auto,
        placement=tuple(segments),
        pipeline=Pipeline(microbatches=pl["microbatches"], **_given(pl, "schedule"),
                          loc=doc.loc(("pipeline",))) if pl else None,
        **_given(d.get("copies", {}), "route"),
        training=Training(
            batch_size=t["batch_size"],
            steps=t["steps"],
            optimizer=Optimizer(op=opt["op"], lr=opt.get("lr"), kwargs=dict(opt.get("kwargs", {})),
                                loc=doc.loc(("training", "optimizer"))),
            **_given(t, "seed", "prefetch", "precision", "accumulate"),
            clip_grad_norm=float(t["clip_grad_norm"]) if "clip_grad_norm" in t else None,
            lr_schedule=LRSchedule(op=sched["op"], kwargs=dict(sched.get("kwargs", {})),
                                   loc=doc.loc(("training", "lr_schedule"))) if sched else None,
            data=Data(module=data["module"], kwargs=dict(data.get("kwargs", {})), loc=doc.loc(("training", "data")))
            if isinstance(data, dict) else Data(loc=doc.loc(("training", "data"))),
            checkpoint=Checkpoint(every=ck["every"], **_given(ck, "dir", "keep"),
                                  loc=doc.loc(("training", "checkpoint"))) if ck else None,
            loc=doc.loc(("training",)),
        ),
        runtime=Runtime(**_given(rt, "backend", "simulate", "timeout_s", "max_restarts"), loc=doc.loc(("runtime",))),
        file=doc.file,
        doc=doc,
    )
