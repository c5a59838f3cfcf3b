"""`placer plan`: per-device memory, communication and FLOPs of a spec, and its diagrams.

Imports torch (to build the model on the meta device) only when it runs, so
that `placer validate` stays torch-free. The JSON keys are documented in
docs/plan-json.md and stay stable.
"""
from __future__ import annotations

import dataclasses
import sys
import time

import click

from placer import units
from placer.cli.console import DETAIL, echo, verbosity_options
from placer.cli.options import set_option
from placer.estimate.hardware import CHOICES

JSON_FORMAT = "placer-plan/1"


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in
                             enumerate(zip(r, widths))).rstrip() for r in rows]


def _ends(op) -> str:
    from placer.plan.ir import OpKind

    def side(devs):
        return ",".join(devs)

    if op.src or op.dst:
        return f"{side(op.src)} -> {side(op.dst)}"
    root = op.attrs.get("root")
    if root is not None:
        rest = side(d for d in op.devices if d != root)
        return f"{rest} -> {root}" if op.kind == OpKind.REDUCE else f"{root} -> {rest}"
    return side(op.devices)


def comm_lines(plan, est) -> list[str]:
    """Communication ops, those that differ only by micro-batch or bucket in one row."""
    groups: dict[tuple, list] = {}
    for row in est.comm.rows:
        op = row.op
        tensor = f"tied {op.attrs['tie']}" if "tie" in op.attrs else op.tensor
        tensor += " (recompute)" if op.attrs.get("recompute") else ""
        key = (op.kind.value, op.segment, op.phase, tensor, _ends(op), op.route or "")
        g = groups.setdefault(key, [0, 0, 0])
        g[0] += 1
        g[1] += op.bytes
        g[2] += row.bytes
    rows = [["op", "segment", "phase", "devices", "count", "payload", "moved"]]

    def step_order(item):  # as the step runs: forward in model order, backward in reverse, then steps
        (_, seg, phase, *_), _ = item
        return (0, seg) if phase == "fwd" else (2, seg) if phase == "step" else (1, -seg)

    for (kind, seg, phase, tensor, ends, route), (count, payload, moved) in sorted(groups.items(), key=step_order):
        name = plan.segments[seg].name
        what = f"{kind} {tensor}".strip() + (" via host" if route == "via_host" else "")
        rows.append([what, name, phase, ends, str(count), units.size(payload), units.size(moved)])
    rows.append(["total", "", "", "", str(len(est.comm.rows)), "", units.size(est.comm.total)])
    return _table(rows, {4, 5, 6}) if len(rows) > 2 else ["  (none)"]


def time_lines(st) -> list[str]:
    """The cost model's prediction: each device's step and the whole step."""
    hw = st.hardware
    rows = [["device", "compute", "comm", "overlapped", "optimizer", "idle", "finish"]]
    for d, t in st.per_device.items():
        idle = t.finish_s - t.compute_s - t.comm_s - t.step_s
        rows.append([d] + [units.seconds(x) for x in (t.compute_s, t.comm_s, t.overlapped_s, t.step_s,
                                                      max(0.0, idle), t.finish_s)])
    return (["", f"predicted step time on {hw.name} ({hw.source}): {units.seconds(st.step_s)}, "
             f"{st.critical} finishes last"] + _table(rows, set(range(1, 7)))
            + ["  comm: copies and collectives a device waits for; overlapped: all-reduce beside the "
               "backward; the step adds a fixed cost per step of " + units.seconds(hw.step_overhead)
               + (f" and {units.seconds(hw.batch_s)} to make its batch" if hw.batch_s else "")])


def time_json(st) -> dict:
    return {"hardware": st.hardware.name, "source": st.hardware.source, "step_s": st.step_s,
            "critical": st.critical,
            "devices": [{"device": d, "compute_s": t.compute_s, "comm_s": t.comm_s,
                         "overlapped_s": t.overlapped_s, "optimizer_s": t.step_s, "finish_s": t.finish_s}
                        for d, t in st.per_device.items()]}


