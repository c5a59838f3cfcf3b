"""The plan's compact text form: `format_plan` and `parse_plan` round-trip.

    plan mlp_group_transitions batch=16 microbatches=1
    devices [cpu,cuda:0,cuda:1]
    segment 0 embed @cpu layers=[fc1,act1]
    segment 1 middle [cuda:0,cuda:1] mode=data layers=[fc2,act2,fc3,act3] sync=allreduce ...

    device cpu
      compute s0 fwd fc1..act1
      split s1 fwd act cpu->[cuda:0,cuda:1] bytes=2048 route=direct dst_dim=0

An op line is `KIND sSEGMENT PHASE TENSOR [DEVICES] key=value...`: TENSOR is
`-` when empty; DEVICES is `src->dst` for transfers and pipeline sends,
`[a,b]` for a group, `@a` for one device other than the section's, and left
out for the section's own device. Values are bare words where that is
unambiguous, else JSON (`null`, `25.0`, `"a b"`). Device and layer names must
not contain whitespace, commas, brackets or quotes (spec names never do).
"""
from __future__ import annotations

import json
import re

from placer.plan.ir import Op, OpKind, PlacedSegment, Plan, union

_BARE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/\-]*")
_KEYWORDS = {"null", "true", "false", "NaN", "Infinity"}
_TOKEN = re.compile(r'(?:[^\s"]|"(?:[^"\\]|\\.)*")+')
OP_FIELDS = ("mb", "bytes", "dim", "route", "src_dim", "dst_dim", "devices")
SEGMENT_FIELDS = ("mode", "route", "stage", "layers", "recompute")


def _json(token: str):
    try:
        return json.loads(token)
    except ValueError:
        return _NOT_JSON


_NOT_JSON = object()


def enc(value) -> str:
    """One value as a token: a bare word if that reads back the same, else compact JSON."""
    if isinstance(value, str) and _BARE.fullmatch(value) and value not in _KEYWORDS and _json(value) is _NOT_JSON:
        return value
    return json.dumps(value, separators=(",", ":"))


def dec(token: str):
    """A token back to its value: JSON where it parses as JSON (`1f1b` does not: a word)."""
    if token in _KEYWORDS or token[0] in '"[{':
        return json.loads(token)
    if token[0] in "-0123456789":
        value = _json(token)
        return token if value is _NOT_JSON else value
    return token


def _names(names) -> str:
    return "[" + ",".join(enc(n) for n in names) + "]"


def _parse_names(token: str) -> tuple:
    if not (token.startswith("[") and token.endswith("]")):
        return (dec(token),)
    inner = token[1:-1]
    return tuple(dec(t) for t in inner.split(",")) if inner else ()


def _side(devices) -> str:
    return enc(devices[0]) if len(devices) == 1 else _names(devices)


def _kv(key: str, value) -> str:
    return f"{key}={enc(value)}"


def _check_keys(keys, reserved, what: str) -> None:
    for k in keys:
        if k in reserved or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ValueError(f"{what} key {k!r} cannot be written in the plan text")


def format_op(op: Op, device: str | None = None) -> str:
    parts = [op.kind.value, f"s{op.segment}", enc(op.phase), enc(op.tensor) if op.tensor else "-"]
    if op.src or op.dst:
        parts.append(f"{_side(op.src)}->{_side(op.dst)}")
    elif op.devices != (device,):
        parts.append("@" + enc(op.devices[0]) if len(op.devices) == 1 else _names(op.devices))
    if op.microbatch is not None:
        parts.append(_kv("mb", op.microbatch))
    if op.bytes:
        parts.append(_kv("bytes", op.bytes))
    for key in ("dim", "route", "src_dim", "dst_dim"):
        if getattr(op, key) is not None:
            parts.append(_kv(key, getattr(op, key)))
    if (op.src or op.dst) and op.devices != union(op.src, op.dst):
        parts.append("devices=" + _names(op.devices))
    _check_keys(op.attrs, OP_FIELDS, "op attribute")
    parts += [_kv(k, v) for k, v in op.attrs.items()]
    return " ".join(parts)


def format_segment(seg: PlacedSegment) -> str:
    devs = "@" + enc(seg.devices[0]) if len(seg.devices) == 1 else _names(seg.devices)
    parts = ["segment", str(seg.index), enc(seg.name), devs]
    if seg.mode != "none":
        parts.append(_kv("mode", seg.mode))
    if seg.route != "direct":
        parts.append(_kv("route", seg.route))
    if seg.stage is not None:
        parts.append(_kv("stage", seg.stage))
    if seg.recompute:
        parts.append(_kv("recompute", True))
    parts.append("layers=" + _names(seg.layers))
    _check_keys(seg.options, SEGMENT_FIELDS, "segment option")
    parts += [_kv(k, v) for k, v in seg.options.items()]
    return " ".join(parts)


