"""The cost model: each device's predicted time for one training step, and the step's.

It replays the lowered plan's op lists on a hardware profile (`estimate/hardware.py`). Each
device runs its ops in order on one clock:

- compute: per layer, its measured forward and backward where the profile has timed the plan's
  layers at each device's shapes (`Hardware.layer_times`, estimate/layertime.py); else the larger
  of FLOPs / FLOP/s (a convolution's at the profile's conv rates) and bytes in and out / memory
  bandwidth, plus a fixed cost per layer and pass, backward twice the forward (a zero-bubble
  half once), plus the forward again in a recomputed segment's backward; a pipeline's action (one micro-batch) adds the schedule's fixed cost per action;
  a layer the device ran just before in the same pass (the next micro-batch) takes its warm
  time where measured;
- a copy, split, merge or collective starts when every device in it has reached it and ends
  `latency` per message plus the most bytes any one device moves / link bandwidth later (a hop
  through a host at the host's bandwidth); all of its devices wait for it;
- a pipeline send leaves at once; its receive waits until it has arrived;
- an all-reduce's, all-gather's, reduce-scatter's or broadcast's bytes, and a copy's or send's,
  take that kind's measured time by size where the profile has it (`reduce_times`, ...,
  `send_times`: each measured right after compute, as a step meets it), others' the link's
  bandwidth; an
  FSDP2 layer's gathers and scatters take FSDP2's measured time by the layer's size whole, a
  tensor-parallel pair's all-reduces DTensor's by the activation's size;
- a data-parallel all-reduce with `overlap` runs beside the backward, from when its bucket's
  gradients are ready, and the optimizer step waits for it; the part of it the profile's
  `overlap` does not hide (CPU workers: gloo's threads share the cores) delays the device too;
- the optimizer step reads and writes each held parameter, gradient and state buffer once, plus
  a fixed cost per tensor; or as measured (`Hardware.step_times`);
- `accumulate: N` replays each device's op list N times, each micro-step on 1/N of the rows: the
  fixed costs per layer, action and message (pipeline fill and crossings included) repeat N
  times, while the gradient sync, the step and what follows it run once, in the last.

The step is the last device's finish plus a fixed cost per step and the making of its batch
(measured on the cpu profile: `Hardware.batch_s`). The timeline it yields is the
plan's critical path, pipeline bubbles included.
"""
from __future__ import annotations

from dataclasses import dataclass

from placer.device import Device
from placer.estimate.comm import op_moves
from placer.estimate.cost import BACKWARD_FACTOR
from placer.estimate.hardware import CONV_OPS, Hardware, rate, sized_seconds
from placer.model.graph import ModelGraph
from placer.plan.ir import COLLECTIVES, TRANSFERS, Op, OpKind, Plan


@dataclass(frozen=True, kw_only=True)
class DeviceTime:
    device: str
    compute_s: float
    comm_s: float
    """Time this device spends in copies and collectives it waits for (overlapped all-reduce not)."""
    overlapped_s: float
    """All-reduce time that ran beside the backward."""
    step_s: float
    """The optimizer step."""
    finish_s: float
    """When its last op ends; idle time is finish_s - compute_s - comm_s - step_s."""


@dataclass(frozen=True, kw_only=True)
class StepTime:
    hardware: Hardware
    per_device: dict
    """device -> DeviceTime, in plan order."""
    step_s: float
    """The whole step: the last device's finish plus the fixed cost per step and the batch's making."""
    critical: str
    """The device that finishes last."""
    spans: dict
    """device -> ((start, end, op), ...): what the schedule chart draws."""


def compute_seconds(op: Op, plan: Plan, graph: ModelGraph, hw: Hardware, micro_steps: int = 1,
                    again: bool = False) -> float:
    """One COMPUTE op; under accumulate, one of its `micro_steps` (1/N of the rows, every fixed cost).
    `again`: the device ran the same layers in the same pass just before (the next micro-batch),
    so they take their warm times where measured."""
    seg = plan.segments[op.segment]
    share = seg.degree * plan.microbatches * micro_steps
    factor = BACKWARD_FACTOR[op.phase]
    redo = seg.recompute and op.phase in ("bwd", "bwd_input")  # its forward runs again first
    t = 0.0
    for name in plan.chunk_layers(op):
        layer = graph.layer(name)
        timed = hw.layer_times.get((op.segment, name))
        if timed:  # measured at this device's shape, its fixed cost included; a zero-bubble half: half
            fwd, bwd = timed[2:] if again and len(timed) == 4 else timed[:2]
            t += fwd if op.phase == "fwd" else factor / 2 * bwd + redo * fwd
            continue
        flops, conv = layer.flops / share, layer.op in CONV_OPS
        if op.phase == "fwd":
            work = flops / rate(hw, flops, conv=conv) if flops else 0.0
        else:  # a zero-bubble half is half of a whole backward
            work = factor / 2 * 2 * flops / rate(hw, flops, backward=True, conv=conv) if flops else 0.0
            work += redo * flops / rate(hw, flops, conv=conv) if flops else 0.0
        t += max(work, factor * (layer.in_bytes + layer.out_bytes) / share / hw.mem_bw) + hw.layer_overhead
    return t + (hw.action_s if op.microbatch is not None else 0.0)


