"""The placement search: `placement: auto` and `placer suggest`.

The model is built once; each candidate is a placement made as a Spec would write it, then
placed, lowered and estimated by the same stages `placer plan` runs (plan/place.py,
plan/lower.py, estimate/cost.py), pruned by memory first (a stated `memory` is a hard bound)
and scored by the step-time model (estimate/steptime.py) on each device's own hardware.

What is searched, in this order (the order also breaks ties, simpler first):
- which devices: the first k of the listed devices for k = 1, 2, 4, ... and all of them (and for
  k = 1, the first device of each hardware kind);
- stages: k devices as p contiguous groups of k / p devices each;
- layers to stages: contiguous ranges, cut by a dynamic programme over the ranges that minimises
  the slowest stage's predicted compute (each layer's FLOPs at its stage's hardware rates, over
  the group's degree) under the stated memory, and the one that minimises the largest stage's
  memory;
- per stage (all stages alike): one device; `data` with `shard: none`, `optimizer` or `full`;
  `tensor`, and `tensor` with `data: D` (tensor x data), where the stage's layers pair;
- with p >= 2: the stages one after the other (no pipeline), or a pipeline `gpipe` / `1f1b` with
  p, 2p or 4p micro-batches that divide the batch;
- recompute of every stage, where the plan does not fit without it (it only adds work).
Not searched yet: `channel`, `spatial`, data `sync: parameter_server` / `broadcast`, interleaved
and zero-bubble schedules, stages of different modes or degrees.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from placer import units
from placer.diagnostics import Diagnostic, Loc, PlacerError, PlanError
from placer.estimate.capacity import Shortfall, memory_caps, shortfalls
from placer.spec.types import Parallel, Pipeline, Segment, Selector, Spec

SCHEDULES = ("gpipe", "1f1b")
FULL = 48
"""Candidates that fit scored by the step-time model: the rest, slower by the quick bound
(`_quick`), are left out (a large space: 64 devices, 96 layers)."""
BUDGET = 100_000
"""Of the candidates scored, their devices times micro-batches in all (what lowering and replaying
them costs, `_size`); past it, once one fits, only candidates that still fit in it are scored."""
KEEP = 20
"""Candidates kept in a Suggestion (the best first); `--format json` lists them."""


@dataclass(frozen=True)
class Stage:
    """One stage of a candidate: its layers, devices and mode, as a segment writes them."""
    layers: tuple[str, ...]
    devices: tuple[str, ...]
    mode: str = "none"
    options: tuple = ()
    """(key, value) pairs of the mode's options: shard, data."""
    recompute: bool = False

    def describe(self) -> str:
        what = self.mode if self.mode != "none" else "one device"
        return what + "".join(f" {k}={v}" for k, v in self.options) + (" recompute" if self.recompute else "")


@dataclass(frozen=True)
class Candidate:
    stages: tuple[Stage, ...]
    schedule: str | None = None
    microbatches: int | None = None
    step_s: float = 0.0
    memory: dict = field(default_factory=dict, compare=False)
    """device -> estimated peak bytes."""
    critical: str = ""
    bound: str = ""
    """What bounds the step, in words."""

    def describe(self) -> str:
        """A short line: devices, stages, modes, pipeline."""
        n = len({d for s in self.stages for d in s.devices})
        modes = sorted({s.describe() for s in self.stages})
        sizes = f" ({'+'.join(str(len(s.layers)) for s in self.stages)} layers)" if len(self.stages) > 1 else ""
        text = f"{units.count(n, 'device')}, {units.count(len(self.stages), 'stage')}{sizes}, {' / '.join(modes)}"
        return text + (f", {self.schedule} x{self.microbatches}" if self.schedule else "")

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "critical": self.critical, "bound": self.bound,
                "pipeline": {"schedule": self.schedule, "microbatches": self.microbatches} if self.schedule else None,
                "memory": dict(self.memory),
                "stages": [{"layers": list(s.layers), "devices": list(s.devices), "mode": s.mode,
                            "options": dict(s.options), "recompute": s.recompute} for s in self.stages]}


@dataclass
class Suggestion:
    best: Candidate
    kept: list[Candidate]
    """The best candidates that fit, fastest first (`best` is the first)."""
    spec: Spec
    """The spec with the best placement, loaded and checked."""
    text: str
    """Its YAML, with a comment header saying why."""
    caps: dict
    hardware: dict
    """device -> the hardware profile's name it was scored on."""
    evaluated: int = 0
    pruned: int = 0
    """Candidates over a stated memory."""
    seconds: float = 0.0


