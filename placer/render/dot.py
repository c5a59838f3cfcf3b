"""The placement graph as graphviz DOT source, and writing it as .dot/.svg/.png.

One cluster per device group (its device names and, with an estimate, their
memory), one nested cluster per segment (stage number, mode), layers as
nodes in model order, communication ops where they happen: copies, splits,
merges and pipeline sends as nodes on the edges that cross devices,
collectives (all-reduce, ...) as nodes inside their segment's cluster.

The text is written here, deterministic, so golden files can hold it; the
`graphviz` package draws it (and gives a clear error when `dot` is missing). Every label goes through `_q`,
which escapes what the spec wrote.
"""
from __future__ import annotations

from pathlib import Path

from placer import units
from placer.device import Device
from placer.diagnostics import Diagnostic, Loc, PlanError
from placer.modes import MODES
from placer.plan.ir import COLLECTIVES, P2P, TRANSFERS, Op, OpKind, Plan

TRANSITIONS = TRANSFERS | P2P  # drawn on the edge between two segments
_NAMES = {OpKind.ALL_REDUCE: "all-reduce", OpKind.REDUCE_SCATTER: "reduce-scatter",
          OpKind.ALL_GATHER: "all-gather", OpKind.BROADCAST: "broadcast", OpKind.REDUCE: "reduce",
          OpKind.HALO: "halo exchange", OpKind.ALL_TO_ALL: "all-to-all", OpKind.COPY: "copy", OpKind.SPLIT: "split",
          OpKind.MERGE: "merge", OpKind.RESPLIT: "re-split", OpKind.SEND: "send", OpKind.RECV: "send"}
_SHAPES = {OpKind.COPY: "cds", OpKind.SEND: "cds", OpKind.RECV: "cds", OpKind.SPLIT: "trapezium",
           OpKind.MERGE: "invtrapezium", OpKind.RESPLIT: "parallelogram"}
# slanted shapes pad a lot by themselves; the arrow tip of `cds` eats into its label
_MARGINS = {OpKind.SPLIT: "margin=0, ", OpKind.MERGE: "margin=0, ", OpKind.RESPLIT: "margin=0, ",
            OpKind.COPY: "margin=\"0.25,0.12\", ", OpKind.SEND: "margin=\"0.25,0.12\", "}
_FILLS = ("#dbe9f6", "#fde2c8", "#d9f0d3", "#f3d9ec", "#fff2b3", "#e0dcf0", "#d1ecec", "#f6d5d5")
_PHASE_ORDER = {"fwd": 0, "bwd": 1, "bwd_input": 1, "bwd_weight": 2, "step": 3}
FORMATS = ("dot", "gv", "svg", "png", "pdf")
INSTALL = ("install graphviz (apt-get install graphviz, brew install graphviz, conda install graphviz), "
           "or write the source with --dot and draw it elsewhere")


def _q(*lines) -> str:
    """A DOT quoted string; lines are joined with graphviz's centred line break."""
    def esc(s) -> str:
        return str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\r", " ").replace("\n", " ")
    return '"' + "\\n".join(esc(line) for line in lines if line is not None) + '"'


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _memory(estimate) -> dict[str, float]:
    """Device -> bytes from an estimate: a mapping, or an object with `.memory` / `.per_device`.

    Values may be numbers or objects with `total` / `total_bytes` / `peak`.
    """
    if estimate is None:
        return {}
    table = estimate if isinstance(estimate, dict) else \
        getattr(estimate, "memory", None) or getattr(estimate, "per_device", None) or {}
    if not isinstance(table, dict):
        return _memory(table)
    out = {}
    for dev, v in table.items():
        for attr in ("total", "total_bytes", "peak"):
            if not isinstance(v, (int, float)):
                v = getattr(v, attr, v)
        if isinstance(v, (int, float)):
            out[str(dev)] = v
    return out


def _mode_line(seg) -> str | None:
    if seg.mode == "none":
        return None
    opts = seg.options or {}
    extra = [f"{k} {opts[k]}" for k in ("sync", "server", "shard", "dim")
             if opts.get(k) not in (None, "none")]
    reps = opts.get("data", 1)  # a 2-D segment: its replicas, each split by the mode
    if reps > 1:
        t = len(seg.devices) // reps
        runs = " | ".join(", ".join(seg.devices[i:i + t]) for i in range(0, len(seg.devices), t))
        extra.append(f"data x{reps}: {runs}")
    extra += MODES[seg.mode].device_notes(seg)  # what each device holds, where devices differ (expert)
    return f"{seg.mode} x{len(seg.devices) // reps}" + (f" ({', '.join(extra)})" if extra else "")


