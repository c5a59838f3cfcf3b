"""Communication per step: what each device sends, and which bytes each op moves.

**Bytes sent**, one definition for the plan and the run: the payload each device hands to
torch.distributed per step (`op_sent`, `Communication.payload`, the plan's `payload_bytes`,
what `placer run` measures): the
tensor of an all-reduce, reduce or reduce-scatter, its own slice of an all-gather, the
tensor a broadcast's root sends, each piece a copy, send or halo hands over (once, whatever
the route). **Bytes moved** (the comm table's `moved`, `pairs`, the plan's `sent_bytes` and
`recv_bytes`) are the textbook wire traffic of each algorithm, per step:

- ring all-reduce of B bytes over n devices: each device sends 2(n-1)/n * B to
  its ring neighbour; all-gather and reduce-scatter: (n-1)/n * B each;
- broadcast / reduce (parameter server, broadcast sync): B to / from each
  device other than the root;
- copy, split, merge, re-split: exactly the slices that change device
  (`placer.plan.layout.moves`);
- send: its payload; halo: the halo rows between neighbours;
- route via_host: every device-to-device hop goes through the sender's host
  CPU, so the bytes cross two links.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from placer.device import Device
from placer.plan.ir import TRANSFERS, Op, OpKind, Plan
from placer.plan.layout import Move, moves, transfer_layouts


def route_hops(a: str, b: str, n: int, route: str | None) -> list[Move]:
    if route != "via_host" or Device.parse(a).is_host or Device.parse(b).is_host:
        return [(a, b, n)]
    h = Device.parse(a).host  # the sender's machine's CPU
    return [(a, h, n), (h, b, n)]


def _ring(devices, fraction: Fraction, nbytes: int) -> list[Move]:
    n = len(devices)
    if n < 2:
        return []
    return [(devices[i], devices[(i + 1) % n], round(nbytes * fraction)) for i in range(n)]


def op_sent(op: Op) -> dict[str, int]:
    """Device -> the payload it hands to torch.distributed for one op (see the module doc)."""
    k, devs = op.kind, op.devices
    if k in (OpKind.ALL_REDUCE, OpKind.REDUCE, OpKind.REDUCE_SCATTER, OpKind.ALL_TO_ALL):  # (all-to-all: its
        # whole send buffer, the rows it keeps included)
        return {d: op.bytes for d in devs}
    if k == OpKind.BROADCAST:
        return {op.attrs.get("root", devs[0]): op.bytes}
    if k == OpKind.ALL_GATHER:  # its own slice; uneven channel slices (or bands) are padded to the largest
        n, channels = len(devs), op.attrs.get("channels", op.attrs.get("rows"))
        piece = Fraction(-(-channels // n), channels) if channels else Fraction(1, n)
        return {d: round(op.bytes * piece) for d in devs}
    out: dict[str, int] = {}
    if k in TRANSFERS or k in (OpKind.SEND, OpKind.HALO):  # point to point: by the sender, once
        raw = _halo(op) if k == OpKind.HALO else op_moves(op.with_(route=None))
        for a, _, n in raw:
            out[a] = out.get(a, 0) + n
    return out


def op_moves(op: Op) -> list[Move]:
    """What one op moves, per (from, to) device pair, routes included. RECV moves nothing: its SEND does."""
    k, n, devs = op.kind, len(op.devices), op.devices
    if k in TRANSFERS:
        raw = moves(*transfer_layouts(op), op.bytes)
    elif k == OpKind.SEND:
        raw = [(op.src[0] if op.src else devs[0], op.dst[0] if op.dst else devs[-1], op.bytes)]
    elif k == OpKind.ALL_REDUCE:
        return _ring(devs, Fraction(2 * (n - 1), n), op.bytes)
    elif k == OpKind.ALL_GATHER and ("channels" in op.attrs or "rows" in op.attrs):
        return _ring_gather_uneven(devs, op.attrs.get("channels") or op.attrs["rows"], op.bytes)
    elif k in (OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER):
        return _ring(devs, Fraction(n - 1, n), op.bytes)
    elif k in (OpKind.BROADCAST, OpKind.REDUCE):
        root = op.attrs.get("root", devs[0])
        pairs = [(root, d) if k == OpKind.BROADCAST else (d, root) for d in devs if d != root]
        return [(a, b, op.bytes) for a, b in pairs]
    elif k == OpKind.HALO:
        return _halo(op)
    elif k == OpKind.ALL_TO_ALL:  # uniform routing: 1/n of each device's rows to each device (itself too)
        return [(a, b, op.bytes // n) for a in devs for b in devs if a != b]
    else:
        return []
    return [hop for a, b, m in raw if m for hop in route_hops(a, b, m, op.route)]


def _ring_gather_uneven(devices, channels: int, nbytes: int) -> list[Move]:
    """A ring all-gather of uneven channel slices as ChannelSplit sends them: every slice
    padded to the largest, ceil(channels / n) channels (gloo's all_gather takes equal sizes)."""
    n = len(devices)
    return _ring(devices, Fraction((n - 1) * -(-channels // n), channels), nbytes)


def _halo(op: Op) -> list[Move]:
    """Forward: device r+1 gets `prev_rows` rows from r, r gets `next_rows` from r+1;
    backward sends the gradients of those rows back the other way."""
    top, bottom, n = op.attrs.get("prev_rows", 0), op.attrs.get("next_rows", 0), len(op.devices)
    # one row's bytes from the op's (a pipeline's micro-batch has 1/m of the batch's rows' bytes)
    row = op.bytes // ((top + bottom) * (n - 1)) if top + bottom and n > 1 else 0
    down, up = top * row, bottom * row
    if op.phase != "fwd":
        down, up = up, down
    out = []
    for a, b in zip(op.devices, op.devices[1:]):
        out += [(a, b, down)] if down else []
        out += [(b, a, up)] if up else []
    return out


@dataclass(frozen=True)
class CommRow:
    op: Op
    moves: tuple[Move, ...]

    @property
    def bytes(self) -> int:
        return sum(m[2] for m in self.moves)


@dataclass(frozen=True)
class Communication:
    rows: tuple[CommRow, ...]
    """Every communication op once, with what it moves."""
    pairs: dict
    """(from, to) -> bytes per step."""
    sent: dict
    """Device -> bytes moved from it (wire)."""
    received: dict
    """Device -> bytes moved to it (wire)."""
    payload: dict
    """Device -> payload it hands to torch.distributed per step (what `placer run` measures)."""

    @property
    def total(self) -> int:
        return sum(self.pairs.values())


def communication(plan: Plan) -> Communication:
    rows: list[CommRow] = []
    pairs: dict[tuple[str, str], int] = {}
    sent: dict[str, int] = {}
    received: dict[str, int] = {}
    payload: dict[str, int] = {}
    for op in plan.unique_ops():
        if op.kind in (OpKind.COMPUTE, OpKind.STEP, OpKind.RECV):
            continue
        mv = tuple(op_moves(op))
        rows.append(CommRow(op, mv))
        for a, b, n in mv:
            pairs[(a, b)] = pairs.get((a, b), 0) + n
            sent[a] = sent.get(a, 0) + n
            received[b] = received.get(b, 0) + n
        for d, n in op_sent(op).items():
            payload[d] = payload.get(d, 0) + n
    rank = {d: i for i, d in enumerate(plan.devices)}

    def order(pair):  # plan order; a host a via_host copy passes through after the plan's devices
        return tuple((rank.get(d, len(rank)), d) for d in pair)

    return Communication(rows=tuple(rows), pairs=dict(sorted(pairs.items(), key=lambda kv: order(kv[0]))),
                         sent=sent, received=received, payload=payload)
