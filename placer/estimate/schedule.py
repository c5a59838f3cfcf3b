"""Pipeline schedule simulation: when each device group computes which micro-batch.

Each device group (a pipeline rank; the devices of a `data` stage share one
timeline) executes its actions in the order the schedule gives, the order
`torch.distributed.pipelining` runs them. An action starts when its group is
free and its input is ready: a forward needs the previous stage's forward of
the same micro-batch, a backward the next stage's backward (the last stage's
the loss, i.e. its own forward), a weight-gradient step (`W`) its own
input-gradient step (`I`). Idle time over (groups x makespan) is the bubble.

The orders and the action kinds (F forward, B full backward, I input gradient,
W weight gradient) are the plan's: `placer.plan.schedules`, from torch's own generators.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from placer.diagnostics import Diagnostic, PlanError
from placer.plan.schedules import SCHEDULES, Action, action_orders

_EPS = 1e-9


@dataclass(frozen=True)
class Slot:
    """A span of one device's timeline: an action, or `idle` (stage and microbatch None)."""

    start: float
    end: float
    kind: str
    stage: int | None = None
    microbatch: int | None = None

    @property
    def label(self) -> str:
        return "" if self.kind == "idle" else f"{self.kind}{self.microbatch}"


@dataclass(frozen=True, kw_only=True)
class Timeline:
    schedule: str
    microbatches: int
    stage_groups: tuple[int, ...]
    """Stage -> index of its device group."""
    groups: tuple[tuple[str, ...], ...]
    """Devices of each group (a group is one pipeline rank)."""
    slots: tuple[tuple[Slot, ...], ...]
    """Per group: actions and idle gaps from 0 to the makespan, in time order."""
    makespan: float
    bubble: float
    """Idle time / (groups x makespan)."""
    textbook: float
    """(p-1)/(v*m+p-1) for p groups, v stages per group, m micro-batches."""
    unit: str = "unit"
    """What times are measured in: unit (forward of a stage = 1), flop or s."""

    @property
    def per_device(self) -> dict[str, tuple[Slot, ...]]:
        """Device -> its timeline (every device of a group runs the same one)."""
        return {d: self.slots[g] for g, devs in enumerate(self.groups) for d in devs}


def textbook_bubble(p: int, m: int, v: int = 1) -> float:
    """The textbook bubble fraction (p-1)/(v*m+p-1) (GPipe paper; Megatron for v > 1)."""
    return (p - 1) / (v * m + p - 1)


# ---- simulation ------------------------------------------------------------------------------------

def _fail(msg: str, hint: str, code: str = "R010") -> PlanError:
    return PlanError(Diagnostic(code, msg, hint=hint))


def _per_stage(values, n: int, default, what: str) -> list[float]:
    if values is None:
        return list(default)
    if isinstance(values, (int, float)):
        return [float(values)] * n
    if len(values) != n:
        raise _fail(f"{len(values)} {what} times for {n} stages", f"give one {what} time per stage")
    return [float(x) for x in values]