def _ends(op: Op, plan: Plan) -> tuple[tuple, tuple]:
    """Source and destination devices of a transition op (its src/dst, or read from devices)."""
    if op.src or op.dst:
        return tuple(op.src), tuple(op.dst)
    d = op.devices
    if op.kind == OpKind.SPLIT:
        return d[:1], d[1:]
    if op.kind == OpKind.MERGE:
        return d[:-1], d[-1:]
    if op.kind == OpKind.RESPLIT:
        src = plan.segments[op.segment - 1].devices if op.segment else d
        return tuple(x for x in d if x in src), tuple(x for x in d if x in plan.segments[op.segment].devices)
    return d[:1], d[-1:]


class _Merged:
    """One drawn node for ops that differ only by micro-batch, replica list or phase."""

    def __init__(self, op: Op):
        self.op, self.count, self.bytes, self.bwd_bytes = op, 0, 0, 0
        self.tensors: list[str] = []
        self.phases: list[str] = []
        self.microbatches: set = set()
        self.has_fwd = False

    def add(self, op: Op) -> None:
        self.count += 1
        if op.phase not in self.phases:
            self.phases.append(op.phase)
        if op.phase.startswith("bwd"):
            self.bwd_bytes += op.bytes
        else:
            if not self.has_fwd:
                self.op = op  # label direction and route from the forward op
            self.bytes += op.bytes
            self.has_fwd = True
        if op.microbatch is not None:
            self.microbatches.add(op.microbatch)
        if op.tensor and op.tensor not in self.tensors:
            self.tensors.append(op.tensor)


def _group_ops(plan: Plan):
    """Transitions per consuming segment and collectives per segment, merged for drawing."""
    trans: dict[int, dict] = {}
    colls: dict[int, dict] = {}
    ops = plan.unique_ops()  # each op once, though a copy sits in both its devices' lists
    sends = {(o.devices, o.segment, o.phase, o.tensor, o.microbatch) for o in ops if o.kind == OpKind.SEND}
    key: tuple
    for op in ops:
        if op.kind == OpKind.RECV and (op.devices, op.segment, op.phase, op.tensor, op.microbatch) in sends:
            continue  # the receiving half of a send already drawn
        if op.kind in TRANSITIONS:
            # a backward copy folds into its forward one, micro-batches into one node
            key = (op.kind in P2P, frozenset(op.devices))
            if "of" in op.attrs:  # a module model's crossing tensor (plan/crossings.py): a node each
                key += (op.attrs["of"], op.attrs["leaf"], op.attrs["from"])
            table = trans.setdefault(op.segment, {})
        elif "tie" in op.attrs or "grad_norm" in op.attrs:
            continue  # a tie: the edge between the tied layers (_tie_edges); the gradient norm: 4 bytes
        elif op.kind in COLLECTIVES:
            # one node per collective kind and layer it serves (tensor-parallel pairs, halos, FSDP
            # gathers), gradient buckets of a segment together
            key = (op.kind, op.devices, op.attrs.get("layer"), op.phase if "layer" not in op.attrs else None)
            table = colls.setdefault(op.segment, {})
        else:
            continue
        table.setdefault(key, _Merged(op)).add(op)
    for seg, table in colls.items():  # forward, backward, step: the order they run in
        colls[seg] = dict(sorted(table.items(), key=lambda kv: _PHASE_ORDER.get(kv[1].op.phase, 9)))
    return trans, colls


def _transition_label(m: _Merged, plan: Plan) -> list[str]:
    op = m.op
    head = _NAMES[op.kind] + (f" {op.tensor}" if op.tensor else "")
    if "of" in op.attrs:
        head += f" {op.attrs['of']}[{op.attrs['leaf']}]"
    src, dst = _ends(op, plan)
    if op.kind in (OpKind.SPLIT, OpKind.MERGE, OpKind.RESPLIT):
        dims = {OpKind.SPLIT: (None, op.dst_dim), OpKind.MERGE: (op.src_dim, None),
                OpKind.RESPLIT: (op.src_dim, op.dst_dim)}[op.kind]
        if op.src_dim is None and op.dst_dim is None and op.dim is not None:
            dims = (op.dim, None) if op.kind == OpKind.MERGE else (None, op.dim)
        shown = dims if op.kind == OpKind.RESPLIT else [d for d in dims if d is not None]
        cut = " -> ".join("whole" if d is None else f"dim {d}" for d in shown)
        head += f" ({cut})" if cut else ""
        path = [", ".join(src), ", ".join(dst)]
    else:
        hop = op.route == "via_host" and not any(Device.parse(d).is_host for d in (src[0], dst[0]))
        path = [src[0], Device.parse(src[0]).host, dst[0]] if hop else [src[0], dst[0]]
    lines = [head, " -> ".join(path) + (f" ({op.route})" if op.route else "")]
    n = max(1, len(m.microbatches))
    amounts = [f"{what} {units.size(total / n)}" for what, total, present in
               (("fwd", m.bytes, m.has_fwd), ("bwd", m.bwd_bytes, m.bwd_bytes)) if present]
    lines.append(", ".join(amounts))
    if n > 1:
        lines.append(f"each of {n} micro-batches")
    return lines


