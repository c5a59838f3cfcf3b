"""The program's lines that keep a tied parameter's copies equal (facts: placer/plan/ties.py).

`program_ties` gives each tie in rank terms; `emit_setup` (after every segment is set up:
every rank creates every group, in the same order) makes the group of the ranks holding a
copy and collects this rank's copies (saved under their own names, so `run --check`
compares each); `emit_sync` sums the copies' gradients after backward, before any step.
"""
from __future__ import annotations

from dataclasses import dataclass

from placer.diagnostics import PlanError
from placer.model.graph import ModelGraph
from placer.plan import ties
from placer.plan.ir import Plan


@dataclass(frozen=True)
class ProgramTie:
    name: str
    ranks: tuple[int, ...]
    """Ranks holding a copy, in segment order."""
    copies: tuple[tuple[int, str, str], ...]
    """(segment, layer, the parameter's name in that segment's stage module)."""
    positions: tuple[tuple[int, ...], ...] = ()
    """FSDP2 groups (plan/ties.py `shards`): per shard position, the ranks holding that shard of
    a copy; each sums its shard over them. Empty: whole copies, summed over `ranks`."""
    aliases: tuple[tuple[str, ...], ...] = ()
    """Per copy, every name the parameter has in that segment (plan/ties.py PlacedTie)."""


def program_ties(plan: Plan, spec, graph: ModelGraph, devices) -> list[ProgramTie]:
    """The plan's ties in rank terms (`devices` in rank order); P080 for one it cannot keep."""
    diags = ties.check(spec, graph, [[graph.names.index(n) for n in s.layers] for s in plan.segments])
    if diags:
        raise PlanError(diags)
    return [ProgramTie(t.tie.name, tuple(devices.index(d) for d in t.devices), t.copies,
                       tuple(tuple(devices.index(plan.segments[k].devices[r]) for k, _, _ in t.copies)
                             for r in range(ties.shards(t, plan.segments))), t.aliases)
            for t in ties.placed(plan.segments, graph)]


def emit_setup(pts: list[ProgramTie]) -> list[str]:
    if not pts:
        return []
    lines = ["", "# tied parameters: one copy per segment that uses it, equal from the seed and kept equal by",
             "# summing the copies' gradients before every step (over the ranks holding one)"]
    for i, t in enumerate(pts):
        users = ", ".join(f"{layer} (segment {k})" for k, layer, _ in t.copies)
        if t.positions:  # every rank creates every group, in the same order
            lines += [f"# {t.name}: {users}; FSDP2 holds shard r of each copy on the r-th rank of its group:",
                      "# the copies are summed shard by shard, over the ranks holding the same shard",
                      f"tie{i} = {{r: g for ranks in {[list(p) for p in t.positions]!r} "
                      "for g in [dist.new_group(ranks, timeout=timedelta(seconds=TIMEOUT_S))] for r in ranks}.get(rank)",
                      f"tied{i} = tied_copies({{{', '.join(f'{name!r}: seg{k}' for k, _, name in t.copies)}}})"]
            continue  # saved whole through owned(), as the segments' other sharded parameters
        if len(t.ranks) > 1:
            lines.append(f"tie{i} = dist.new_group({list(t.ranks)}, timeout=timedelta(seconds=TIMEOUT_S))"
                         f"  # {t.name}: {users}")
        else:
            lines.append(f"# {t.name}: {users}, all on rank {t.ranks[0]}")
        held = ", ".join(f"{name!r}: seg{k}" for k, _, name in t.copies)
        names = ", ".join(repr(name) for _, _, name in t.copies)
        lines += [f"tied{i} = tied_copies({{{held}}})",
                  "# each copy saved under its own name, and no name for a copy a stage holds but does not use",
                  f"for name in ({names}):", "    own.pop(name, None)", f"own.update(tied{i})"]
    return lines


def emit_sync(pts: list[ProgramTie]) -> list[str]:
    if not pts:
        return []
    lines = ["", "# tied parameters: every copy gets the sum of the copies' gradients, so all take one step"]
    for i, t in enumerate(pts):
        if len(t.ranks) > 1:
            lines += ['with timer("comm"):', f"    sum_tied_grads(list(tied{i}.values()), tie{i})  # {t.name}"]
        else:
            lines.append(f"sum_tied_grads(list(tied{i}.values()))  # {t.name}")
    return lines


def emit_norm_once(pts: list[ProgramTie]) -> list[str]:
    """With clip_grad_norm: a tied parameter counts once in the global norm, as its first copy."""
    lines = []
    for i, t in enumerate(pts):
        k, _, first = t.copies[0]
        lines += [f"# {t.name} counts once in the gradient norm: as its copy in segment {k}",
                  f"norm_params = [p for p in norm_params if p is tied{i}.get({first!r}) or "
                  f"all(p is not q for q in tied{i}.values())]"]
    return lines