def comm_seconds(op: Op, hw: Hardware) -> float:
    sent: dict[str, int] = {}
    host = 0
    for a, b, n in op_moves(op):
        if Device.parse(a).is_host != Device.parse(b).is_host:  # a hop to or from a host's memory
            host = max(host, n)
        else:
            sent[a] = sent.get(a, 0) + n
    whole = hw.sharded_times if _sharded(op) else _split_times(op, hw)
    if len(whole) > 1:  # FSDP2's or DTensor's, measured whole by size
        return sized_seconds(whole, hw, op.bytes) + whole[0][1] + 2 * host / hw.host_bw
    most = max(sent.values(), default=0)
    # a collective's bytes at its measured time by size (chunks, the sums on the device)
    table = {OpKind.ALL_REDUCE: hw.reduce_times, OpKind.ALL_GATHER: hw.gather_times,
             OpKind.REDUCE_SCATTER: hw.scatter_times, OpKind.BROADCAST: hw.broadcast_times,
             OpKind.SEND: hw.send_times, **dict.fromkeys(TRANSFERS, hw.send_times)}.get(op.kind, ())
    wire = sized_seconds(table, hw, most)
    return fixed_seconds(op, hw) + wire + 2 * host / hw.host_bw


def fixed_seconds(op: Op, hw: Hardware) -> float:
    """What an op costs whatever its size: a message, or a collective with the machinery around
    it (FSDP2's per-layer gathers, DTensor's activation all-reduce, a bucket of gradients as DDP
    all-reduces it, the program's halo exchange)."""
    if _sharded(op):
        return hw.sharded_times[0][1] if hw.sharded_times else hw.sharded_s
    if split := _split_times(op, hw):
        return split[0][1]
    if op.kind == OpKind.ALL_REDUCE and op.tensor in ("act", "grad"):  # a pair's forward; backward
        return hw.split_grad_s if op.tensor == "grad" and hw.split_grad_s else hw.split_s
    if op.kind == OpKind.HALO and hw.halo_s:
        return hw.halo_s
    if op.kind == OpKind.ALL_REDUCE and op.tensor == "grads" and hw.bucket_s:
        return hw.bucket_s
    if op.kind in COLLECTIVES:
        return hw.collective_s * max(1, len(op.devices) - 1)
    return hw.latency


def _split_times(op: Op, hw: Hardware) -> tuple:
    """A tensor-parallel pair's forward or backward all-reduce: its measured times by size."""
    if op.kind != OpKind.ALL_REDUCE or op.tensor not in ("act", "grad"):
        return ()
    return hw.split_grad_times if op.tensor == "grad" and hw.split_grad_times else hw.split_times


def _sharded(op: Op) -> bool:
    """One of a fully sharded (FSDP2) layer's all-gathers or reduce-scatters."""
    return op.kind in (OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER) and op.tensor in ("params", "grads")


def once_per_step(op: Op) -> bool:
    """Ops that accumulate does not repeat: the gradient sync (DDP's no_sync, FSDP2's gradient sync
    off until the last micro-step), the step and the parameters it sends back; a broadcast of the
    parameters before the first forward."""
    return (op.phase == "step" or op.tensor == "grads"
            or (op.kind == OpKind.BROADCAST and op.tensor == "params"))


def micro_step_seconds(op: Op, hw: Hardware, n: int) -> float:
    """A repeated copy or collective's share of one of n micro-steps: its fixed cost whole, its bytes / n."""
    fixed = fixed_seconds(op, hw)
    return fixed + (comm_seconds(op, hw) - fixed) / n