def _hardware(spec: Spec, default: str) -> dict[str, str]:
    return {d.name: d.hardware or default for d in spec.device_specs}


def _profiles(names: dict[str, str], workers: int):
    from placer.estimate import hardware as hw

    made = {n: hw.profile(n, workers) for n in sorted(set(names.values()))}  # one object per profile
    return {d: made[n] for d, n in names.items()}


def model_graph(spec: Spec, say=lambda msg: None):
    """The spec's ModelGraph at the depth the search places: a module model's children, opened
    while one holds more than half of the parameters (`transformer` into `wte`, `h.0`, ...)."""
    from placer.model.build import build_graph, build_module

    if spec.model.inline:
        return build_graph(spec)
    module = build_module(spec)
    opened: list[str] = []
    while True:
        graph = build_graph(_one_segment(spec, opened), module)
        top = max(graph.layers, key=lambda l: l.params)
        inside = [n for n, _ in module.get_submodule(top.name).named_children()]
        if 2 * top.params <= graph.total_params or not inside or len(opened) > 8:
            say(f"placing {len(graph.layers)} layers of {spec.model.module}")
            return graph
        opened.append(top.name + ".*")


def _one_segment(spec: Spec, selectors: list[str]) -> Spec:
    seg = Segment(index=0, name="all", selectors=tuple(Selector(text=t) for t in selectors),
                  devices=spec.devices[:1], parallel=Parallel())
    return dataclasses.replace(spec, placement=(seg,), auto=False)


def selectors(layers: tuple[str, ...], inline: bool = False) -> list[str]:
    """A stage's layers as one range (inline layers), or as ranges of siblings (`h.0..h.3`, `ln_f`):
    the selectors that open a module model to the same depth as the search's graph."""
    if inline:
        return [layers[0] if len(layers) == 1 else f"{layers[0]}..{layers[-1]}"]
    runs: list[list[str]] = []
    for name in layers:
        if runs and runs[-1][0].rpartition(".")[0] == name.rpartition(".")[0]:
            runs[-1].append(name)
        else:
            runs.append([name])
    return [r[0] if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs]


def as_spec(spec: Spec, c: Candidate) -> Spec:
    """The candidate as a Spec (no locations of its own: it was not written)."""
    segs = []
    for i, s in enumerate(c.stages):
        opts = dict(s.options)
        mode = s.mode
        segs.append(Segment(index=i, name=f"s{i}", selectors=tuple(Selector(text=t) for t in selectors(s.layers, spec.model.inline)),
                            devices=s.devices, recompute=s.recompute,
                            parallel=Parallel(mode=mode, **opts)))
    pipe = Pipeline(microbatches=c.microbatches or 1, schedule=c.schedule) if c.schedule else None
    return dataclasses.replace(spec, placement=tuple(segs), pipeline=pipe, auto=False)


# -- the candidates ----------------------------------------------------------------------------------

def _device_sets(spec: Spec, hardware: dict[str, str], caps: dict) -> list[tuple[str, ...]]:
    devs = spec.devices
    sizes = sorted({k for k in (2 ** i for i in range(len(devs).bit_length())) if k <= len(devs)} | {len(devs)})
    kinds = {d: (hardware[d], caps.get(d)) for d in devs}
    firsts = [d for i, d in enumerate(devs) if kinds[d] not in [kinds[e] for e in devs[:i]]]
    out = [(d,) for d in firsts] + [devs[:k] for k in sizes if k > 1]
    return list(dict.fromkeys(out))


def _modes(g: int) -> list[tuple[str, tuple]]:
    if g == 1:
        return [("none", ())]
    out: list[tuple[str, tuple]] = [("data", ()), ("data", (("shard", "optimizer"),)), ("data", (("shard", "full"),)), ("tensor", ())]
    out += [("tensor", (("data", d),)) for d in range(2, g) if g % d == 0]
    return out


