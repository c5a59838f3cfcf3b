"""Semantic checks: what the JSON Schema cannot say.

Each rule returns diagnostics in file order; `check` runs them all. Nothing
here imports torch or user code (names come from `torch_names`).
"""
from __future__ import annotations

import os

from placer.device import Device
from placer.diagnostics import Diagnostic, Loc, SpecError, closest, name_hint
from placer.modes import MODES
from placer.plan.schedules import SCHEDULES
from placer.spec import load, schema, select, shapes, torch_names
from placer.spec.types import Spec, from_document

INT_DTYPES = {"int64", "int32", "bool"}
MAX_LAYERS = 10_000


def D(code, msg, loc, hint=None, severity="error"):
    return Diagnostic(code, msg, loc, hint, severity)


def layer_names(spec: Spec) -> list[str] | None:
    return [l.name for l in spec.model.layers] if spec.model.layers is not None else None


def resolve_segments(spec: Spec, names: list[str]) -> tuple[list[list[int]], list[Diagnostic]]:
    """Layer indices per segment, and diagnostics for selectors and coverage."""
    out: list[list[int]] = []
    diags: list[Diagnostic] = []
    owner: dict[int, int] = {}  # layer index -> segment index
    chosen_by: dict[int, str] = {}  # layer index -> the first selector that selects it
    for seg in spec.placement:
        idx: list[int] = []
        for sel in seg.selectors:
            hits = select.match(sel.text, names)
            if isinstance(hits, str):
                diags.append(D("P001", f"segment {seg.name!r}: {hits}", sel.loc, _selector_hint(sel.text, names)))
                continue
            for i in hits:
                if i in owner or i in idx:
                    where = ("twice in segment " if i in idx else "also in segment ") + \
                        repr(seg.name if i in idx else spec.placement[owner[i]].name)
                    diags.append(D("P002", f"layer {names[i]!r} is {where}", sel.loc,
                                   _overlap_hint(names[i], (chosen_by.get(i, ""), sel.text))))
                chosen_by.setdefault(i, sel.text)
            idx += hits
        for i in idx:
            owner.setdefault(i, seg.index)
        out.append(sorted(set(idx)))
    if not diags:
        missing = [n for i, n in enumerate(names) if i not in owner]
        if missing:
            listed = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            msg = f"layer {missing[0]!r} is placed nowhere" if len(missing) == 1 else \
                f"{len(missing)} layers are placed nowhere: {listed}"
            diags.append(D("P003", msg, spec.doc.loc(("placement",)),
                           "every layer must be in exactly one segment: add the missing ones"))
        order = [i for seg in out for i in seg]
        for seg, idx in zip(spec.placement, out):
            if idx and idx != list(range(idx[0], idx[-1] + 1)):
                diags.append(D("P004", f"segment {seg.name!r} is not contiguous in model order: "
                               f"{_gap(idx, names)}", seg.loc,
                               "a segment holds a run of consecutive layers (model order is the order of first "
                               "calls in the traced forward; layers it never calls come last)"))
        if not any(d.code == "P004" for d in diags) and order != sorted(order):
            diags.append(D("P004", "segments are not in model order", spec.doc.loc(("placement",)),
                           "list segments in the order the model runs them"))
    return out, diags


def _gap(idx: list[int], names: list[str]) -> str:
    """The model order around a segment's first gap: its layers before it, the others' in it
    (`'shared'` registered first but never called, so ordered last, after `'lm_head'`)."""
    k = next(j for j in range(len(idx) - 1) if idx[j + 1] != idx[j] + 1)
    a, b = idx[k], idx[k + 1]
    inside = [repr(n) for n in names[a + 1:b]]
    shown = ", ".join(inside[:3]) + (f", ... ({len(inside)} layers)" if len(inside) > 3 else "")
    return f"{names[a]!r} comes before {shown} (not in this segment), then {names[b]!r}"