def micro_steps(plan: Plan, device: str) -> list[tuple[Op, int]]:
    """`device`'s ops as they run in one step: (op, N) for each of accumulate's N replays of an op
    that repeats, (op, 1) for one that runs once, in the last micro-step."""
    n, ops = plan.accumulate, plan.ops.get(device, ())
    return [(op, 1 if once_per_step(op) else n) for i in range(n) for op in ops if i == n - 1 or not once_per_step(op)]


def step_seconds(plan: Plan, graph: ModelGraph, device: str, est, hw: Hardware) -> float:
    """The optimizer step of what `device` holds (its parameters and their state slots), plus a
    fixed cost per parameter tensor (two per layer); measured where the profile has timed it."""
    if device in hw.step_times:
        return hw.step_times[device]
    m = est.per_device[device]
    tensors = sum(2 for s in plan.segments if device in s.devices for l in s.layers if graph.layer(l).params)
    elements = (m.param_bytes + m.optimizer_bytes) / 4  # fp32: the parameters and every state slot
    return elements * hw.update_s + tensors * hw.tensor_overhead


def _overlapped(op: Op, plan: Plan) -> bool:
    seg = plan.segments[op.segment]
    return op.kind == OpKind.ALL_REDUCE and op.tensor == "grads" and bool(seg.options.get("overlap"))


def _key(op: Op) -> tuple:
    return (op.kind, op.segment, op.phase, op.tensor, op.microbatch, op.devices, op.src, op.dst, op.bytes,
            repr(sorted(op.attrs.items())))


def _bucket_ready(op: Op, last_bwd, plan: Plan, graph: ModelGraph) -> float:
    """When an overlapped all-reduce's bucket has all its gradients: backward runs the layers in
    reverse, so the bucket whose first layer is `a` is ready once the layers from `a` on are done."""
    if last_bwd is None:
        return 0.0
    start, end, bwd = last_bwd
    layers = plan.chunk_layers(bwd)
    first = str(op.attrs.get("layers", "")).partition("..")[0]
    if first not in layers:
        return end
    cost = [graph.layer(l).flops + 1 for l in layers]
    done = sum(cost[layers.index(first):]) / sum(cost)
    return start + (end - start) * done