def table(plan, graph, est, timeline=None) -> str:
    """The readable report: segments, memory and FLOPs per device, communication, balance."""
    lines = [f"plan {plan.name}: {units.count(graph.total_params, 'parameter')}, "
             f"{units.count(len(plan.segments), 'segment')} on {units.count(len(plan.devices), 'device')}, "
             f"batch {plan.batch_size}"
             + (f" in {plan.accumulate} micro-steps of {plan.batch_size // plan.accumulate}" if plan.accumulate > 1 else "")
             + (f", {plan.precision} autocast" if plan.precision != "fp32" else "")
             + (f", pipeline {plan.schedule} x{plan.microbatches} micro-batches" if plan.schedule else "")]
    lines.append("")
    seg_rows = [["segment", "devices", "mode", "layers"]]
    for s in plan.segments:
        mode = s.mode if s.mode != "none" else ""
        opts = {k: v for k, v in s.options.items() if k in ("sync", "server", "shard", "dim", "data")
                and v not in (None, "none", "allreduce")}
        mode += "".join(f" {k}={v}" for k, v in opts.items())
        mode = f"{mode} recompute".strip() if s.recompute else mode
        where = ",".join(s.devices) + (" (via host)" if s.route == "via_host" and s.index else "")
        layers = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]}..{s.layers[-1]} ({len(s.layers)})"
        seg_rows.append([f"{s.index} {s.name}" + (f" [stage {s.stage}]" if s.stage is not None else ""),
                         where, mode or "-", layers])
    lines += _table(seg_rows, set())
    lines += tie_lines(plan, graph)
    state = f"{est.optimizer_slots} state buffer{'s' if est.optimizer_slots != 1 else ''} per parameter"
    lines += ["", f"memory per device (optimizer {est.optimizer}: {state}"
              + ("" if est.optimizer_known else ", assumed") + ")"]
    rows = [["device", "params", "weights", "grads", "optimizer", "activations", "working", "total", "FLOPs/step"]]
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "working_bytes", "total_bytes")
    for d, e in est.per_device.items():
        rows.append([d, f"{e.params:,}", units.size(e.param_bytes + e.buffer_bytes)]
                    + [units.size(getattr(e, k)) for k in keys[1:]] + [units.si(e.flops)])
    tot = {k: sum(getattr(e, k) for e in est.per_device.values()) for k in keys + ("buffer_bytes", "flops")}
    rows.append(["total", f"{sum(e.params for e in est.per_device.values()):,}",
                 units.size(tot["param_bytes"] + tot["buffer_bytes"])] + [units.size(tot[k]) for k in keys[1:]]
                + [units.si(tot["flops"])])
    lines += _table(rows, set(range(1, 9)))
    lines += [f"  ({d} never holds all its gradients and activations at once: its row adds up to "
              f"{units.size(e.overlap_bytes)} over its peak)" for d, e in est.per_device.items() if e.overlap_bytes > 0]
    lines += ["", "communication per step"] + comm_lines(plan, est)
    lines.append("")
    if est.busiest is None:
        lines.append("balance: no device computes")
    else:
        lines.append(f"balance: busiest {est.busiest} at {est.balance:.2f}x the mean "
                     f"({units.si(est.per_device[est.busiest].flops)} vs {units.si(est.mean_flops)} FLOPs/step)")
    if timeline is not None:
        lines.append(f"pipeline bubble: {timeline.bubble:.1%} of device time (textbook {timeline.textbook:.1%})")
    lines += [f"note: {n}" for n in est.notes]
    return "\n".join(lines)


def tie_lines(plan, graph) -> list[str]:
    """Parameters tied across segments: where each copy is and what keeps them equal."""
    from placer.plan import ties

    placed = ties.placed(plan.segments, graph)
    return ["", "tied parameters (one copy per segment, kept equal)"] + [
        "  " + ties.describe(t, plan.segments) for t in placed] if placed else []