def simulate(schedule: str, stage_groups: Sequence[int], microbatches: int, *,
             fwd: Sequence[float] | float | None = None, bwd: Sequence[float] | float | None = None,
             wgt: Sequence[float] | float | None = None, transfer: Sequence[float] | float = 0.0,
             groups: Sequence[Sequence[str]] | None = None, unit: str = "unit") -> Timeline:
    """Simulate one step of `schedule` with list scheduling.

    stage_groups[s] is the device group of stage s; fwd/bwd/wgt are per-stage
    times of one micro-batch (default F = 1, B = 2F, W = B/2 of it, I = B - W);
    transfer[s] is added when stage s+1's forward (or stage s's backward)
    waits for another group. groups names the devices of each group.
    """
    if schedule not in SCHEDULES:
        raise _fail(f"unknown pipeline schedule {schedule!r}", "schedules are " + ", ".join(SCHEDULES))
    n, m = len(stage_groups), microbatches
    p = max(stage_groups) + 1 if n else 0
    if n < 1 or m < 1:
        raise _fail(f"cannot simulate {n} stages with {m} micro-batches", "give at least one of each")
    if list(stage_groups) != SCHEDULES[schedule].stage_groups(p, n):
        raise _fail(f"schedule {schedule!r} cannot run stages on groups {list(stage_groups)}",
                    "gpipe/1f1b: one stage per group; interleaved/looped: stage s on group s % p; "
                    "zbv/dualpipev: two stages per group in V order")
    f = _per_stage(fwd, n, [1.0] * n, "forward")
    b = _per_stage(bwd, n, [2 * x for x in f], "backward")
    w = _per_stage(wgt, n, [x / 2 for x in b], "weight-gradient")
    t = [float(transfer)] * n if isinstance(transfer, (int, float)) else [float(x) for x in transfer] + [0.0]
    dur = {"F": f, "B": b, "I": [x - y for x, y in zip(b, w)], "W": w}

    orders = action_orders(schedule, p, n, m)
    done: dict[tuple[str, int, int], float] = {}  # (F | G (input grad) | I, stage, mb) -> end time

    def ready(a: Action) -> float | None:
        """When `a`'s input is ready (transfers included), or None if it is not yet computed."""
        s, i = a.stage, a.microbatch
        if a.kind == "F":
            deps = [("F", s - 1, i, s - 1)] if s else []
        elif a.kind == "W":
            deps = [("I", s, i, s)]
        else:
            deps = [("F", s, i, s)] + ([("G", s + 1, i, s)] if s < n - 1 else [])
        at = 0.0
        for kind, ds, di, boundary in deps:
            if (kind, ds, di) not in done:
                return None
            hop = t[boundary] if stage_groups[ds] != stage_groups[s] else 0.0
            at = max(at, done[(kind, ds, di)] + hop)
        return at

    busy: list[list[Slot]] = [[] for _ in range(p)]
    free, nxt = [0.0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for g in range(p):
            while nxt[g] < len(orders[g]):
                a = orders[g][nxt[g]]
                at = ready(a)
                if at is None:
                    break
                start = max(free[g], at)
                end = start + dur[a.kind][a.stage]
                busy[g].append(Slot(start, end, a.kind, a.stage, a.microbatch))
                done[({"B": "G", "I": "G"}.get(a.kind, a.kind), a.stage, a.microbatch)] = end
                if a.kind == "I":
                    done[("I", a.stage, a.microbatch)] = end
                free[g], nxt[g] = end, nxt[g] + 1
                progress = True
    stuck = [f"group {g} at {orders[g][nxt[g]]}" for g in range(p) if nxt[g] < len(orders[g])]
    if stuck:  # an order that waits on itself: a bug in an order generator, not in the spec
        raise _fail(f"schedule {schedule!r} deadlocks: " + ", ".join(stuck), "report this as a placer bug", "R011")

    makespan = max(free)
    slots, idle = [], 0.0
    for lane in busy:
        out, clock = [], 0.0
        for s in sorted(lane, key=lambda x: x.start):
            if s.start - clock > _EPS:
                out.append(Slot(clock, s.start, "idle"))
                idle += s.start - clock
            out.append(s)
            clock = s.end
        if makespan - clock > _EPS:
            out.append(Slot(clock, makespan, "idle"))
            idle += makespan - clock
        slots.append(tuple(out))
    names = tuple(tuple(x) for x in groups) if groups else tuple((f"group{g}",) for g in range(p))
    return Timeline(schedule=schedule, microbatches=m, stage_groups=tuple(stage_groups), groups=names,
                    slots=tuple(slots), makespan=makespan, bubble=idle / (p * makespan) if makespan else 0.0,
                    textbook=textbook_bubble(p, m, n // p), unit=unit)


# ---- from a plan -----------------------------------------------------------------------------------

def stage_layout(plan) -> tuple[list[int], list[tuple[str, ...]]]:
    """Stage -> group index, and the groups' devices, from a plan's pipeline segments."""
    stages = sorted((s for s in plan.segments if s.stage is not None), key=lambda s: s.stage)
    groups: list[tuple[str, ...]] = []
    for s in stages:
        if tuple(s.devices) not in groups:
            groups.append(tuple(s.devices))
    return [groups.index(tuple(s.devices)) for s in stages], groups


def stage_flops(plan, graph) -> list[float]:
    """Forward FLOPs of one micro-batch of each stage, on one device of its group."""
    stages = sorted((s for s in plan.segments if s.stage is not None), key=lambda s: s.stage)
    out = []
    for s in stages:
        total = sum(graph.layer(name).flops for name in s.layers)
        out.append(total / s.degree / max(1, plan.microbatches))  # a parallel group splits the work
    return out


def simulate_plan(plan, graph=None, *, fwd: Sequence[float] | None = None, bwd: Sequence[float] | None = None,
                  transfer: Sequence[float] | float = 0.0, unit: str | None = None) -> Timeline | None:
    """Simulate the plan's pipeline; None when the plan has none.

    Times: `fwd`/`bwd` when given (predicted seconds from the cost model),
    else forward FLOPs from `graph` (backward = 2x forward), else unit times.
    """
    if not plan.schedule:
        return None
    stage_groups, groups = stage_layout(plan)
    if fwd is None and graph is not None:
        flops = stage_flops(plan, graph)
        if all(x > 0 for x in flops):
            fwd, unit = flops, unit or "flop"
    return simulate(plan.schedule, stage_groups, plan.microbatches, fwd=fwd, bwd=bwd, transfer=transfer,
                    groups=groups, unit=unit or ("s" if fwd is not None else "unit"))