def _pipelines(p: int, rows: int, degree: int) -> list[tuple[str | None, int | None]]:
    if p == 1:
        return [(None, None)]
    out: list[tuple[str | None, int | None]] = [(None, None)]
    for m in (p, 2 * p, 4 * p):
        if rows % m == 0 and (rows // m) % degree == 0:
            out += [(s, m) for s in SCHEDULES]
    return out


def _layer_costs(graph, hw, degree: int, slots: int) -> tuple[list[float], list[float]]:
    """Per layer: seconds of its forward and backward at `hw`'s rates over the group's degree, and
    about the bytes a stage holds for it (parameters, gradients, optimizer state and DDP's bucket
    copy, its kept activations): the dynamic programme's costs; the estimate decides."""
    from placer.estimate.hardware import CONV_OPS, rate

    secs, mem = [], []
    for layer in graph.layers:
        f = layer.flops / degree
        conv = layer.op in CONV_OPS
        t = (f / rate(hw, f, conv=conv) + 2 * f / rate(hw, f, backward=True, conv=conv)) if f else 0.0
        secs.append(t + 3 * hw.layer_overhead)
        mem.append(layer.param_bytes * (3 + slots) + layer.saved_bytes / degree)
    return secs, mem


def cut(n: int, p: int, cost: Callable[[int, int, int], float]) -> list[int] | None:
    """Where to cut n layers into p contiguous non-empty ranges so that the costliest range is least
    (a dynamic programme over ranges; `cost(k, i, j)`: layers [i, j) as stage k, inf where they
    do not fit it): the first layer of each stage after the first; None when nothing fits."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(p + 1)]  # best[k][j]: layers [0, j) in k stages
    back = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], cost(k - 1, i, j))
                if v < best[k][j] - 1e-15:
                    best[k][j], back[k][j] = v, i
    if best[p][n] == inf:
        return None
    cuts, j = [], n
    for k in range(p, 0, -1):
        j = back[k][j]
        cuts.append(j)
    return sorted(cuts)[1:]


def _splits(graph, groups, hw, caps, slots: int) -> list[tuple[tuple[str, ...], ...]]:
    """The layers cut into len(groups) stages: the cut that makes the slowest stage fastest among
    those that fit each group's memory, and the one that fills the fullest group least."""
    names, n, p = graph.names, len(graph.layers), len(groups)
    g = len(groups[0])
    costs = [_layer_costs(graph, hw[gr[0]], g, slots) for gr in groups]
    pre = [[[0.0] + list(_cumsum(c)) for c in pair] for pair in costs]  # [stage][secs|mem][j]
    room = [min((caps[d] for d in gr if d in caps), default=float("inf")) for gr in groups]
    scale = max((r for r in room if r != float("inf")), default=1.0)

    def held(k, i, j):
        return pre[k][1][j] - pre[k][1][i]

    def slowest(k, i, j):
        return pre[k][0][j] - pre[k][0][i] if held(k, i, j) <= room[k] else float("inf")

    def fullest(k, i, j):
        return held(k, i, j) / (room[k] if room[k] != float("inf") else scale * 1e3)

    out = []
    for cost in (slowest, fullest):
        cuts = cut(n, p, cost)
        if cuts is not None:
            edges = [0, *cuts, n]
            out.append(tuple(tuple(names[a:b]) for a, b in zip(edges, edges[1:])))
    return list(dict.fromkeys(out))


def _cumsum(xs):
    total = 0.0
    for x in xs:
        total += x
        yield total


def candidates(spec: Spec, graph, kinds: dict[str, str], hw, caps: dict) -> list[Candidate]:
    """Every placement the search scores, unscored, in its (deterministic) order."""
    from placer.estimate.memory import state_slots

    slots = state_slots(spec.training.optimizer)[0]
    t = spec.training
    rows = t.batch_size // t.accumulate if t.batch_size % t.accumulate == 0 else t.batch_size
    out = []
    for devs in _device_sets(spec, kinds, caps):
        k = len(devs)
        for p in (p for p in range(1, k + 1) if k % p == 0 and p <= len(graph.layers)):
            g = k // p
            groups = [devs[i * g:(i + 1) * g] for i in range(p)]
            for split in _splits(graph, groups, hw, caps, slots):
                for mode, opts in _modes(g):
                    degree = g if mode == "data" else dict(opts).get("data", 1)
                    if rows % degree:
                        continue
                    for schedule, m in _pipelines(p, rows, degree):
                        stages = tuple(Stage(layers=ls, devices=gr, mode=mode, options=opts)
                                       for ls, gr in zip(split, groups))
                        out.append(Candidate(stages=stages, schedule=schedule, microbatches=m))
    return out


def _size(c: Candidate) -> int:
    """About how many ops its plan holds: each device's actions grow with the micro-batches, and a
    tensor-parallel stage's all-reduces with its layers."""
    return sum(len(s.devices) * (1 + len(s.layers) if s.mode == "tensor" else 1) for s in c.stages) * (c.microbatches or 1)


def _quick(c: Candidate, graph, hw, caps: dict, slots: int) -> tuple[bool, float]:
    """(whether it seems to exceed a stated memory, a rough step time): each stage's compute at its
    hardware's rates over its degree, plus data parallelism's gradient all-reduce or tensor
    parallelism's activation all-reduces at the link's bandwidth; stages one after the other,
    or a pipeline's (m + p - 1) micro-batch slots of its slowest stage. It orders the candidates
    for the step-time model, which decides."""
    index = {n: i for i, n in enumerate(graph.names)}
    times, over = [], False
    for s in c.stages:
        g, h = len(s.devices), hw[s.devices[0]]
        deg = g if s.mode != "none" else 1
        secs, mem = _layer_costs(graph, h, deg, slots)
        ids = [index[n] for n in s.layers]
        t = sum(secs[i] for i in ids)
        params = sum(graph.layers[i].param_bytes for i in ids)
        opts = dict(s.options)
        if s.mode == "data":
            t += 2 * params * (g - 1) / g / h.link_bw * (1.5 if opts.get("shard") == "full" else 1)
        elif s.mode == "tensor":
            d = opts.get("data", 1)
            t += 4 * sum(graph.layers[i].out_bytes for i in ids) / d / h.link_bw + 2 * params / g / h.link_bw
        held = sum(mem[i] for i in ids)
        if s.mode == "data" and opts.get("shard") in ("optimizer", "full"):
            held -= sum(graph.layers[i].param_bytes for i in ids) * slots * (g - 1) / g
        over |= any(held > caps[d] for d in s.devices if d in caps)
        times.append(t)
    if c.schedule:
        m, p = c.microbatches or 1, len(c.stages)
        return over, (m + p - 1) * max(times) / m + m * p * hw[c.stages[0].devices[0]].action_s
    return over, sum(times)


# -- scoring -----------------------------------------------------------------------------------------

def _score(spec: Spec, graph, c: Candidate, hw, default_hw, caps) -> tuple[Candidate | None, list[Shortfall]]:
    """(the scored candidate, []) when it fits; (None, its shortfalls) when it exceeds a stated
    memory; (None, []) when the spec's rules or the planner refuse it."""
    from placer.estimate.cost import estimate
    from placer.estimate.steptime import step_time
    from placer.plan.lower import lower
    from placer.plan.place import layer_geometry, place
    from placer.spec.check import check

    s = as_spec(spec, c)
    if spec.model.inline and any(d.severity == "error" for d in check(s)):
        return None, []
    try:
        plan = lower(place(s, graph), s, graph, each=False)
        est = estimate(plan, graph, s.training.optimizer, s.training.prefetch, lambda n: layer_geometry(s, n))
    except (PlacerError, ValueError, AssertionError):
        return None, []
    short = shortfalls(est, caps)
    if short:
        return None, short
    try:
        st = step_time(plan, graph, est, default_hw, {d: hw[d] for d in plan.devices if hw[d] is not default_hw})
    except ValueError:
        return None, []
    t = st.per_device[st.critical]
    stage = next(i for i, g in enumerate(c.stages) if st.critical in g.devices)
    bound = (f"{st.critical} (stage s{stage}) finishes last: compute {units.seconds(t.compute_s)}, "
             f"communication {units.seconds(t.comm_s)} exposed, optimizer {units.seconds(t.step_s)}")
    return dataclasses.replace(c, step_s=st.step_s, critical=st.critical, bound=bound,
                               memory={d: e.total_bytes for d, e in est.per_device.items()}), []


def suggest(spec: Spec, hardware: str = "cpu", say: Callable[[str], None] = lambda msg: None,
            graph=None) -> Suggestion:
    """The fastest placement whose estimate fits every stated memory, as a Suggestion. PlanError:
    A001 when none fits (naming the smallest shortfall), A002 when the search finds no plan."""
    from placer.estimate.memory import state_slots

    t0 = time.perf_counter()
    graph = graph if graph is not None else model_graph(spec, say)
    names = _hardware(spec, hardware)
    if "cpu" in names.values():
        from placer.estimate import hardware as hw_profiles

        if not hw_profiles.is_cached(len(spec.devices)):
            say("measuring this machine's CPU for the cost model (once; cached) ...")
    hw = _profiles(names, len(spec.devices))
    default_hw = hw[spec.devices[0]]
    caps = memory_caps(spec)
    cands = candidates(spec, graph, names, hw, caps)
    say(f"scoring {len(cands)} candidate placements over {units.count(len(spec.devices), 'device')} ...")
    fits: list[Candidate] = []
    closest: tuple[int, Candidate, list[Shortfall]] | None = None
    pruned = 0
    slots = state_slots(spec.training.optimizer)[0]
    quick = [_quick(c, graph, hw, caps, slots) for c in cands]
    order = sorted(range(len(cands)), key=lambda i: (quick[i], i))
    firsts: dict[tuple, int] = {}  # the quick bound's best of each shape first: it errs by mode and shape
    for i in order:
        c = cands[i]
        firsts.setdefault((len(c.stages), c.stages[0].devices, c.stages[0].mode, c.stages[0].options), i)
    lead = set(firsts.values())
    order = list(firsts.values()) + [i for i in order if i not in lead]
    spent = 0
    for c in (cands[i] for i in order):
        if len(fits) >= FULL:  # the rest are slower by the quick bound (what a large space needs)
            break
        if fits and spent + _size(c) > BUDGET:  # its op lists alone would take the rest of the budget
            continue
        spent += _size(c)
        scored, short = _score(spec, graph, c, hw, default_hw, caps)
        if short:  # recompute only adds work: it is tried where a plan does not fit without it
            c = dataclasses.replace(c, stages=tuple(dataclasses.replace(s, recompute=True) for s in c.stages))
            scored, short = _score(spec, graph, c, hw, default_hw, caps)
        if scored is not None:
            fits.append(scored)
        elif short:
            pruned += 1
            if closest is None or short[0].over < closest[0]:
                closest = (short[0].over, c, short)
    if not fits:
        raise PlanError(_none_fits(spec, closest) if closest else Diagnostic(
            "A002", "the search found no placement the planner accepts", spec.doc.loc(("placement",)),
            "write the placement by hand (docs/spec.md); `placer plan` then says what it refuses"))
    order = sorted(range(len(fits)), key=lambda i: (round(fits[i].step_s, 9), i))
    ranked = [fits[i] for i in order]
    for c in ranked[:KEEP]:  # the first that the whole of validate (--deep for a module) accepts
        try:
            text = spec_text(spec, c, ranked, names, caps)
            resolved = _checked(text, spec)
        except PlacerError:
            continue
        kept = [c] + [o for o in ranked[:KEEP] if o is not c]
        return Suggestion(best=c, kept=kept, spec=resolved, text=text, caps=caps, hardware=names,
                          evaluated=len(cands), pruned=pruned, seconds=time.perf_counter() - t0)
    raise PlanError(Diagnostic("A002", f"none of the {min(KEEP, len(ranked))} fastest placements passes validate --deep",
                               spec.doc.loc(("placement",)), "write the placement by hand (docs/spec.md)"))


def _checked(text: str, spec: Spec) -> Spec:
    from placer.model.build import checked_graph
    from placer.spec.check import load_spec_text

    resolved = load_spec_text(text, spec.file)
    if not resolved.model.inline:
        checked_graph(resolved)
    return resolved


def _none_fits(spec: Spec, closest: tuple[int, Candidate, list[Shortfall]]) -> Diagnostic:
    over, c, short = closest
    s = short[0]
    loc = next((d.loc for d in spec.device_specs if d.name == s.device), Loc(spec.file))
    more = [f"{d.device} by {units.size(d.over)}" for d in short[1:]]
    return Diagnostic(
        "A001", f"no placement fits the stated memory: the closest ({c.describe()}) needs {units.size(s.need)} "
        f"on {s.device}, {units.size(over)} over its {units.size(s.memory)}"
        + (f" (and {', '.join(more)})" if more else ""), loc,
        f"give {s.device} at least {units.size(s.need)}, list more devices, or make the step smaller "
        f"(training.batch_size {spec.training.batch_size} lower, or training.accumulate higher); the search "
        "already tried sharding (shard: full) and recompute")


# -- the spec it writes ------------------------------------------------------------------------------

def placement_yaml(c: Candidate, inline: bool) -> str:
    """The `placement:` (and `pipeline:`) lines of a candidate, one flow mapping per segment."""
    lines = ["placement:"]
    for i, s in enumerate(c.stages):
        sel = selectors(s.layers, inline)
        parts = [f"name: s{i}", "layers: " + (sel[0] if len(sel) == 1 else "[" + ", ".join(sel) + "]")]
        parts.append(f"device: {s.devices[0]}" if len(s.devices) == 1 else f"devices: [{', '.join(s.devices)}]")
        if s.mode != "none":
            opts = "".join(f", {k}: {v}" for k, v in s.options)
            parts.append(f"parallel: {{mode: {s.mode}{opts}}}" if opts else f"parallel: {s.mode}")
        if s.recompute:
            parts.append("recompute: true")
        lines.append("  - {" + ", ".join(parts) + "}")
    if c.schedule:
        lines.append(f"pipeline: {{microbatches: {c.microbatches}, schedule: {c.schedule}}}")
    return "\n".join(lines) + "\n"


def header(spec: Spec, c: Candidate, ranked: list[Candidate], hardware: dict, caps: dict) -> str:
    """The comment that says why: predicted step, memory against capacity, the bound, the runners-up."""
    hw = sorted(set(hardware[d] for s in c.stages for d in s.devices))
    lines = [f"placement suggested by `placer suggest` (hardware {', '.join(hw)}):",
             f"  predicted step time {units.seconds(c.step_s)}; {c.bound}", "  memory per device (estimate / capacity):"]
    used = {d for s in c.stages for d in s.devices}
    for d, b in c.memory.items():
        lines.append(f"    {d}: {units.size(b)} / " + (units.size(caps[d]) if d in caps else "no limit stated")
                     + ("" if d in used else " (runs nothing)"))
    others = [o for o in ranked if o is not c][:4]
    if others:
        lines.append("  next best:")
        w = max(len(o.describe()) for o in others)
        for o in others:
            peak = max(o.memory.values())
            lines.append(f"    {o.describe().ljust(w)}  {units.seconds(o.step_s):>9}  peak {units.size(peak)}")
    return "".join(f"# {line}".rstrip() + "\n" for line in lines) + "#\n"


def spec_text(spec: Spec, c: Candidate, ranked: list[Candidate], hardware: dict, caps: dict) -> str:
    """The user's spec with the candidate's placement in place of `placement: auto` (or where it
    was missing), their comments kept; the data dumped anew where --set changed it."""
    import yaml

    from placer.spec.load import load_text

    body = None
    try:
        with open(spec.file, encoding="utf-8") as f:
            raw = f.read()
        if load_text(raw, spec.file).data == spec.doc.data:
            body = _splice(raw, spec, placement_yaml(c, spec.model.inline))
    except (OSError, PlacerError):
        pass
    if body is None:  # stdin, or changed by --set: the data as loaded
        data = {k: v for k, v in spec.doc.data.items() if k not in ("placement", "pipeline")}
        body = yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100) + placement_yaml(c, spec.model.inline)
    top = header(spec, c, ranked, hardware, caps)
    first, _, rest = body.partition("\n")
    if first.startswith("# yaml-language-server"):
        return f"{first}\n{top}{rest}"
    return top + body


