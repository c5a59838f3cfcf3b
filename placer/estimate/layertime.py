"""Timing the plan's own layers on this machine's CPU, at the shapes each device runs them.

Why: a CPU kernel's FLOP/s varies about tenfold with its shape (a Conv2d with 3 input channels
runs at a tenth of the rate of one with 16, a MaxPool2d costs milliseconds for no FLOPs), so the
`cpu` profile's rates by size (`hardware.rate`) cannot predict a layer within 25%. Here each
layer of the plan is built (its real class and arguments, weights drawn at random) and run on
one device's input: the global batch cut as its segment's mode cuts it (`Mode.work_cut`: data
parallelism its rows, spatial its band's rows, a tensor or channel device timed on its share of
the rows), then by the micro-batches and micro-steps. Measured, one worker's threads, a few
repetitions, a low quantile (other work on a shared machine only adds): the forward, and the
forward with its backward (its input's gradient too where the layer's input trains), each
including the fixed cost per call (Python, autograd) that the rate model adds as
`layer_overhead`. Each device's optimizer step is timed too (the spec's optimizer over tensors
of as many elements as it steps: `step_numels`), in place of the profile's Adam update per
element and fixed cost per tensor.

Times are cached per layer signature (the module's repr, which holds its class and arguments,
the input's shape and dtype, whether it trains, the threads, torch's version) under the cpu
profile's cache folder, so a second `placer plan` is instant. A layer that cannot be built or
run alone (a module model's layer that takes several inputs), or that would take longer than
`LAYER_CAP_S`, or once `BUDGET_S` is spent, keeps the rate model, as does an optimizer step over
more than `STEP_CAP` parameters: the caller says how many.
"""
from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import dataclass, field, replace

from placer.estimate.calibrate import low_quantile
from placer.model.graph import INPUT, ModelGraph
from placer.plan.ir import OpKind, Plan

BUDGET_S = 5.0
"""Seconds of timing a plan may spend in all; the layers not yet timed keep the rate model."""
LAYER_CAP_S = 0.25
"""A layer whose first forward takes longer is not timed further (its rates serve)."""
STEP_CAP = 1 << 25
"""A device's optimizer step over more parameters is not timed (their state would take GBs)."""
REPEAT = 11
TIMING = 3
"""How layers and steps are timed, in the cache's keys: a new way times them again."""
FLUSH_BYTES = 32 << 20
"""A buffer written before each timed call, larger than a CPU's caches (L2, most of an L3)."""
_FLUSH: dict = {}  # the buffer, made once


@dataclass(frozen=True)
class Job:
    """One layer as one device of its segment runs it."""

    segment: int
    layer: str
    shape: tuple
    dtype: str
    trains_input: bool
    """Whether its input requires grad (every layer's but one reading the model's input)."""
    repeats: bool = False
    """Also timed warm (`Timings.times`): it runs again right after itself in a step (a
    pipeline's micro-batches, accumulate's micro-steps) and its machine's workers hold less
    than the last-level cache (`fits_cache`), so its weights are still there."""


@dataclass
class Timings:
    times: dict = field(default_factory=dict)
    """(segment, layer) -> (forward seconds, backward seconds) of one call on one device, the
    caches flushed first; then the same warm where it repeats (`Job.repeats`)."""
    steps: dict = field(default_factory=dict)
    """device -> seconds of its optimizer step (every segment's it holds)."""
    batch_s: float = 0.0
    """Seconds to make one step's batch (every rank makes the whole batch)."""
    timed: int = 0
    """Layers and steps measured now (the others came from the cache)."""
    seconds: float = 0.0
    """Time spent measuring."""
    skipped: list = field(default_factory=list)
    """Layers left to the rate model, with why."""