def _overlap_hint(name: str, texts: tuple[str, str]) -> str:
    """P002's hint: where one selector names a parent module of the other's layer, say so."""
    parent = next((t for t in texts if name.startswith(t + ".") and not select.is_range(t)
                   and not select.is_glob(t)), None)
    if parent:
        return f"{parent!r} is the parent of {name!r}: place its children, or the parent whole, not both"
    return "every layer belongs to exactly one segment"


def _nested_hint(text: str, names: list[str]) -> str | None:
    """For a dotted name that selects nothing: the layers under its nearest existing parent, or
    that a layer it lies inside has no submodules to place."""
    parts = text.split(".")
    for k in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:k])
        if parent in names:
            return f"{parent!r} is a layer with no submodules to place: name it whole"
        under = [n for n in names if n.startswith(parent + ".")]
        if under:
            shown = ", ".join(under[:8]) + (f", ... ({len(under)} in all)" if len(under) > 8 else "")
            dym = closest(text, under)
            return f"the layers under {parent!r} are {shown}" + (f" (did you mean {dym!r}?)" if dym else "")
    return None


def _selector_hint(text: str, names: list[str]) -> str:
    """Hint for a selector that selects nothing: the closest layer or subtree name."""
    if select.is_range(text):
        a, _, b = text.partition("..")
        bad = [p for p in (a, b) if isinstance(select.match(p, names), str)]
        if not bad:  # both ends exist: the range runs backwards
            return f"write the range in model order: '{b}..{a}'"
        text = bad[0]
    if select.is_glob(text):
        prefixes = sorted({n.rsplit(".", 1)[0] for n in names if "." in n})
        stem = text.split("*")[0].split("?")[0].split("[")[0].rstrip(".")
        best = closest(stem, prefixes)
        return f"did you mean {best + text[len(stem):]!r}?" if best else name_hint("layers", text, names)
    return _nested_hint(text, names) or name_hint("layers", text, names)


def _check_devices(spec: Spec) -> list[Diagnostic]:
    diags = []
    seen: dict[Device, int] = {}
    for i, dev in enumerate(spec.devices):
        canon = Device.parse(dev)  # no prefix means node0: `node0/cuda:0` is `cuda:0`
        if canon in seen:  # exact repeats of a plain name are schema errors, of a mapping's name not
            also = "" if spec.devices[seen[canon]] == dev else f" (also as {spec.devices[seen[canon]]!r})"
            diags.append(D("P010", f"device {dev!r} is listed twice{also}",
                           spec.doc.loc(("devices", i)), "a device without a node prefix is on node0; "
                           "each listed device is one worker: keep one name"))
        seen.setdefault(canon, i)
    if spec.auto:  # nothing is placed yet: which devices run what is the search's choice
        return diags
    used = set()
    for seg in spec.placement:
        for dev, loc in zip(seg.devices, seg.device_locs):
            if dev not in spec.devices:
                diags.append(D("P012", f"segment {seg.name!r} is placed on unknown device {dev!r}", loc,
                               name_hint("devices", dev, spec.devices)))
            used.add(dev)
        dup = sorted({d for d in seg.devices if seg.devices.count(d) > 1})
        if dup:
            diags.append(D("P011", f"segment {seg.name!r} lists device {dup[0]!r} more than once", seg.loc,
                           "a group holds each device once"))
    server = [s.parallel.server for s in spec.placement if s.parallel.server]
    for dev in spec.devices:
        if dev not in used and dev not in server:
            diags.append(D("W001", f"device {dev!r} is listed but runs nothing", spec.device_loc(dev),
                           "remove it, or place a segment on it", severity="warning"))
    names = [s.name for s in spec.placement]
    for seg in spec.placement:
        if names.count(seg.name) > 1 and names.index(seg.name) != seg.index:
            diags.append(D("P013", f"segment name {seg.name!r} is used twice", seg.loc, "names must be unique"))
    return diags


