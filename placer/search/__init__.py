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
from dataclasses import dataclass

from placer import units
from placer.diagnostics import Diagnostic, Loc, PlacerError, PlanError
from placer.estimate.capacity import Shortfall, memory_caps, shortfalls
from placer.search.space import Candidate, as_spec, candidates, cut, model_graph, plan_size, quick_bound, selectors
from placer.search.write import placement_yaml, relocate, spec_text
from placer.spec.types import Spec

__all__ = ["Candidate", "Suggestion", "cut", "model_graph", "placement_yaml", "relocate", "resolve", "selectors",
           "spec_text", "suggest"]
FULL = 48
"""Candidates that fit scored by the step-time model: the rest, slower by the quick bound
(`quick_bound`), are left out (a large space: 64 devices, 96 layers)."""
BUDGET = 100_000
"""Of the candidates scored, their devices times micro-batches in all (what lowering and replaying
them costs, `plan_size`); past it, once one fits, only candidates that still fit in it are scored."""
KEEP = 20
"""Candidates kept in a Suggestion (the best first); `--format json` lists them."""


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
    quick = [quick_bound(c, graph, hw, caps, slots) for c in cands]
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
        if fits and spent + plan_size(c) > BUDGET:  # its op lists alone would take the rest of the budget
            continue
        spent += plan_size(c)
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