def relocate(text: str, spec: Spec, out_dir: str) -> str:
    """The spec text to be written into `out_dir`: its model and data files, relative to the spec's
    folder, named relative to `out_dir` instead."""
    import os

    here = os.path.dirname(os.path.abspath(spec.file))
    for ref in (spec.model.module, spec.training.data.module):
        if ref and ".py:" in ref and not os.path.isabs(ref.rsplit(":", 1)[0]):
            path, _, attr = ref.rpartition(":")
            moved = os.path.relpath(os.path.join(here, path), os.path.abspath(out_dir))
            text = text.replace(f"module: {ref}", f"module: {moved}:{attr}")
    return text


def _splice(raw: str, spec: Spec, block: str) -> str:
    lines = raw.splitlines(keepends=True)
    if "placement" in spec.doc.data:  # `placement: auto`, a scalar on its key's line
        at = spec.doc.key_loc(("placement",)).line - 1
        del lines[at]
    else:
        at = spec.doc.key_loc(("training",)).line - 1
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return "".join(lines[:at]) + block + "".join(lines[at:])


def resolve(spec: Spec, say: Callable[[str], None] = lambda msg: None,
            hardware: str = "cpu") -> tuple[Spec, str | None]:
    """(`spec`, None), or with `placement: auto` (the spec with the placement the search chose,
    its text): plan, generate and run call this, and say what it chose."""
    if not spec.auto:
        return spec, None
    s = suggest(spec, hardware, say)
    say(f"placement auto: chose {s.best.describe()}, predicted {units.seconds(s.best.step_s)} a step on "
        f"{', '.join(sorted(set(s.hardware.values())))} ({s.evaluated} candidates scored in {s.seconds:.1f} s; "
        "`placer suggest -o FILE` writes it as a spec):")
    for line in placement_yaml(s.best, spec.model.inline).splitlines():
        say(f"  {line}")
    return s.spec, s.text