def jobs(plan: Plan, graph: ModelGraph) -> list[Job]:
    """Each (segment, layer) a device computes, with the input one call of it receives."""
    from placer.modes import MODES

    out, seen = [], set()
    for op in plan.unique_ops():
        if op.kind != OpKind.COMPUTE:
            continue
        seg = plan.segments[op.segment]
        cut = dict(MODES[seg.mode].work_cut(seg))
        cut[0] = cut.get(0, 1) * plan.microbatches * plan.accumulate
        for name in plan.chunk_layers(op):
            l = graph.layer(name)
            if (op.segment, name) in seen or not l.in_shape:
                continue
            seen.add((op.segment, name))
            shape = tuple(-(-n // cut.get(i, 1)) for i, n in enumerate(l.in_shape))  # ceil: the larger share
            src = (l.inputs or (None,))[0]
            dtype = graph.input_dtype if src == INPUT else graph.layer(src).out_dtype if src else "float32"
            out.append(Job(op.segment, name, shape, dtype, src != INPUT))
    return out


def _key(module, job: Job, threads: int) -> str:
    import torch

    text = json.dumps([TIMING, repr(module), job.shape, job.dtype, job.trains_input, job.repeats, threads,
                       torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _materialize(module):
    """A meta module's copy on the CPU with random weights (to_empty leaves garbage, and NaNs or
    denormals would time other kernels): every float tensor drawn small, then each submodule's
    own reset_parameters where it has one (BatchNorm's running variance back to 1)."""
    import torch

    m = module.to_empty(device="cpu")
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            if t.is_floating_point():
                t.normal_(0, 0.02)
            else:
                t.zero_()
        for sub in m.modules():
            if callable(getattr(sub, "reset_parameters", None)):
                sub.reset_parameters()
    return m.train()


def _time(module, job: Job) -> tuple[float, ...] | None:
    """(forward, backward) seconds of one call, a low quantile of REPEAT, then the same warm where
    `job.repeats`; None where a forward exceeds LAYER_CAP_S twice in a row (the first may pay a
    kernel's set-up) or the output is no float tensor."""
    import torch

    dtype = getattr(torch, job.dtype)
    if dtype.is_floating_point:
        x = torch.randn(job.shape, dtype=dtype, requires_grad=job.trains_input)
    else:  # token ids: 0 is a valid index for any Embedding
        x = torch.zeros(job.shape, dtype=dtype)
    for _ in range(2):  # a first call may pay a kernel's set-up (oneDNN's primitives): judged again warm
        t0 = time.perf_counter()
        y = module(x)
        if time.perf_counter() - t0 <= LAYER_CAP_S:
            break
    else:
        return None
    if not isinstance(y, torch.Tensor) or not y.is_floating_point():
        return None
    grad = torch.ones_like(y)

    def both():
        module.zero_grad(set_to_none=True)  # as each step of the program starts
        module(x).backward(grad)

    fwd = _low(lambda: module(x))
    cold = (fwd, max(_low(both) - fwd, 0.0))
    if not job.repeats:
        return cold
    warm = _low(lambda: module(x), cold=False)
    return (*cold, warm, max(_low(both, cold=False) - warm, 0.0))


def _low(fn, cold: bool = True) -> float:
    """A low quantile of REPEAT calls of `fn` (other work on the machine only adds), each started
    with the caches flushed where `cold`: in a step the other layers' weights and activations
    pass through them between two calls of a layer, so its own come from memory. Not so for a
    pipeline's next micro-batch, which finds its stage's weights in cache where they fit: timed
    cold throughout, the bench's 1F1B was predicted at 1.26x its measured step."""
    import torch

    if not cold:
        return low_quantile(fn, REPEAT, 5)
    if "buffer" not in _FLUSH:
        _FLUSH["buffer"] = torch.zeros(FLUSH_BYTES // 4)
    flush = _FLUSH["buffer"]
    return low_quantile(fn, REPEAT, 5, before=lambda: flush.add_(1))


def step_numels(plan: Plan, est, model, slots: int) -> dict[str, tuple[int, ...]]:
    """Per device, the elements of each parameter tensor its optimizer steps: its segments'
    trainable tensors (each once), each cut to the share of them the device steps (FSDP2's and
    ZeRO-1's shards: its optimizer state over all of theirs; else its parameters over theirs)."""
    out = {}
    for d in plan.devices:
        seen, full = set(), []
        for seg in plan.segments:
            if d in seg.devices:
                for name in seg.layers:
                    for p in model.get_submodule(name).parameters():
                        if p.requires_grad and id(p) not in seen:
                            seen.add(id(p))
                            full.append(p.numel())
        m, total = est.per_device[d], sum(full)
        if total:
            share = m.optimizer_bytes / (slots * 4 * total) if slots else m.param_bytes / (4 * total)
            out[d] = tuple(max(1, round(n * min(1.0, share))) for n in full if share > 0)
    return out


def _time_step(numels: tuple[int, ...], optimizer) -> float:
    """Seconds of one `optimizer` step (the spec's class and arguments) over 1-D parameters of
    `numels` elements, its state made first."""
    import torch

    params = [torch.nn.Parameter(torch.randn(n) * 0.02) for n in numels]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    kwargs = dict(optimizer.kwargs) | ({"lr": optimizer.lr} if optimizer.lr is not None else {})
    opt = getattr(torch.optim, optimizer.op)(params, **kwargs)
    opt.step()  # its state made
    return _low(opt.step)


def time_batch(spec) -> float:
    """Seconds to make one step's synthetic batch as the program does on every rank (a generator
    seeded for the step, the input and target drawn whole: runtime/batch.py); 0 for a spec's
    own data (its cost is the user's loader's, not known here)."""
    import torch

    from placer.codegen.runtime.batch import make_tensor, step_generator

    if spec.training.data.module is not None:
        return 0.0
    b, m = spec.training.batch_size, spec.model
    tensors = [(t.concrete(b), getattr(torch, t.dtype), (t.high or 2) - (t.low or 0)) for t in (m.input, m.target)]

    def make(step=[0]):  # noqa: B006  (a new step each call, as the program's)
        step[0] += 1
        gen = step_generator(spec.training.seed, step[0])
        for shape, dtype, high in tensors:
            make_tensor(gen, shape, dtype, high)

    return _low(make)


def cache_bytes() -> int:
    """The largest CPU cache's bytes (Linux's sysfs: the last level, shared by the cores); 0
    where unknown."""
    from pathlib import Path

    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return max(sizes, default=0)


def fits_cache(plan: Plan, est) -> dict[str, bool]:
    """device -> whether the workers on its machine together hold less than the last-level cache
    they share (the plan's memory estimate: weights, gradients, optimizer state, activations at
    their peak). Without an estimate, no."""
    from placer.device import Device

    if est is None:
        return {d: False for d in plan.devices}
    llc = cache_bytes()
    held: dict[str, int] = {}
    for d in plan.devices:
        host = Device.parse(d).host
        held[host] = held.get(host, 0) + est.per_device[d].total_bytes
    return {d: held[Device.parse(d).host] <= llc for d in plan.devices}


def measure(plan: Plan, graph: ModelGraph, spec, threads: int, cache_path, budget_s: float = BUDGET_S,
            est=None) -> Timings:
    """Time the plan's layers, each device's optimizer step (given the plan's estimate `est`) and
    the making of a batch with `threads` threads, reading and adding to the cache at `cache_path`
    (a JSON file)."""
    import torch

    from placer.codegen.runtime.host_memory import keep_freed_memory
    from placer.estimate.memory import state_slots
    from placer.model.build import build_module

    keep_freed_memory()  # as the program's workers do: else each call's temporaries fault pages in

    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    out = Timings()
    try:
        model = build_module(spec)  # on the meta device: each layer is copied out to be timed
    except Exception as e:  # noqa: BLE001  (planning built it already: not expected)
        out.skipped.append(("every layer", f"the model does not build here ({type(e).__name__})"))
        return out
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    start = time.perf_counter()
    fits = fits_cache(plan, est)
    repeats = plan.microbatches * plan.accumulate > 1
    try:
        for job in jobs(plan, graph):
            job = replace(job, repeats=repeats and all(fits[d] for d in plan.segments[job.segment].devices))
            try:
                meta = model.get_submodule(job.layer)
                key = _key(meta, job, threads)
                if key in cache:
                    out.times[(job.segment, job.layer)] = tuple(cache[key])
                    continue
                if time.perf_counter() - start > budget_s:
                    out.skipped.append((job.layer, f"the {budget_s:g} s budget was spent"))
                    continue
                got = _time(_materialize(copy.deepcopy(meta)), job)
            except Exception as e:  # noqa: BLE001  (a layer that does not run alone: its rates serve)
                out.skipped.append((job.layer, f"does not run alone ({type(e).__name__})"))
                continue
            if got is None:
                out.skipped.append((job.layer, f"longer than {LAYER_CAP_S:g} s a call, or no float output"))
                continue
            cache[key] = list(got)
            out.times[(job.segment, job.layer)] = got
            out.timed += 1
        opt = spec.training.optimizer
        if est is not None and hasattr(torch.optim, opt.op):
            for d, numels in step_numels(plan, est, model, state_slots(opt)[0]).items():
                if sum(numels) > STEP_CAP:
                    out.skipped.append((f"{d}'s optimizer step", f"over {STEP_CAP:,} parameters"))
                    continue
                text = json.dumps([TIMING, opt.op, opt.lr, opt.kwargs, numels, threads, torch.__version__],
                                  sort_keys=True, default=str)
                key = "step-" + hashlib.sha256(text.encode()).hexdigest()[:24]
                if key not in cache:
                    if time.perf_counter() - start > budget_s:
                        out.skipped.append((f"{d}'s optimizer step", f"the {budget_s:g} s budget was spent"))
                        continue
                    try:
                        cache[key] = _time_step(numels, opt)
                    except Exception as e:  # noqa: BLE001  (arguments it takes only with real parameters)
                        out.skipped.append((f"{d}'s optimizer step", f"does not run alone ({type(e).__name__})"))
                        continue
                    out.timed += 1
                out.steps[d] = cache[key]
        out.batch_s = time_batch(spec)  # a few milliseconds: not cached
    finally:
        torch.set_num_threads(before)
        out.seconds = time.perf_counter() - start
    if out.timed:
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache, indent=0))
            tmp.replace(cache_path)
        except OSError:
            pass  # a read-only home: time them again next time
    return out
