"""Plan invariants, checked after every lowering pass.

- every op sits only in the lists of devices that take part in it, and every
  device that takes part has it (a SEND on its sender, a RECV on its receiver);
- devices that share ops see them in the same order (else the step deadlocks);
- no device runs an op of a segment it is not in: compute on the group,
  collectives among the group (and a parameter server), transfers from the
  producing segment's devices to the consuming one's;
- every device computes each of its segments' layers exactly once per phase
  (and micro-batch), backward in reverse layer order;
- every segment boundary where the activation changes layout has exactly one
  forward and one backward transfer (or, in a pipeline, sends for every
  micro-batch), and none where it does not;
- every SEND has a RECV with the same micro-batch, devices and bytes, and
  each pair of devices receives in the order it sends.

On failure: PlanError whose message holds the whole plan text, bad ops
marked `>>` (like torch.fx `Graph.lint`, pipelining `_validate_schedule`).
"""
from __future__ import annotations

from collections import Counter

from placer.diagnostics import Diagnostic, Loc, PlanError
from placer.plan.ir import P2P, TRANSFERS, Op, OpKind, Plan
from placer.plan.layout import in_layout, moves
from placer.plan.text import format_plan

Problem = tuple[str, str, list]  # (code, message, marks)


def verify(plan: Plan, complete: bool = True, after: str | None = None) -> Plan:
    """Return the plan unchanged, or raise PlanError naming the first broken invariant.

    `complete`: also require every boundary transfer (off between lowering passes)."""
    for check in (_membership, _order, _segments, _coverage, _pairs, lambda p: _boundaries(p, complete)):
        problem = check(plan)
        if problem:
            code, msg, marks = problem
            where = f" after {after}" if after else ""
            raise PlanError(Diagnostic(
                code, f"plan {plan.name!r} is inconsistent{where}: {msg}\n" + format_plan(plan, marks).rstrip(),
                Loc(f"<plan {plan.name}>"), "a lowering pass broke an invariant: this is a placer bug; "
                "please report it with the spec"))
    return plan


def _in_list_of(op: Op) -> tuple[str, ...]:
    """The devices whose lists hold the op."""
    if op.kind == OpKind.SEND:
        return op.devices[:1]
    if op.kind == OpKind.RECV:
        return op.devices[-1:]
    return op.devices


def _membership(plan: Plan) -> Problem | None:
    for d in plan.devices:
        for i, op in enumerate(plan.ops.get(d, ())):
            if d not in _in_list_of(op):
                return "V001", f"op {i} on {d} does not involve {d}", [(d, i)]
            unknown = [x for x in op.devices if x not in plan.devices]
            if unknown:
                return "V001", f"op {i} on {d} names unknown device {unknown[0]!r}", [(d, i)]
    extra = [d for d in plan.ops if d not in plan.devices]
    if extra:
        return "V001", f"ops listed for unknown device {extra[0]!r}", []
    return None


def _order(plan: Plan) -> Problem | None:
    """Walk all lists together: a shared op may run only when it heads the list of every device in it."""
    lists = {d: plan.ops.get(d, ()) for d in plan.devices}
    head = {d: 0 for d in plan.devices}
    moved = True
    while moved:
        moved = False
        for d in plan.devices:
            while head[d] < len(lists[d]):
                op = lists[d][head[d]]
                members = _in_list_of(op)
                if len(members) == 1:
                    head[d] += 1
                elif all(head[e] < len(lists[e]) and lists[e][head[e]] == op for e in members):
                    for e in members:
                        head[e] += 1
                else:
                    break
                moved = True
    stuck = [d for d in plan.devices if head[d] < len(lists[d])]
    if not stuck:
        return None
    for d in stuck:  # a head missing from a member's list is the root cause; else a cycle
        op = lists[d][head[d]]
        missing = [e for e in _in_list_of(op) if op not in lists[e]]
        if missing:
            return "V002", f"op {head[d]} on {d} can never run: it is missing from the list of {missing[0]}", \
                [(d, head[d])]
    return "V002", f"op {head[stuck[0]]} on {stuck[0]} can never run: the devices in it reach it in " \
                   "different orders (deadlock)", [(e, head[e]) for e in stuck]


