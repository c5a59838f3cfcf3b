"""Pipeline schedules: the one table (name, stage layout, micro-batch rule, torch class) and
each device group's action order, taken from torch's own generators.

validate, plan, the simulator and the program all read `SCHEDULES`; the JSON schema's enum
and the program's runtime piece (`codegen/runtime/pipeline.py`, standalone) are tested
equal to it. torch is imported only inside `action_orders`: `placer validate` never needs it.
"""
from __future__ import annotations

from dataclasses import dataclass

from placer.diagnostics import Diagnostic, PlanError

KINDS = ("F", "B", "I", "W")
"""Action kinds, as in torch's `_Action` strings: forward, full backward, backward for the
input gradient only, backward for the weight gradient (zero-bubble schedules split B into I + W)."""


@dataclass(frozen=True)
class Schedule:
    name: str
    layout: str
    """`single`: one stage per device group; `loop`: stage s on group s % p, the same number
    (at least 2) per group; `v`: two per group in a V, group r holds stages r and 2p - 1 - r."""
    microbatches: str | None
    """Rule on the number of micro-batches m (torch's schedule refuses others): None;
    `at_least_stages`: m >= stages; `multiple_of_rounds`: m % max(1, m // p) == 0."""
    torch_class: str
    """Its class in `torch.distributed.pipelining.schedules`."""

    def owner(self, stage: int, p: int) -> int:
        """The device group (0..p-1, in the pipeline's order) that runs `stage`."""
        if self.layout == "v" and stage >= p:
            return 2 * p - 1 - stage
        return stage % p

    def stage_groups(self, p: int, n: int) -> list[int] | None:
        """Stage -> group of `n` stages on `p` groups, or None where this schedule cannot run them."""
        fits = {"single": n == p, "loop": n > p and n % p == 0, "v": n == 2 * p}[self.layout]
        return [self.owner(s, p) for s in range(n)] if fits and p > 0 else None

    def microbatch_problem(self, m: int, n: int, p: int) -> tuple[str, str] | None:
        """(what the schedule needs, a hint) when `m` micro-batches break its rule, else None."""
        if self.microbatches == "at_least_stages" and m < n:
            return f"microbatches ({m}) >= stages ({n})", f"use at least {n} microbatches"
        rounds = max(1, m // p) if p else 1
        if self.microbatches == "multiple_of_rounds" and m % rounds:
            need = f"microbatches ({m}) to be a multiple of the rounds ({rounds} = microbatches // {p} device groups)"
            return need, f"use a multiple of {p} microbatches"
        return None


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", "single", None, "ScheduleGPipe"),
    Schedule("1f1b", "single", "at_least_stages", "Schedule1F1B"),
    Schedule("interleaved_1f1b", "loop", "multiple_of_rounds", "ScheduleInterleaved1F1B"),
    Schedule("looped_bfs", "loop", None, "ScheduleLoopedBFS"),
    Schedule("interleaved_zero_bubble", "loop", "multiple_of_rounds", "ScheduleInterleavedZeroBubble"),
    Schedule("zbv_zero_bubble", "v", None, "ScheduleZBVZeroBubble"),
    Schedule("dualpipev", "v", "at_least_stages", "ScheduleDualPipeV"),
)}


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str
    """One of KINDS."""
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def _fail(msg: str, hint: str) -> PlanError:
    return PlanError(Diagnostic("R010", msg, hint=hint))