def _check_modes(spec: Spec, groups: list[list[int]] | None) -> list[Diagnostic]:
    """Each segment's mode against its devices and options; then, when the segments
    resolved, the rules on their layers."""
    diags = []
    for seg in spec.placement:
        p, n = seg.parallel, len(seg.devices)
        ploc = p.loc
        if p.mode == "none" and n > 1:
            diags.append(D("P020", f"segment {seg.name!r} lists {n} devices but no parallel mode", seg.loc,
                           f"add 'parallel: data' (or {', '.join(m for m in MODES if m not in ('none', 'data'))}), "
                           "or use 'device:' for one device"))
        mode = MODES[p.mode]
        why = mode.module_model_blocker(spec, seg) if n > 1 and not spec.model.inline else None
        if why:
            diags.append(D("W007", f"segment {seg.name!r}: mode {p.mode!r} of a module model (`model.module`) {why} is "
                           "not generated by this version of placer (generate stops with G001)", ploc,
                           "give the model as inline layers, or use mode data / none here", severity="warning"))
        if p.mode != "none" and n < 2:
            diags.append(D("P021", f"segment {seg.name!r}: parallel mode {p.mode!r} needs at least 2 devices",
                           ploc, "use 'devices: [a, b, ...]', or drop 'parallel'"))
        diags += mode.check_options(spec, seg)
    return diags + (check_layer_kinds(spec, groups) if groups is not None else [])


def check_layer_kinds(spec: Spec, groups: list[list[int]], skip=frozenset()) -> list[Diagnostic]:
    """The mode rules that depend on what the layers are (channel, tensor and spatial layers,
    BatchNorm in data segments and pipelines), over `spec.model.layers` grouped by segment;
    `placer.model.build` runs them on a module model's layers as well."""
    diags = []
    layers = spec.model.layers
    assert layers is not None, "check_layer_kinds reads the layers (a module model's once built)"
    for seg in spec.placement:
        p = seg.parallel
        if seg.index in skip:  # checked by the mode's own module-model rules
            continue
        kinds = [shapes.kind(layers[i]) for i in groups[seg.index]]
        seg_layers = [layers[i] for i in groups[seg.index]]
        diags += MODES[p.mode].check(seg, seg_layers, kinds, pipelined=spec.pipeline is not None)
    norms = [layers[i] for g in groups for i in g if layers[i].batchnorm]
    if spec.pipeline and norms:
        diags.append(D("W006", f"layer {norms[0].name!r} {norms[0].batchnorm} a BatchNorm in a pipeline: it normalises over each "
                       f"micro-batch of {spec.training.batch_size // spec.pipeline.microbatches} rows, so run --check "
                       "cannot match one device", norms[0].loc, "use LayerNorm, or no pipeline, to check equivalence",
                       severity="warning"))
    return diags


def data_degree(seg) -> int:
    """Into how many parts a segment's group cuts each (micro-)batch."""
    return MODES[seg.parallel.mode].data_degree(len(seg.devices), seg.parallel.data)


def torch_pipeline_blocker(spec: Spec) -> tuple[int | None, str] | None:
    """Why torch's pipeline schedules cannot run the spec's stages, as (segment index or None,
    what), or None when they can: every stage one device or data parallel with sync
    allreduce (no shard, no sync_batchnorm), all with the same data degree; or every stage
    channel / tensor parallel on as many devices (one pipeline per rank of a group), and
    copies direct. Otherwise placer generates `gpipe` as micro-batch loops on its own
    copies, and no other schedule."""
    sizes = {len(s.devices) for s in spec.placement}
    whole = len(sizes) == 1 and all(MODES[s.parallel.mode].whole_on_each and s.parallel.data == 1  # (not 2-D)
                                    for s in spec.placement)
    for k, seg in enumerate(spec.placement):
        why = MODES[seg.parallel.mode].torch_pipeline_blocker(seg.parallel) if len(seg.devices) > 1 else None
        if why and not whole:  # (stages that all hold the whole activation run one pipeline per rank)
            return k, why
    for k, seg in enumerate(spec.placement[1:], 1):  # torch's stages send device to device
        if (seg.route or spec.route) == "via_host":
            return k, "a pipeline stage whose input is copied via host memory"
    degrees = {data_degree(s) for s in spec.placement}
    if len(degrees) > 1:
        return None, f"pipeline stages with different data degrees {sorted(degrees)}"
    return None