def _segments(plan: Plan) -> Problem | None:
    n = len(plan.segments)
    for d in plan.devices:
        for i, op in enumerate(plan.ops.get(d, ())):
            if not 0 <= op.segment < n:
                return "V003", f"op {i} on {d} names segment {op.segment}, the plan has {n}", [(d, i)]
            if "tie" in op.attrs or "grad_norm" in op.attrs:  # spans segments: a tie's copies (plan/ties.py),
                continue  # or every device (the gradient norm, plan/lower.py)
            seg = plan.segments[op.segment]
            allowed = set(seg.devices) | ({seg.server} if seg.server else set())
            # a last segment's output meeting for the loss moves within the segment's group
            if op.kind in (OpKind.COMPUTE, OpKind.STEP) or op.kind not in TRANSFERS | P2P or op.attrs.get("loss"):
                bad = [x for x in op.devices if x not in allowed]
                if bad:
                    return "V003", f"op {i} on {d}: {bad[0]} is not in segment {seg.name!r} {list(seg.devices)}", \
                        [(d, i)]
                continue
            if op.segment == 0:
                return "V003", f"op {i} on {d}: segment 0 has no segment before it to receive from", [(d, i)]
            # a tensor crossing in lockstep (plan/crossings.py) comes from the segment that made it
            prev = plan.segments[op.attrs.get("from", op.segment - 1)]
            src, dst = (prev, seg) if op.phase == "fwd" else (seg, prev)
            # a 2-D group's first devices pass its replica's rows on (the sender is in the receiving group)
            # and gather its bands first (the receiver is in the sending group)
            relays, gathers = ((g.devices if g.options.get("data", 1) > 1 and op.kind in P2P else ())
                               for g in (dst, src))
            bad = [x for x in (op.src or op.devices[:1]) if x not in src.devices + relays] + \
                  [x for x in (op.dst or op.devices[-1:]) if x not in dst.devices + gathers]
            if bad:
                return "V003", (f"op {i} on {d}: {op.phase} {op.kind.value} between segments "
                                f"{prev.name!r} and {seg.name!r} involves {bad[0]}, which is in neither end"), [(d, i)]
    return None


def _coverage(plan: Plan) -> Problem | None:
    """Per device, segment and micro-batch: forward chunks cover the layers once, in order; so does backward."""
    mbs = [None] if not plan.schedule else list(range(plan.microbatches))
    for d in plan.devices:
        runs: dict[tuple, list] = {}
        where: dict[tuple, int] = {}
        for i, op in enumerate(plan.ops.get(d, ())):
            if op.kind == OpKind.COMPUTE:
                try:
                    layers = plan.chunk_layers(op)
                except (ValueError, IndexError):
                    return "V004", f"compute op {i} on {d} names layers {op.tensor!r} not in its segment", [(d, i)]
                key = (op.segment, op.phase, op.microbatch)
                runs.setdefault(key, []).append(layers)
                where.setdefault(key, i)
        for seg in plan.segments:
            if d not in seg.devices:
                continue
            for mb in mbs:
                want = list(seg.layers)
                fwd = [l for run in runs.get((seg.index, "fwd", mb), []) for l in run]
                backs = [p for p in ("bwd", "bwd_input", "bwd_weight") if (seg.index, p, mb) in runs]
                phases = {"fwd": fwd}
                for p in backs or ["bwd"]:
                    phases[p] = [l for run in reversed(runs.get((seg.index, p, mb), [])) for l in run]
                if backs and set(backs) not in ({"bwd"}, {"bwd_input", "bwd_weight"}):
                    return "V004", f"{d} runs backward phases {backs} of segment {seg.name!r}", \
                        [(d, where[(seg.index, backs[0], mb)])]
                for p, got in phases.items():
                    if got != want:
                        at = where.get((seg.index, p, mb))
                        mbt = f" micro-batch {mb}" if mb is not None else ""
                        return "V004", (f"{d} computes {p}{mbt} of segment {seg.name!r} over {got or 'no layers'}, "
                                        f"not once over {want}"), [(d, at)] if at is not None else []
    stray = [(d, i) for d in plan.devices for i, op in enumerate(plan.ops.get(d, ()))
             if op.kind == OpKind.COMPUTE and op.microbatch not in mbs]
    if stray:
        return "V004", f"compute op {stray[0][1]} on {stray[0][0]} has a micro-batch outside {mbs}", stray[:1]
    return None


