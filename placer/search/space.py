"""The search's space: the candidates (placements as a spec writes them), the dynamic programme
that cuts the layers into stages, and the quick bound that orders them (placer/search)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from placer import units
from placer.modes import MODES
from placer.spec.types import Parallel, Pipeline, Segment, Selector, Spec

SCHEDULES = ("gpipe", "1f1b")


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


def model_graph(spec: Spec, say=lambda msg: None):
    """The spec's ModelGraph at the depth the search places: a module model's children, opened
    while one holds more than half of the parameters (`transformer` into `wte`, `h.0`, ...)."""
    from placer.model.build import build_graph, build_module

    if spec.model.inline:
        return build_graph(spec)
    module = build_module(spec)
    opened: list[str] = []
    while True:
        graph = build_graph(one_segment(spec, opened), module)
        top = max(graph.layers, key=lambda l: l.params)
        inside = [n for n, _ in module.get_submodule(top.name).named_children()]
        if 2 * top.params <= graph.total_params or not inside or len(opened) > 8:
            say(f"placing {len(graph.layers)} layers of {spec.model.module}")
            return graph
        opened.append(top.name + ".*")


def one_segment(spec: Spec, selectors: list[str]) -> Spec:
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
                    degree = MODES[mode].data_degree(g, dict(opts).get("data", 1))
                    if rows % degree:
                        continue
                    for schedule, m in _pipelines(p, rows, degree):
                        stages = tuple(Stage(layers=ls, devices=gr, mode=mode, options=opts)
                                       for ls, gr in zip(split, groups))
                        out.append(Candidate(stages=stages, schedule=schedule, microbatches=m))
    return out


def plan_size(c: Candidate) -> int:
    """About how many ops its plan holds: each device's actions grow with the micro-batches, and a
    tensor-parallel stage's all-reduces with its layers."""
    return sum(len(s.devices) * (1 + len(s.layers) if MODES[s.mode].forward_sends_activations else 1)
               for s in c.stages) * (c.microbatches or 1)


def quick_bound(c: Candidate, graph, hw, caps: dict, slots: int) -> tuple[bool, float]:
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
        mode = MODES[s.mode]
        t += mode.rough_sync_bytes(params, sum(graph.layers[i].out_bytes for i in ids), g, opts) / h.link_bw
        held = sum(mem[i] for i in ids) - params * slots * (1 - mode.state_share(g, opts))
        over |= any(held > caps[d] for d in s.devices if d in caps)
        times.append(t)
    if c.schedule:
        m, p = c.microbatches or 1, len(c.stages)
        return over, (m + p - 1) * max(times) / m + m * p * hw[c.stages[0].devices[0]].action_s
    return over, sum(times)