def _collective_label(m: _Merged) -> list[str]:
    op = m.op
    what = ", ".join(m.tensors[:3]) + (f", +{len(m.tensors) - 3}" if len(m.tensors) > 3 else "")
    head = f"{_NAMES[op.kind]} {what}".strip()
    if m.phases != ["bwd"]:
        head += f" ({', '.join(m.phases)})"
    root = op.attrs.get("root")
    devs = ", ".join(op.devices)
    if "shard" in op.attrs:  # ZeRO: every device broadcasts the parameters it stepped
        devs = f"each of {devs} to the others"
    elif root is not None:
        others = ", ".join(d for d in op.devices if d != root)
        devs = f"{others} -> {root}" if op.kind == OpKind.REDUCE else f"{root} -> {others}"
    lines = [head, devs, units.size(m.bytes + m.bwd_bytes)]
    if m.count > 1:
        lines[-1] += f" in {m.count} ops"
    return lines


def _anchor(m: _Merged, seg) -> int | None:
    """Index of the segment's layer a collective belongs to: the last one it names."""
    named = []
    for op_tensor in m.tensors + [str(m.op.attrs.get(k, "")) for k in ("layer", "layers")]:
        for name in op_tensor.split(".."):
            if name in seg.layers:
                named.append(seg.layers.index(name))
    return max(named) if named else None


def _h(s) -> str:
    """Text for a graphviz HTML-like label."""
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _head(seg) -> str:
    """`stage 2 · decoder`; the name left out where it only repeats the number (`stage 0 · stage0`)."""
    head = f"stage {seg.stage}" if seg.stage is not None else f"segment {seg.index}"
    plain = "".join(c for c in seg.name.lower() if c.isalnum())
    repeats = {f"{w}{n}" for w in ("stage", "segment", "seg", "s") for n in (seg.index, seg.stage)}
    return head if plain in repeats else f"{head} · {seg.name}"


def _header(seg, fill: str, mem: dict) -> str:
    """The segment's title and one cell per device (each replica or shard visible), with its memory."""
    cells = "".join(f'<TD BGCOLOR="{fill}">{_h(d)}' + (f'<BR/><FONT POINT-SIZE="9">{_h(units.size(mem[d]))}</FONT>'
                                                    if d in mem else "") + "</TD>" for d in seg.devices)
    mode = _mode_line(seg)
    title = f"<B>{_h(_head(seg))}</B>" + (f"<BR/>{_h(mode)}" if mode else "")
    return (f'<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="3" COLOR="#888888">'
            f'<TR><TD BORDER="0" COLSPAN="{len(seg.devices)}">{title}</TD></TR><TR>{cells}</TR></TABLE>>')