def to_json(plan, graph, est, timeline=None) -> dict:
    """The stable JSON form (docs/plan-json.md)."""
    from placer.plan import ties
    from placer.plan.place import segment_params

    devices = []
    for rank, (d, e) in enumerate(est.per_device.items()):
        devices.append({"device": d, "rank": rank, "params": e.params, "param_bytes": e.param_bytes,
                        "buffer_bytes": e.buffer_bytes, "grad_bytes": e.grad_bytes,
                        "optimizer_bytes": e.optimizer_bytes, "activation_bytes": e.activation_bytes,
                        "step_bytes": e.step_bytes, "data_bytes": e.data_bytes, "comm_bytes": e.comm_bytes,
                        "act_grad_bytes": e.act_grad_bytes, "boundary_bytes": e.boundary_bytes,
                        "backward_bytes": e.backward_bytes, "total_bytes": e.total_bytes, "flops": e.flops, "sent_bytes": e.sent_bytes, "payload_bytes": e.payload_bytes,
                        "recv_bytes": e.recv_bytes})
    ops = [{"kind": r.op.kind.value, "segment": r.op.segment, "phase": r.op.phase, "tensor": r.op.tensor,
            "devices": list(r.op.devices), "src": list(r.op.src), "dst": list(r.op.dst),
            "src_dim": r.op.src_dim, "dst_dim": r.op.dst_dim, "dim": r.op.dim, "microbatch": r.op.microbatch,
            "route": r.op.route, "bytes": r.op.bytes, "moved_bytes": r.bytes, "attrs": r.op.attrs,
            "moves": [list(m) for m in r.moves]} for r in est.comm.rows]
    sum_keys = ("params", "param_bytes", "buffer_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
                "step_bytes", "data_bytes", "comm_bytes", "act_grad_bytes", "boundary_bytes", "backward_bytes", "total_bytes", "flops")
    doc = {
        "format": JSON_FORMAT,
        "name": plan.name,
        "batch_size": plan.batch_size,
        "model_params": graph.total_params,
        "optimizer": {"op": est.optimizer, "state_slots": est.optimizer_slots, "known": est.optimizer_known},
        "pipeline": None if not plan.schedule else {
            "schedule": plan.schedule, "microbatches": plan.microbatches,
            "bubble": round(timeline.bubble, 6) if timeline else None,
            "textbook_bubble": round(timeline.textbook, 6) if timeline else None},
        "segments": [{"index": s.index, "name": s.name, "layers": list(s.layers), "devices": list(s.devices),
                      "mode": s.mode, "options": s.options, "route": s.route, "stage": s.stage,
                      "params": segment_params(s, graph)[0]} for s in plan.segments],
        "devices": devices,
        "totals": {k: sum(x[k] for x in devices) for k in sum_keys},
        "communication": {"total_bytes": est.comm.total, "ops": ops,
                          "pairs": [{"src": a, "dst": b, "bytes": n} for (a, b), n in est.comm.pairs.items()]},
        "balance": {"ratio": round(est.balance, 6), "busiest": est.busiest, "mean_flops": round(est.mean_flops, 3),
                    "max_flops": est.per_device[est.busiest].flops if est.busiest else 0},
        "notes": list(est.notes),
    }
    placed = ties.placed(plan.segments, graph)
    if placed:  # only for a model with parameters tied across segments (docs/plan-json.md)
        doc["ties"] = [{"param": t.tie.name, "numel": t.tie.numel, "bytes": t.tie.bytes, "devices": list(t.devices),
                        "copies": [{"segment": k, "layer": layer, "name": name} for k, layer, name in t.copies]}
                       for t in placed]
    return doc