def format_plan(plan: Plan, marks=()) -> str:
    """The plan as text; ops at the (device, index) positions in `marks` start with `>>`."""
    marks = set(marks)
    head = [f"plan {enc(plan.name)}", _kv("batch", plan.batch_size), _kv("microbatches", plan.microbatches)]
    if plan.schedule is not None:
        head.append(_kv("schedule", plan.schedule))
    if plan.accumulate != 1:
        head.append(_kv("accumulate", plan.accumulate))
    if plan.precision != "fp32":
        head.append(_kv("precision", plan.precision))
    lines = [" ".join(head), "devices " + _names(plan.devices)]
    lines += [format_segment(s) for s in plan.segments]
    for dev in plan.devices:
        lines += ["", f"device {enc(dev)}"]
        for i, op in enumerate(plan.ops.get(dev, ())):
            lines.append((">> " if (dev, i) in marks else "  ") + format_op(op, dev))
    return "\n".join(lines) + "\n"


# ---- parsing -------------------------------------------------------------------------------------

class PlanTextError(ValueError):
    """The text is not a plan; says which line and why."""


def _pairs(tokens, lineno: int) -> dict:
    out = {}
    for t in tokens:
        key, eq, value = t.partition("=")
        if not eq:
            raise PlanTextError(f"line {lineno}: expected key=value, got {t!r}")
        out[key] = value
    return out


def parse_op(line: str, device: str, lineno: int = 0) -> Op:
    tokens = _TOKEN.findall(line)
    if len(tokens) < 4 or not tokens[1].startswith("s"):
        raise PlanTextError(f"line {lineno}: an op is `KIND sSEGMENT PHASE TENSOR ...`, got {line.strip()!r}")
    try:
        kind = OpKind(tokens[0])
    except ValueError:
        raise PlanTextError(f"line {lineno}: unknown op kind {tokens[0]!r}") from None
    fields = dict(kind=kind, segment=int(tokens[1][1:]), phase=dec(tokens[2]),
                  tensor="" if tokens[3] == "-" else dec(tokens[3]), devices=(device,))
    rest = tokens[4:]
    if rest and "=" not in rest[0]:
        spec = rest.pop(0)
        if "->" in spec:
            a, _, b = spec.partition("->")
            fields["src"], fields["dst"] = _parse_names(a), _parse_names(b)
            fields["devices"] = union(fields["src"], fields["dst"])
        elif spec.startswith("@"):
            fields["devices"] = (dec(spec[1:]),)
        else:
            fields["devices"] = _parse_names(spec)
    kv = _pairs(rest, lineno)
    attrs = {}
    for key, value in kv.items():
        if key == "devices":
            fields["devices"] = _parse_names(value)
        elif key == "mb":
            fields["microbatch"] = dec(value)
        elif key in OP_FIELDS:
            fields[key] = dec(value)
        else:
            attrs[key] = dec(value)
    return Op(attrs=attrs, **fields)


def parse_segment(tokens: list[str], lineno: int) -> PlacedSegment:
    if len(tokens) < 4:
        raise PlanTextError(f"line {lineno}: a segment is `segment INDEX NAME DEVICES layers=[...] ...`")
    devs = (dec(tokens[3][1:]),) if tokens[3].startswith("@") else _parse_names(tokens[3])
    kv = _pairs(tokens[4:], lineno)
    if "layers" not in kv:
        raise PlanTextError(f"line {lineno}: segment has no layers=[...]")
    return PlacedSegment(
        index=int(tokens[1]), name=dec(tokens[2]), devices=devs,
        mode=dec(kv.pop("mode", "none")), route=dec(kv.pop("route", "direct")),
        stage=dec(kv.pop("stage")) if "stage" in kv else None, layers=_parse_names(kv.pop("layers")),
        recompute=bool(dec(kv.pop("recompute", "false"))),
        options={k: dec(v) for k, v in kv.items()},
    )


def parse_plan(text: str) -> Plan:
    """Read the text form back; PlanTextError (a ValueError) names the first bad line."""
    head, devices, segments, device = None, (), [], None
    ops: dict[str, list[Op]] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if raw.startswith(("  ", ">>")):
            if device is None:
                raise PlanTextError(f"line {lineno}: op outside a `device` section")
            ops[device].append(parse_op(line[2:], device, lineno))
            continue
        tokens = _TOKEN.findall(line)
        word = tokens[0]
        if word == "plan" and len(tokens) >= 2:
            head = dict(name=dec(tokens[1]), **_pairs(tokens[2:], lineno))
        elif word == "devices" and len(tokens) == 2:
            devices = _parse_names(tokens[1])
        elif word == "segment":
            segments.append(parse_segment(tokens, lineno))
        elif word == "device" and len(tokens) == 2:
            device = dec(tokens[1])
            ops[device] = []
        else:
            raise PlanTextError(f"line {lineno}: expected plan, devices, segment or device, got {word!r}")
    if head is None:
        raise PlanTextError("no `plan NAME ...` line")
    schedule = dec(head["schedule"]) if "schedule" in head else None
    plan = Plan(name=head["name"], devices=devices, segments=tuple(segments),
                microbatches=int(head.get("microbatches", 1)), schedule=schedule,
                batch_size=int(head.get("batch", 0)), accumulate=int(head.get("accumulate", 1)),
                precision=dec(head["precision"]) if "precision" in head else "fp32")
    return plan.with_ops(ops)