def action_orders(schedule: str, p: int, n_stages: int, m: int) -> list[list[Action]]:
    """Per device group (pipeline rank), the compute actions it runs, in the order torch's
    schedule `schedule` runs them for `n_stages` stages on `p` groups and `m` micro-batches.

    The orders come from the torch class's own generator, called on an instance whose
    __init__ is skipped (it wants real stages and a process group). Its idle steps (None),
    gradient reductions and sends are dropped; DualPipeV's overlapped F+B pairs become their
    two actions in order."""
    s = SCHEDULES.get(schedule)
    if s is None:
        raise _fail(f"unknown pipeline schedule {schedule!r}", "schedules are " + ", ".join(SCHEDULES))
    groups = s.stage_groups(p, n_stages)
    if groups is None:
        raise _fail(f"schedule {schedule!r} cannot run {n_stages} stages on {p} device groups",
                    "gpipe/1f1b: one stage per group; interleaved/looped: the same number (at least 2) per "
                    "group; zbv/dualpipev: two per group")
    problem = s.microbatch_problem(m, n_stages, p)
    if problem:
        raise _fail(f"schedule {schedule!r} needs {problem[0]}", problem[1])
    # lazily: plain `placer validate` never imports torch; without it the CLI says "needs PyTorch"
    from torch.distributed.pipelining import schedules as ts

    try:
        cls = getattr(ts, s.torch_class)
    except AttributeError:
        raise _fail(f"schedule {schedule!r} needs torch.distributed.pipelining with {s.torch_class}",
                    "install a torch release that has it (2.9 or later), or pick another schedule") from None
    gen = object.__new__(cls)
    v, rounds = n_stages // p, max(1, m // p)
    # what the generators read, as their __init__ would set it
    gen.pp_group_size, gen._num_stages, gen.num_stages, gen._n_microbatches = p, n_stages, n_stages, m
    gen.n_local_stages, gen._stages = v, [None] * v
    gen.number_of_rounds, gen.microbatches_per_round = rounds, m // rounds
    try:
        if s.layout == "single":
            raw = gen._get_pipeline_order()
            ranks = [raw[r] for r in range(p)]
        else:
            ranks = [gen._calculate_single_rank_operations(r) for r in range(p)]
    except (AttributeError, TypeError, KeyError) as e:  # private API: a torch release may change it
        raise _broken(schedule, f"torch's {s.torch_class} generator failed ({e})") from None
    orders = [[Action(sub.stage_index, sub.computation_type.value, sub.microbatch_index)
               for a in ops if a is not None for sub in (a.sub_actions or (a,))
               if sub.computation_type.value in KINDS] for ops in ranks]
    if s.layout == "single":
        orders = [_in_microbatch_order(o) for o in orders]
    missing = _incomplete(orders, groups, m)
    if missing:
        raise _broken(schedule, f"torch's {s.torch_class} order {missing}")
    return orders


def _broken(schedule: str, what: str) -> PlanError:
    return PlanError(Diagnostic("R011", f"schedule {schedule!r}: {what}", hint="report this as a placer bug, "
                                "with your torch version"))


def _incomplete(orders: list[list[Action]], groups: list[int], m: int) -> str | None:
    """What is wrong with the orders, or None when every stage runs on its group a forward and a
    backward (B, or I and W) of every micro-batch, once."""
    seen: dict[tuple[int, int], list[str]] = {}
    for g, order in enumerate(orders):
        for a in order:
            if not 0 <= a.microbatch < m or groups[a.stage] != g:
                return f"runs {a} on group {g}"
            seen.setdefault((a.stage, a.microbatch), []).append(a.kind)
    for st in range(len(groups)):
        for i in range(m):
            if sorted(seen.get((st, i), [])) not in (["B", "F"], ["F", "I", "W"]):
                return f"runs {sorted(seen.get((st, i), []))} for stage {st}, micro-batch {i}"
    return None


def _in_microbatch_order(order: list[Action]) -> list[Action]:
    """A single-stage schedule's order with each kind's micro-batches numbered 0, 1, ... as
    its `_step_microbatches` runs them. Its `_get_pipeline_order` is only a picture of that
    loop, and torch 2.13's 1F1B picture numbers the last rank's forwards from 1."""
    count: dict[str, int] = {}
    out = []
    for a in order:
        out.append(Action(a.stage, a.kind, count.get(a.kind, 0)))
        count[a.kind] = count.get(a.kind, 0) + 1
    return out