def build_and_plan(spec, progress=None):
    """(graph, lowered plan, estimate, pipeline timeline or None) of a loaded spec."""
    from placer.estimate.cost import estimate
    from placer.model.build import checked_graph
    from placer.plan.crossings import lockstep
    from placer.plan.lower import lower
    from placer.plan.place import layer_geometry, place
    from placer.spec.check import torch_pipeline_blocker

    t0 = time.perf_counter()
    if progress and not spec.model.inline:
        progress(f"building {spec.model.module} on the meta device ...")
    graph = checked_graph(spec)  # what validate --deep refuses is refused here too
    if progress and not spec.model.inline:
        progress(f"built {len(graph.layers)} layers, {graph.total_params:,} parameters "
                 f"({time.perf_counter() - t0:.1f}s); planning ...")
    plan = lower(place(spec, graph), spec, graph)
    est = estimate(plan, graph, spec.training.optimizer, spec.training.prefetch,
                   lambda name: layer_geometry(spec, name))
    own = torch_pipeline_blocker(spec) or lockstep(spec, plan.segments)  # placer's loops, not torch's schedules
    if spec.pipeline and own and any(o.phase == "bwd_weight" for o in plan.unique_ops()):
        est = dataclasses.replace(est, notes=est.notes + (  # what codegen/loops.py runs, said plainly
            "placer's own loops run this schedule: each I runs the whole backward and each W nothing "
            "(the chart and timeline draw torch's split)",))
    return graph, plan, est, _timeline(plan, graph)


def predict(plan, graph, est, hardware: str, say=lambda msg: None, spec=None):
    """(StepTime, pipeline timeline in seconds or None) on a named hardware profile; on `cpu`,
    with the plan's layers timed on this machine where `spec` is given (its model is built)."""
    from placer.estimate import hardware as hw_profiles
    from placer.estimate.steptime import pipeline_seconds, step_time, workers_per_host

    workers = workers_per_host(plan)
    if hardware == "cpu" and not hw_profiles.is_cached(workers):
        say("measuring this machine's CPU for the cost model (once; cached) ...")
    hw = hw_profiles.profile(hardware, workers)
    if hardware == "cpu" and spec is not None:
        hw = _timed_layers(plan, graph, est, hw, spec, workers, say)
    return step_time(plan, graph, est, hw), pipeline_seconds(plan, graph, hw)


def _timed_layers(plan, graph, est, hw, spec, workers: int, say):
    """`hw` with the plan's layers, optimizer steps and batch timed (estimate/layertime.py)."""
    from placer.estimate import hardware as hw_profiles
    from placer.estimate.layertime import measure

    threads = hw_profiles.threads(workers)
    t = measure(plan, graph, spec, threads, hw_profiles.layers_cache_path(threads), est=est)
    if t.timed:
        say(f"timed {t.timed} of the plan's layers and optimizer steps at each device's shapes in "
            f"{t.seconds:.1f} s ({threads} thread(s); cached)")
    if t.skipped:
        say(f"{len(t.skipped)} not timed, left to the calibrated rates: "
            + ", ".join(f"{name} ({why})" for name, why in t.skipped[:5]) + (" ..." if len(t.skipped) > 5 else ""))
    source = hw.source + ("; the plan's layers timed at each device's shapes" if t.times else "")
    return dataclasses.replace(hw, layer_times=t.times, step_times=t.steps, batch_s=t.batch_s, source=source)


def _timeline(plan, graph):
    if not plan.schedule:
        return None
    from placer.estimate.schedule import simulate_plan

    return simulate_plan(plan, graph)


def _diagrams(plan, graph, est, timeline, dot, svg, png, schedule_path, say) -> None:
    from placer.render import dot as render_dot

    if dot or svg or png:
        src = render_dot.placement_dot(plan, graph, est)
        for path in (dot, svg, png):
            if path:
                say(f"wrote {render_dot.write_diagram(src, path)}")
    if schedule_path:
        if timeline is None:
            say("the spec has no pipeline: no schedule chart written")
            return
        from placer.render import schedule_chart

        say(f"wrote {schedule_chart.write_schedule(timeline, schedule_path)}")


@click.command("plan")
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text: tables for people; json: the stable keys of docs/plan-json.md.")
@click.option("--plan-text", is_flag=True, help="Print the plan IR (ops per device, compact text form) instead.")
@click.option("--dot", type=click.Path(dir_okay=False), help="Write the placement graph as graphviz source.")
@click.option("--svg", type=click.Path(dir_okay=False), help="Render the placement graph as SVG (needs graphviz).")
@click.option("--png", type=click.Path(dir_okay=False), help="Render the placement graph as PNG (needs graphviz).")
@click.option("--schedule", "schedule_path", type=click.Path(dir_okay=False),
              help="Write the pipeline schedule chart: .svg, .png, .pdf (needs graphviz) or .txt.")