def own_loops_blocker(spec: Spec) -> tuple[int | None, str] | None:
    """Why placer's own micro-batch loops cannot run the spec's stages in its schedule's order,
    as torch_pipeline_blocker says it, or None when they can. GPipe's loops run any stages; the
    other schedules' (codegen/loops.py) take stages whose every copy is a `redistribute` or
    `relayout` whose send and receive halves run in different actions: rows, bands or whole on
    each rank, and 2-D stages (their hops inside a group run in the action of its stage). The
    hook of W005 / G001 for a stage they could not take: none today."""
    assert spec.pipeline is not None
    return None  # (2-D stages too: their copies pass through the replicas' first ranks, runtime _by_replicas)


def _check_pipeline(spec: Spec) -> list[Diagnostic]:
    pl = spec.pipeline
    if not pl:
        return []
    diags = []
    stages = spec.placement
    loc = pl.loc
    t, m = spec.training, pl.microbatches
    n = t.accumulate if t.batch_size % t.accumulate == 0 else 1  # (P094 otherwise)
    B = t.batch_size // n  # the rows of one schedule step: accumulate's micro-step
    if len(stages) < 2:
        return [D("P040", "a pipeline needs at least 2 segments (stages)", loc, "split the model into segments")]
    if B % m:
        what = f"batch_size {t.batch_size}" + (f" / accumulate {n} = {B}" if n > 1 else "")
        diags.append(D("P041", f"{what} is not divisible by microbatches {m}",
                       spec.doc.loc(("training", "batch_size")), f"use a multiple of {m * n}"))
    else:
        for seg in stages:
            d = data_degree(seg)
            if (B // m) % d:
                diags.append(D("P042", f"micro-batch of {B // m} is not divisible by the {d} devices of "
                               f"data stage {seg.name!r}", seg.loc, f"make batch_size / microbatches a multiple of {d}"))
    sched = SCHEDULES[pl.schedule]
    layout = sched.layout
    turn = len(stages) // 2 if layout == "v" else None  # a V's two middle stages share a group by design
    for i, (a, b) in enumerate(zip(stages, stages[1:])):
        if set(a.devices) & set(b.devices) and i + 1 != turn:
            diags.append(D("P043", f"pipeline neighbours {a.name!r} and {b.name!r} share device "
                           f"{sorted(set(a.devices) & set(b.devices))[0]!r}", b.loc,
                           "neighbouring stages must be on disjoint devices"))
    groups = []
    for seg in stages:
        if tuple(seg.devices) not in groups:
            groups.append(tuple(seg.devices))
    p, n = len(groups), len(stages)
    for seg in stages:
        for g in groups:
            if set(g) & set(seg.devices) and g != tuple(seg.devices):
                diags.append(D("P044", f"stage {seg.name!r} overlaps the device group {list(g)} of another stage "
                               "without equalling it", seg.loc, "stages that share devices must use the same group"))
                break
    # different data degrees are fine: placer's own loops run them under every schedule (P045 retired)
    own = own_loops_blocker(spec) if torch_pipeline_blocker(spec) else None
    if layout == "single" and n != p:
        diags.append(D("P046", f"schedule {pl.schedule!r} takes one stage per device group, but {n} stages share "
                       f"{p} groups", loc, "use interleaved_1f1b for several stages per device"))
    if layout in ("loop", "v"):
        per = n / p
        if p == n or per != int(per) or (layout == "v" and per != 2):
            want = "exactly 2" if layout == "v" else "the same number (at least 2) of"
            diags.append(D("P047", f"schedule {pl.schedule!r} needs {want} stages on every device group; "
                           f"{n} stages on {p} groups", loc, "place the same number of stages on each group"))
        else:
            order = [groups[sched.owner(i, p)] for i in range(n)]
            for i, (seg, g) in enumerate(zip(stages, order)):
                if tuple(seg.devices) != g:
                    shape = "round-robin" if layout == "loop" else "V-shaped (0,1,..,p-1,p-1,..,0)"
                    diags.append(D("P048", f"stage {i} ({seg.name!r}) is on {list(seg.devices)}; schedule "
                                   f"{pl.schedule!r} expects {list(g)} ({shape} order)", seg.loc,
                                   "reorder the device groups of the stages"))
                    break
    if own:
        diags.append(D("W005", f"{own[1]} cannot run under schedule {pl.schedule!r}: placer generates it "
                       "only as gpipe", stages[own[0]].loc if own[0] is not None else loc, "use schedule gpipe, "
                       "or a one-dimensional split or data parallelism for that stage (placer's own loops run "
                       "those under every schedule)", severity="warning"))
    problem = sched.microbatch_problem(m, n, p)
    if problem:
        diags.append(D("P049", f"schedule {pl.schedule!r} needs {problem[0]}", loc, problem[1]))
    return diags


def _check_names(spec: Spec) -> list[Diagnostic]:
    diags = []
    m = spec.model
    seen: dict[str, Loc] = {}
    for layer in m.layers or ():
        clash = next((n for n in seen if n == layer.name or n.startswith(layer.name + ".")
                      or layer.name.startswith(n + ".")), None)
        if clash:
            diags.append(D("P005", f"layer name {layer.name!r} clashes with layer {clash!r} "
                           f"(line {seen[clash].line})", layer.loc, "give every layer its own name"))
        seen[layer.name] = layer.loc
        if layer.op not in torch_names.NN_MODULES:
            diags.append(D("P050", f"layer {layer.name!r}: op {layer.op!r} is not a torch.nn module",
                           spec.doc.loc(("model", "layers", _raw_index(spec, layer.loc), "op")),
                           name_hint("ops", layer.op, sorted(torch_names.NN_MODULES))))
    if not m.own_loss and m.loss not in torch_names.NN_LOSSES:
        diags.append(D("P051", f"loss {m.loss!r} is not a torch.nn loss", spec.doc.loc(("model", "loss")),
                       name_hint("losses", m.loss, sorted(torch_names.NN_LOSSES))))
    opt = spec.training.optimizer
    if opt.op not in torch_names.OPTIMIZERS:
        diags.append(D("P052", f"optimizer {opt.op!r} is not in torch.optim",
                       spec.doc.loc(("training", "optimizer", "op")),
                       name_hint("optimizers", opt.op, sorted(torch_names.OPTIMIZERS))))
    diags += _check_training(spec)
    named = [(f"inputs.{k}", t) for k, t in m.inputs] or [("input", m.input)]
    for key, t in named + [("target", m.target)]:
        if t.dtype in INT_DTYPES and t.dtype != "bool" and t.high is None:
            diags.append(D("P053", f"model.{key} has dtype {t.dtype} but no 'high'", t.loc,
                           "integer data is drawn in [low, high): set high, e.g. the number of classes"))
    for key, t in named if m.inputs else ():  # rows are cut alike from every input
        if t.shape[0] != "B":
            diags.append(D("P055", f"model.{key} has shape {list(t.shape)}, whose dim 0 is not B", t.loc,
                           "every input of model.inputs has the batch in dim 0 (micro-batches and data "
                           "parallelism cut each one's rows alike): start its shape with B"))
    for path, mod in (("model", m.module), ("training.data", spec.training.data.module)):
        if mod and ".py:" in mod:
            rel = mod.rsplit(":", 1)[0]
            full = os.path.join(os.path.dirname(os.path.abspath(spec.file)), rel)
            if spec.file not in ("<stdin>", "<spec>") and not os.path.isfile(full):
                diags.append(D("P054", f"{path}.module file {rel!r} does not exist (relative to the spec)",
                               spec.doc.loc(tuple(path.split(".")) + ("module",)), f"looked for {full}"))
    return diags


# Schedulers a spec cannot build: they take callables, other schedulers or a metric per step.
SPEC_LESS_SCHEDULERS = {
    "LambdaLR": "takes a Python function", "MultiplicativeLR": "takes a Python function",
    "ChainedScheduler": "takes other schedulers", "SequentialLR": "takes other schedulers",
    "ReduceLROnPlateau": "steps on a validation metric",
}


def _check_training(spec: Spec) -> list[Diagnostic]:
    """P090 / P091: lr_schedule names a scheduler a spec can build; P092: clipping needs the
    gradients of every segment before any step; P096: an option not run yet; P094: the
    micro-steps of accumulate split the batch evenly (P095 retired: a pipeline runs one schedule
    step per micro-step). (Lockstep runs every option: P097 retired.)"""
    t, diags = spec.training, []
    sched = t.lr_schedule
    if sched and sched.op not in torch_names.LR_SCHEDULERS:
        diags.append(D("P090", f"lr_schedule {sched.op!r} is not in torch.optim.lr_scheduler",
                       spec.doc.loc(("training", "lr_schedule", "op")),
                       name_hint("schedulers", sched.op, sorted(set(torch_names.LR_SCHEDULERS) - set(SPEC_LESS_SCHEDULERS)))))
    elif sched and sched.op in SPEC_LESS_SCHEDULERS:
        diags.append(D("P091", f"lr_schedule {sched.op!r} {SPEC_LESS_SCHEDULERS[sched.op]}: a spec cannot build it",
                       spec.doc.loc(("training", "lr_schedule", "op")),
                       "use one that takes plain values: CosineAnnealingLR, StepLR, LinearLR, OneCycleLR, ..."))
    if t.clip_grad_norm is not None:
        for seg in spec.placement:
            if seg.parallel.sync in ("parameter_server", "broadcast"):  # (data's, and a 2-D segment's)
                diags.append(D("P092", f"segment {seg.name!r}: clip_grad_norm needs every gradient before any step, "
                               f"and sync {seg.parallel.sync!r} steps as it syncs", seg.parallel.loc,
                               "use sync allreduce (the default) in this segment, or leave clip_grad_norm out"))
    if t.accumulate > 1 and t.batch_size % t.accumulate:
        diags.append(D("P094", f"batch_size {t.batch_size} is not divisible by accumulate {t.accumulate}",
                       spec.doc.loc(("training", "accumulate")),
                       f"each micro-step takes batch_size / accumulate rows: use a batch_size that is a multiple of "
                       f"{t.accumulate}"))
    for seg in spec.placement:
        why = MODES[seg.mode].recompute_blocker(seg.parallel) if seg.recompute and len(seg.devices) > 1 else None
        if why:
            diags.append(D("P096", f"segment {seg.name!r}: recompute of a {seg.mode} segment is not run by this "
                           f"placer yet: {why}, and recomputing would repeat that in backward",
                           spec.doc.loc(("placement", seg.index, "recompute")),
                           "recompute the one-device or data-parallel segments around it instead"))
    return diags


def _raw_index(spec: Spec, loc: Loc) -> int:
    """Index of the raw (unexpanded) layer entry written at `loc`."""
    for i in range(len(spec.doc.data["model"]["layers"])):
        if spec.doc.loc(("model", "layers", i)) == loc:
            return i
    return 0


def _check_shapes(spec: Spec, groups) -> list[Diagnostic]:
    m = spec.model
    if m.layers is None or any(d.code.startswith("P05") for d in _check_names(spec)):
        return []
    diags = []
    shape = m.input.concrete(spec.training.batch_size)[1:]
    for layer, _, out in shapes.chain(m.layers, shape):
        if isinstance(out, str):
            diags.append(D("P060", f"layer {layer.name!r}: {out}", layer.loc, "fix the layer's arguments so "
                           "shapes chain from model.input"))
            break
    if groups is not None:
        diags += _check_mode_shapes(spec, groups)
    dropout = [l for l in m.layers if shapes.kind(l) == "dropout" and shapes.arg(l, 0, "p", 0.5)]
    if dropout and len(spec.devices) > 1:
        diags.append(D("W003", f"layer {dropout[0].name!r} is a Dropout: random masks differ from a one-device "
                       "run, so run --check cannot match", dropout[0].loc,
                       "set p: 0 to check equivalence, or accept a mismatch in --check", severity="warning"))
    return diags


def _check_mode_shapes(spec: Spec, groups) -> list[Diagnostic]:
    """The mode rules on an inline model's layer shapes (a spatial split's strides)."""
    diags = []
    assert spec.model.layers is not None  # called by _check_shapes for inline models only
    shape = spec.model.input.concrete(spec.training.batch_size)[1:]
    shapes_in = {l.name: s for l, s, _ in shapes.chain(spec.model.layers, shape)}
    for seg in spec.placement:
        seg_layers = [spec.model.layers[i] for i in groups[seg.index]]
        diags += MODES[seg.parallel.mode].check_shapes(seg, seg_layers, shapes_in)
    return diags


def check(spec: Spec) -> list[Diagnostic]:
    """All semantic diagnostics (errors and warnings), in file order."""
    if spec.auto:  # the placement's rules are the search's to meet (placer/search)
        diags = _check_devices(spec) + _check_names(spec) + _check_auto(spec)
        if spec.model.layers is not None and not any(d.severity == "error" for d in diags):
            diags += _check_shapes(spec, None)
        return sorted(diags, key=lambda d: (d.severity != "error", d.loc.line, d.loc.col))
    names = layer_names(spec)
    groups, diags = (resolve_segments(spec, names) if names is not None else (None, []))
    diags += _check_devices(spec) + _check_names(spec) + _check_pipeline(spec)
    diags += _check_modes(spec, groups if not any(d.severity == "error" for d in diags) else None)
    if groups is not None and not any(d.code in ("P001", "P002", "P003", "P004") for d in diags):
        diags += _check_shapes(spec, groups)
    return sorted(diags, key=lambda d: (d.severity != "error", d.loc.line, d.loc.col))


def _check_auto(spec: Spec) -> list[Diagnostic]:
    """P100: with `placement: auto` the search chooses the pipeline too."""
    if spec.pipeline is None:
        return []
    return [D("P100", "'pipeline' is given but the placement is auto", spec.pipeline.loc,
              "the search chooses the stages, schedule and micro-batches: remove 'pipeline', or write the "
              "placement (`placer suggest` writes one to start from)")]


def _check_size(doc: load.Document) -> list[Diagnostic]:
    """Bound `repeat` before expanding it: a few lines must not become a billion layers."""
    layers = doc.data["model"].get("layers") or []
    total = sum(l.get("repeat", 1) for l in layers)
    if total <= MAX_LAYERS:
        return []
    i = max(range(len(layers)), key=lambda i: layers[i].get("repeat", 1))
    return [D("P006", f"the model has {total} layers once repeats are expanded; the limit is {MAX_LAYERS}",
              doc.loc(("model", "layers", i, "repeat")), "use fewer, larger layers (or a model module)")]


def validate_document(doc: load.Document) -> tuple[Spec | None, list[Diagnostic]]:
    """Schema, then semantic checks; the Spec is None when the shape is wrong."""
    shape = schema.check_shape(doc)
    if shape:
        return None, shape
    too_big = _check_size(doc)
    if too_big:
        return None, too_big
    spec = from_document(doc)
    return spec, check(spec)


def load_spec(path: str, overrides=()) -> Spec:
    """Load a spec (with `--set KEY=VALUE` overrides) and fully check it; raise SpecError on any error."""
    return load_checked(path, overrides)[0]


def load_checked(path: str, overrides=()) -> tuple[Spec, list[Diagnostic]]:
    """(spec, its warnings) for `load_spec`: every command that acts on a spec shows these."""
    spec, diags = validate_document(load.load_file(path, overrides))
    return _checked(spec, diags), [d for d in diags if d.severity != "error"]


def load_spec_text(text: str, file: str = "<spec>") -> Spec:
    """`load_spec` for spec text (`file` names it, and relative model paths start from its folder)."""
    return _checked(*validate_document(load.load_text(text, file)))


def _checked(spec: Spec | None, diags: list[Diagnostic]) -> Spec:
    errors = [d for d in diags if d.severity == "error"]
    if errors:
        raise SpecError(errors)
    assert spec is not None  # validate_document gives no Spec only with errors
    return spec