def _p2p_key(op: Op) -> tuple:
    return (op.segment, op.phase, op.tensor, op.microbatch, op.devices, op.bytes)


def _pairs(plan: Plan) -> Problem | None:
    sends: Counter[tuple] = Counter()
    recvs: Counter[tuple] = Counter()
    pos: dict[tuple, tuple[str, int]] = {}
    for d in plan.devices:
        for i, op in enumerate(plan.ops.get(d, ())):
            if op.kind in P2P:
                (sends if op.kind == OpKind.SEND else recvs)[_p2p_key(op)] += 1
                pos.setdefault((op.kind, _p2p_key(op)), (d, i))
    for key in sends.keys() | recvs.keys():
        if sends[key] != recvs[key]:
            kind = OpKind.SEND if sends[key] > recvs[key] else OpKind.RECV
            other = "recv" if kind == OpKind.SEND else "send"
            return "V005", f"{kind.value} of {key[2]} micro-batch {key[3]} {key[4][0]} -> {key[4][-1]} " \
                           f"({key[5]} bytes) has no matching {other}", [pos[(kind, key)]]
    # each receiver takes a pair's messages in the order the sender sends them
    for a in plan.devices:
        for b in plan.devices:
            out = [(i, _p2p_key(o)) for i, o in enumerate(plan.ops.get(a, ())) if o.kind == OpKind.SEND
                   and o.devices == (a, b)]
            inn = [(i, _p2p_key(o)) for i, o in enumerate(plan.ops.get(b, ())) if o.kind == OpKind.RECV
                   and o.devices == (a, b)]
            for (i, ks), (j, kr) in zip(out, inn):
                if ks != kr:
                    return "V005", f"{b} receives from {a} in another order than {a} sends", [(a, i), (b, j)]
    return None


def _boundaries(plan: Plan, complete: bool) -> Problem | None:
    counts: dict[tuple, list] = {}
    crossing = False
    for d in plan.devices:
        for i, op in enumerate(plan.ops.get(d, ())):
            if "from" in op.attrs:  # one per crossing tensor (plan/crossings.py): as many as the trace finds
                crossing = True
            elif op.owner == d and (op.kind in TRANSFERS or op.kind in P2P):
                counts.setdefault((op.segment, op.phase, op.microbatch, op.kind in P2P), []).append((d, i, op))
    segs = plan.segments
    for prev, cur in zip(segs, segs[1:]):
        changes = in_layout(prev) != in_layout(cur)
        for phase in ("fwd", "bwd"):
            xfers = counts.get((cur.index, phase, None, False), [])
            if plan.schedule and xfers:
                return "V006", f"pipeline stage boundary {prev.name!r} -> {cur.name!r} uses a " \
                               f"{xfers[0][2].kind.value}, not sends", [xfers[0][:2]]
            if plan.schedule:
                src, dst = in_layout(prev), in_layout(cur)
                if phase == "bwd":
                    src, dst = dst, src
                pairs = {(a, b) for a, b, _ in moves(src, dst, 10 ** 9)} if changes else set()
                for mb in range(plan.microbatches):
                    sends = [x for x in counts.get((cur.index, phase, mb, True), []) if x[2].kind == OpKind.SEND]
                    stray = [x for x in sends if x[2].devices not in pairs]
                    if stray:
                        return "V006", f"micro-batch {mb} is sent ({phase}) between stages {prev.name!r} and " \
                                       f"{cur.name!r} from {stray[0][2].devices[0]} to {stray[0][2].devices[1]}, " \
                                       "which the layouts do not call for", [stray[0][:2]]
                    if complete and pairs and not sends and not crossing:
                        return "V006", f"micro-batch {mb} is never sent ({phase}) from stage {prev.name!r} to " \
                                       f"{cur.name!r}", []
                continue
            if len(xfers) > 1 or (xfers and not changes):
                why = "more than one transfer" if len(xfers) > 1 else "a transfer where the layout does not change"
                return "V006", f"{phase} boundary {prev.name!r} -> {cur.name!r} has {why}", [x[:2] for x in xfers]
            if complete and changes and not xfers and not crossing:
                return "V006", f"{phase} boundary {prev.name!r} -> {cur.name!r} changes devices or layout but " \
                               "has no copy, split, merge or re-split", []
    return None