def _split(n: int, d: int) -> str:
    """One device's part of n split d ways: `4`, or `6 or 5` when uneven."""
    hi, lo = -(-n // d), n // d
    return str(hi) if hi == lo else f"{hi} or {lo}"


def per_device_shapes(seg, info: dict, microbatches: int = 1) -> dict[str, tuple[tuple, tuple]]:
    """Layer -> (the output shape one device holds, as strings per dim; the whole of it): a micro-batch's
    rows in a pipeline stage, then its rows, band, channels or features in a parallel group."""
    layers = [info[n] for n in seg.layers if n in info and info[n].out_shape]
    reps = (seg.options or {}).get("data", 1)  # a 2-D segment's replicas each take their rows
    d = len(seg.devices) // reps
    out = {}
    for li, cut in zip(layers, MODES[seg.mode].sliced_dims(seg, layers)):
        shape: list = list(li.out_shape)
        if seg.stage is not None and microbatches > 1 and shape:
            shape[0] = -(-shape[0] // microbatches)
        held = [_split(x, d) if k == cut else _split(x, reps) if k == 0 else str(x) for k, x in enumerate(shape)]
        out[li.name] = (tuple(held), tuple(shape))
    return out


def placement_dot(plan: Plan, graph=None, estimate=None) -> str:
    """Graphviz source of the plan's placement graph (deterministic for golden files).

    One box per segment, headed by its devices (so every replica shows) rather than a cluster title
    that edges would cross; shapes are what one device holds."""
    info = {l.name: l for l in graph.layers} if graph is not None else {}
    mem = _memory(estimate)
    roots: dict[str, list] = {}  # parameters no layer owns, shown on the layer that uses them
    for r in getattr(graph, "root_params", ()):
        if r.consumer:
            roots.setdefault(r.consumer, []).append(r)
    trans, colls = _group_ops(plan)
    segs = plan.segments
    title = [f"placement {plan.name}", ", ".join(plan.devices)]
    if plan.schedule:
        title.append(f"pipeline {plan.schedule}, {plan.microbatches} micro-batches")
    if plan.batch_size:
        title.append(f"batch {plan.batch_size}")
    if info:
        title.append("shapes per device" + (" and micro-batch" if plan.schedule else ""))
    if mem:
        title.append("memory: device totals")
    out = ["digraph placement {",
           f"  graph [label={_q(*title)}, labelloc=t, fontname=\"Helvetica\", fontsize=12, "
           "compound=true, newrank=true, nodesep=0.3, ranksep=0.25];",
           "  node [fontname=\"Helvetica\", fontsize=10, shape=box, style=\"rounded,filled\", fillcolor=white];",
           "  edge [fontname=\"Helvetica\", fontsize=9];"]
    in_label = ["input"]
    if graph is not None:
        in_label.append(f"{_shape(graph.input_shape)} {graph.input_dtype}")
    out.append(f"  input [shape=oval, fillcolor=\"#eeeeee\", label={_q(*in_label)}];")

    groups: list[tuple] = []  # one fill colour per device group, shared by its segments
    for seg in segs:
        if tuple(seg.devices) not in groups:
            groups.append(tuple(seg.devices))
    first, last = {}, {}
    for seg in segs:
        i = seg.index
        fill = _FILLS[groups.index(tuple(seg.devices)) % len(_FILLS)]
        shapes = per_device_shapes(seg, info, plan.microbatches)
        out += [f"  subgraph cluster_s{i} {{", "    label=\"\"; style=\"rounded,dashed\"; color=\"#888888\";",
                f"    s{i}_h [shape=plaintext, style=\"\", margin=0, label={_header(seg, fill, mem)}];"]
        nodes = [f"s{i}_l{j}" for j in range(len(seg.layers))] or [f"s{i}_empty"]
        for node, name in zip(nodes, seg.layers or ("(no layers)",)):
            lines = [name]
            if name in info:
                li = info[name]
                lines.append(f"{li.op} · {li.params:,} params" if li.params else li.op)
                lines += [f"+ {r.name} ({r.numel:,})" for r in roots.get(name, ())]
                lines += [f"+ tied {t.name} ({t.numel:,})" for t in getattr(graph, "ties", ())
                          if name in t.layers[1:] and t.layers[0] not in seg.layers]
                if name in shapes:
                    mine, whole = map(_shape, shapes[name])
                    lines.append(f"-> {mine}" + (f" of {whole}" if mine != whole else ""))
            out.append(f"    {node} [fillcolor=\"{fill}\", label={_q(*lines)}];")
        for j, name in enumerate(seg.layers):  # skip connections inside the segment, where traced
            for src in (info[name].inputs or ()) if name in info else ():
                if src in seg.layers[:max(0, j - 1)]:
                    out.append(f"    {nodes[seg.layers.index(src)]} -> {nodes[j]} [style=dotted];")
        first[i], last[i] = f"s{i}_h", nodes[-1]
        for k, m in enumerate(colls.get(i, {}).values()):
            node = f"s{i}_c{k}"
            at = _anchor(m, seg)
            anchor = nodes[-1] if at is None else nodes[at]
            out.append(f"    {node} [shape=hexagon, style=filled, fillcolor=\"#ffe9a8\", "
                       f"label={_q(*_collective_label(m))}];")
            # beside the layer it serves, not on a rank of its own: the graph stays short
            out.append(f"    {anchor} -> {node} [style=dashed, arrowhead=none];")
            out.append(f"    {{rank=same; {anchor}; {node};}}")
        out += [f"    {a} -> {b};" for a, b in zip([f"s{i}_h"] + nodes, nodes)]
        out.append("  }")

    # transitions: prev segment's last layer -> copy / split / merge nodes -> this segment's header
    for i, seg in enumerate(segs):
        prev = last[segs[i - 1].index] if i else "input"
        merged = list(trans.get(seg.index, {}).values())
        if not merged:
            out.append(f"  {prev} -> {first[seg.index]};")
            continue
        # an op follows an earlier one when it sends from where that one delivered (merge, then copy)
        ends = [tuple(map(set, _ends(m.op, plan))) for m in merged]
        feeds = {(j, k) for j in range(len(merged)) for k in range(j + 1, len(merged)) if ends[j][1] & ends[k][0]}
        for j, m in enumerate(merged):
            node = f"t{seg.index}_{j}"
            style = "filled" if m.has_fwd else "filled,dashed"
            out.append(f"  {node} [shape={_SHAPES[m.op.kind]}, style=\"{style}\", fillcolor=\"#f2f2f2\", "
                       f"{_MARGINS.get(m.op.kind, '')}label={_q(*_transition_label(m, plan))}];")
            if "of" in m.op.attrs:  # from the layer that makes it, however many segments back
                frm = plan.segments[m.op.attrs["from"]]
                out.append(f"  s{frm.index}_l{frm.layers.index(m.op.attrs['of'])} -> {node};")
            elif not any(b == j for _, b in feeds):
                out.append(f"  {prev} -> {node};")
            out += [f"  {node} -> t{seg.index}_{k};" for a, k in sorted(feeds) if a == j]
            if not any(a == j for a, _ in feeds):
                out.append(f"  {node} -> {first[seg.index]};")
    out += _tie_edges(plan, graph)
    out.append("  output [shape=oval, fillcolor=\"#eeeeee\", label=\"output / loss\"];")
    out.append(f"  {last[segs[-1].index]} -> output;" if segs else "  input -> output;")
    out.append("}")
    return "\n".join(out) + "\n"


def _tie_edges(plan: Plan, graph) -> list[str]:
    """A tied parameter: a bold two-way edge between the copies' layers, with what keeps them equal."""
    from placer.plan import ties

    out = []
    for t in ties.placed(plan.segments, graph) if graph is not None else ():
        how = f"grads all-reduced, {units.size(t.tie.bytes)}" if len(t.devices) > 1 else "grads summed"
        nodes = [f"s{k}_l{plan.segments[k].layers.index(layer)}" for k, layer, _ in t.copies]
        out += [f"  {a} -> {b} [dir=both, style=bold, color=\"#b03060\", constraint=false, "
                f"label={_q('tied ' + t.tie.name, how)}];" for a, b in zip(nodes, nodes[1:])]
    return out


def render(dot_src: str, fmt: str, engine: str = "dot", pinned: bool = False, path=None) -> bytes:
    """DOT source drawn as `fmt` (svg, png, pdf) by graphviz; PlanError R004 (at `path`, the file asked for)
    when `dot` is missing or fails. `pinned`: every node has its position (neato -n2)."""
    import graphviz

    where = Loc(str(path)) if path is not None else Loc()
    try:
        return graphviz.Source(dot_src, engine=engine).pipe(format=fmt, quiet=True, neato_no_op=2 if pinned else None)
    except graphviz.ExecutableNotFound:
        raise PlanError(Diagnostic("R004", f"graphviz `{engine}` not found: cannot draw a .{fmt} picture",
                                   where, hint=INSTALL)) from None
    except graphviz.CalledProcessError as e:
        lines = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        raise PlanError(Diagnostic("R004", f"graphviz `{engine} -T{fmt}` failed: "
                                   f"{lines[-1] if lines else 'no output'}", where,
                                   hint="report this as a placer bug, with the --dot source")) from None


def write_diagram(dot_src: str, path: str | Path, engine: str = "dot") -> Path:
    """Write DOT source to `path`, by suffix: .dot/.gv as text, .svg/.png/.pdf drawn by graphviz.

    A picture that cannot be drawn is an error (R004), never a silent fallback."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise PlanError(Diagnostic("R001", f"cannot write a diagram as {path.suffix or 'a file without suffix'}",
                                   Loc(str(path)), hint="use a path ending in " + ", ".join("." + f for f in FORMATS)))
    data = dot_src.encode() if fmt in ("dot", "gv") else render(dot_src, fmt, engine, path=path)
    return write_bytes(path, data)


def write_bytes(path: Path, data: bytes) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    except OSError as e:
        raise PlanError(Diagnostic("R002", f"cannot write this file: {e.strerror or e}", Loc(str(path)),
                                   hint="choose a writable path")) from None
    return path