@click.option("--deep", is_flag=True, help="Needed for `model.module` specs: building the model on the meta "
              "device RUNS THE USER'S MODEL CODE.")
@click.option("--hardware", type=click.Choice(CHOICES), help="Predict each device's step time and the "
              "whole step on this hardware: `cpu` is measured on this machine (once, about 20 s, then "
              "cached; the spec's own layers and optimizer steps are also timed at each device's shapes, about "
              "a second, cached per layer), the GPUs are their data sheets' figures. The schedule chart's "
              "axis is then in seconds.")
@set_option
@verbosity_options
def command(spec_path, fmt, plan_text, dot, svg, png, schedule_path, deep, hardware, overrides):
    """Plan a spec: memory per device, communication ops and bytes, FLOPs and balance.

    Builds the model on the meta device (no weight memory; `model.module` specs
    need --deep, as that RUNS THE USER'S MODEL CODE), places every segment, lowers the
    plan (copies, splits, collectives, pipeline sends) and estimates one
    training step. Sizes are on the global batch and per step.

    \b
    Examples:
      placer plan specs/mlp_data_allreduce.yaml
      placer plan --deep --format json specs/gpt_1b.yaml > plan.json
      placer plan --plan-text specs/mlp_pipeline_1f1b.yaml
      placer plan specs/mlp_data_allreduce.yaml --set training.batch_size=256
      placer plan --deep --svg out/placement.svg --schedule out/schedule.svg specs/gpt_1b.yaml
      placer plan --hardware cpu specs/mlp_pipeline_1f1b.yaml   # predicted step time

    With `placement: auto` (or none) it plans the placement the search chooses (`placer
    suggest`; scored on --hardware, `cpu` without it) and says which on stderr.

    -q leaves out the progress messages on stderr (the plan itself is the result); -v adds
    how long building and planning took.
    """
    import json

    from placer.cli.main import fail, load_and_warn
    from placer.deps import require_torch
    from placer.diagnostics import Diagnostic, PlacerError, SpecError
    from placer.plan.text import format_plan

    require_torch("placer plan")

    def say(msg: str) -> None:
        echo(f"placer: {msg}", err=True)

    t0 = time.perf_counter()

    try:
        spec = load_and_warn(spec_path, overrides)
        if not spec.model.inline and not deep:  # SPEC.md: user model code runs only with plan --deep
            raise SpecError(Diagnostic(
                "P071", f"model.module {spec.model.module!r} is user code, and planning it runs that code",
                spec.doc.loc(("model", "module")), "pass --deep to build it on the meta device (it runs "
                "the model's __init__ and forward; no weights are allocated)"))
        from placer.search import resolve

        spec, _ = resolve(spec, say, hardware or "cpu")
        graph, plan, est, timeline = build_and_plan(spec, progress=say)
        from placer.cli.main import emit_diagnostics
        from placer.estimate.capacity import over_capacity

        emit_diagnostics(over_capacity(spec, est), "text", file=sys.stderr)
        echo(f"placer: planned in {time.perf_counter() - t0:.2f} s", level=DETAIL, err=True)
        st = None
        if hardware:
            st, seconds = predict(plan, graph, est, hardware, say, spec)
            timeline = seconds or timeline
        _diagrams(plan, graph, est, timeline, dot, svg, png, schedule_path, say)
    except PlacerError as e:
        fail(e, fmt)
    if plan_text:
        click.echo(format_plan(plan), nl=False)
    elif fmt == "json":
        doc = to_json(plan, graph, est, timeline)
        if st:
            doc["time"] = time_json(st)
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(table(plan, graph, est, timeline) + ("\n".join([""] + time_lines(st)) if st else ""))
    sys.exit(0)