def step_time(plan: Plan, graph: ModelGraph, est, hw: Hardware, own: dict | None = None) -> StepTime:
    """`own`: device -> the Hardware it runs on where it is not `hw` (a CPU beside GPUs, GPUs of two
    kinds): its compute and step at its own rates, a copy or collective at its slowest member's."""
    own = own or {}

    def on(d: str) -> Hardware:
        return own.get(d, hw)

    def slowest(op: Op, n: int, devices) -> float:  # a copy or collective at its slowest member's rates
        kinds = {id(h): h for h in map(on, devices)} if own else {0: hw}
        return max(micro_step_seconds(op, h, n) for h in kinds.values())

    seq = {d: micro_steps(plan, d) for d in plan.devices}
    devices = [d for d in plan.devices if seq[d]]
    clock = {d: 0.0 for d in plan.devices}
    comm_free = {d: 0.0 for d in plan.devices}
    at = {d: 0 for d in plan.devices}
    busy = {d: {"compute": 0.0, "comm": 0.0, "overlapped": 0.0, "step": 0.0} for d in plan.devices}
    spans: dict[str, list] = {d: [] for d in plan.devices}
    arrivals: dict[tuple, list[float]] = {}
    last_bwd: dict[str, tuple | None] = {d: None for d in plan.devices}
    ran: dict[str, set] = {d: set() for d in plan.devices}  # what each device has computed this step

    def run(d: str, seconds: float, what: str, op: Op) -> None:
        spans[d].append((clock[d], clock[d] + seconds, op))
        clock[d] += seconds
        busy[d][what] += seconds

    def advance(d: str) -> bool:
        op, n = seq[d][at[d]]
        k = op.kind
        if k == OpKind.COMPUTE:
            start = clock[d]
            again = (op.segment, op.tensor, op.phase) in ran[d]
            ran[d].add((op.segment, op.tensor, op.phase))
            run(d, compute_seconds(op, plan, graph, on(d), n, again), "compute", op)
            if op.phase in ("bwd", "bwd_weight"):
                last_bwd[d] = (start, clock[d], op)
        elif k == OpKind.STEP:
            clock[d] = max(clock[d], comm_free[d])
            run(d, step_seconds(plan, graph, d, est, on(d)) / max(1, _steps_on(plan, d)), "step", op)
        elif k == OpKind.SEND:
            key = (op.segment, op.phase, op.tensor, op.microbatch, op.src, op.dst)
            arrivals.setdefault(key, []).append(clock[d] + slowest(op, n, (d, *op.dst)))
        elif k == OpKind.RECV:
            key = (op.segment, op.phase, op.tensor, op.microbatch, op.src, op.dst)
            if not arrivals.get(key):
                return False
            arrival = arrivals[key].pop(0)
            if arrival > clock[d]:
                busy[d]["comm"] += arrival - clock[d]
                spans[d].append((clock[d], arrival, op))
                clock[d] = arrival
        elif k in TRANSFERS or k in COLLECTIVES:
            group = [g for g in op.devices if g in clock]
            if any(at[g] >= len(seq[g]) or _key(seq[g][at[g]][0]) != _key(op) for g in group):
                return False
            seconds = slowest(op, n, group)
            if _overlapped(op, plan):
                start = max(max(_bucket_ready(op, last_bwd[g], plan, graph), comm_free[g]) for g in group)
                stolen = (1 - min(on(g).overlap for g in group)) * seconds  # what the backward does not hide: its cores' time
                for g in group:
                    comm_free[g] = start + seconds
                    busy[g]["overlapped"] += seconds - stolen
                    if stolen:
                        busy[g]["comm"] += stolen
                        spans[g].append((clock[g], clock[g] + stolen, op))
                        clock[g] += stolen
            else:
                start = max(clock[g] for g in group)
                for g in group:
                    busy[g]["comm"] += start + seconds - clock[g]
                    spans[g].append((clock[g], start + seconds, op))
                    clock[g] = start + seconds
            for g in group:
                if g != d:
                    at[g] += 1
        at[d] += 1
        return True

    while any(at[d] < len(seq[d]) for d in devices):
        moved = False
        for d in devices:
            while at[d] < len(seq[d]) and advance(d):
                moved = True
        if not moved:
            stuck = {d: seq[d][at[d]][0] for d in devices if at[d] < len(seq[d])}
            raise ValueError(f"the plan's op lists wait on each other: {stuck}")
    finish = {d: max(clock[d], comm_free[d]) for d in plan.devices}
    per = {d: DeviceTime(device=d, compute_s=busy[d]["compute"], comm_s=busy[d]["comm"],
                         overlapped_s=busy[d]["overlapped"], step_s=busy[d]["step"], finish_s=finish[d])
           for d in plan.devices}
    critical = max(plan.devices, key=lambda d: finish[d])
    return StepTime(hardware=hw, per_device=per, step_s=finish[critical] + hw.step_overhead + hw.batch_s, critical=critical,
                    spans={d: tuple(s) for d, s in spans.items()})


def _steps_on(plan: Plan, device: str) -> int:
    return sum(1 for op in plan.ops.get(device, ()) if op.kind == OpKind.STEP)


def workers_per_host(plan: Plan) -> int:
    """The most of the plan's devices on one machine: how many workers share its CPU cores."""
    hosts: dict[str, int] = {}
    for d in plan.devices:
        h = Device.parse(d).host
        hosts[h] = hosts.get(h, 0) + 1
    return max(hosts.values(), default=1)


def pipeline_seconds(plan: Plan, graph: ModelGraph, hw: Hardware):
    """The plan's pipeline timeline in predicted seconds (None without a pipeline)."""
    from placer.estimate.schedule import simulate_plan

    if not plan.schedule:
        return None
    fwd: dict[int, float] = {}
    bwd: dict[int, float] = {}
    transfer = 0.0
    for d in plan.devices:
        for op in plan.ops.get(d, ()):
            stage = plan.segments[op.segment].stage
            if op.kind == OpKind.COMPUTE and stage is not None:
                into = fwd if op.phase == "fwd" else bwd
                if op.phase in ("fwd", "bwd"):
                    into.setdefault(stage, compute_seconds(op, plan, graph, hw))
                elif op.phase == "bwd_input":  # a zero-bubble backward: its two halves
                    into.setdefault(stage, 2 * compute_seconds(op, plan, graph, hw))
            elif op.kind == OpKind.SEND:
                transfer = max(transfer, comm_seconds(op, hw))
    stages = sorted(fwd)
    return simulate_plan(plan, fwd=[fwd[s] for s in stages], bwd=[bwd.get(s, 2 * fwd[s]) for s in stages],
                         transfer=transfer, unit="s")
