"""Shared harness for the runtime tests: spawn gloo workers once per test module, run
small "programs" composed from the runtime pieces, compare with a one-process reference.

The runtime pieces are not imported as a package here: every worker pastes them with
``runtime.source(...)`` and execs the text, exactly as a generated program contains them.

`run_program` is the step loop the code generator emits, written once as a loop over
segments instead of unrolled per segment; keep the two in step.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

RUNTIME_DIR = Path(__file__).resolve().parents[2] / "placer" / "codegen" / "runtime"
RTOL, ATOL = 1e-5, 4e-5


def load_runtime_package():
    """placer/codegen/runtime/__init__.py, loaded by path (no placer package import)."""
    spec = importlib.util.spec_from_file_location("placer_runtime", RUNTIME_DIR / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pasted_runtime(names=None) -> dict:
    """The namespace of a program that pasted the given pieces (default: all of them)."""
    runtime = load_runtime_package()
    text = runtime.source(names or runtime.PIECES)
    namespace = {"__name__": "pasted_runtime"}
    exec(compile(text, "<pasted runtime>", "exec"), namespace)
    return namespace


# ---------------------------------------------------------------------------- scenarios


@dataclass
class Segment:
    layers: tuple[int, int]  # [start, stop) indices into Scenario.layers
    ranks: list[int]
    sync: str | None = None  # None (one device) | allreduce | parameter_server | broadcast
    overlap: bool = True  # allreduce: DDP (True) or bucketed all-reduce after backward
    server: int | None = None
    bucket_mb: float = 25.0
    sync_batchnorm: bool = False
    route: str = "direct"  # how this segment's input arrives


@dataclass
class Scenario:
    name: str
    layers: list[tuple]  # (torch.nn class name, *args)
    segments: list[Segment]
    in_shape: tuple = (6,)  # per sample
    loss: str = "MSELoss"  # MSELoss: float targets shaped like the output; else class ids
    classes: int = 4
    batch: int = 12
    steps: int = 3
    seed: int = 0
    lr: float = 0.05
    momentum: float = 0.9
    kwargs: dict = field(default_factory=dict)  # per layer index: kwargs for its class


def build_model(sc: Scenario) -> nn.Sequential:
    torch.manual_seed(sc.seed)
    return nn.Sequential(*[getattr(nn, op)(*args, **sc.kwargs.get(i, {}))
                           for i, (op, *args) in enumerate(sc.layers)])


def activation_shapes(sc: Scenario, model: nn.Sequential) -> list[list[int]]:
    """Full-batch input shape of every segment (codegen knows these from its meta trace;
    here a throwaway copy runs on zeros, which is cheaper than first use of meta)."""
    probe = copy.deepcopy(model).eval()
    h = torch.zeros(sc.batch, *sc.in_shape)
    shapes = []
    with torch.no_grad():
        for seg in sc.segments:
            shapes.append(list(h.shape))
            for i in range(*seg.layers):
                h = probe[i](h)
    shapes.append(list(h.shape))  # output
    return shapes


def global_batch(rt, sc: Scenario, step: int, out_shape):
    g = rt["step_generator"](sc.seed, step)
    x = rt["make_tensor"](g, (sc.batch, *sc.in_shape))
    if sc.loss == "MSELoss":
        y = rt["make_tensor"](g, tuple(out_shape))
    else:
        y = rt["make_tensor"](g, (sc.batch,), torch.int64, sc.classes)
    return x, y


def make_optimizer(sc: Scenario, params):
    return torch.optim.SGD(params, lr=sc.lr, momentum=sc.momentum)


def reference(sc: Scenario) -> dict:
    """One process, whole batch, mean loss: what every placement must reproduce."""
    rt = pasted_runtime(["batch"])
    model = build_model(sc)
    out_shape = activation_shapes(sc, model)[-1]
    opt = make_optimizer(sc, model.parameters())
    loss_fn = getattr(nn, sc.loss)()
    losses = []
    for step in range(sc.steps):
        x, y = global_batch(rt, sc, step, out_shape)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


# ---------------------------------------------------------------------------- one rank


def run_program(rt: dict, sc: Scenario, rank: int) -> dict:
    """A rank's whole training run, composed from the runtime pieces as codegen emits it."""
    full = build_model(sc)  # every rank builds the full model from the seed
    shapes = activation_shapes(sc, full)
    segs = []
    for seg in sc.segments:  # every rank makes every group, in spec order
        group = dist.new_group(seg.ranks)
        sync_ranks = seg.ranks
        if seg.sync == "parameter_server":
            sync_ranks = sorted(set(seg.ranks) | {seg.server})
            sync_group = dist.new_group(sync_ranks)
        else:
            sync_group = group
        module, opt = None, None
        if rank in sync_ranks:  # keep only what this rank holds
            module = nn.Sequential(*[full[i] for i in range(*seg.layers)])
            if seg.sync_batchnorm:
                module = rt["convert_sync_batchnorm_cpu"](module, group)
            params = list(module.parameters())
            owner = {"parameter_server": seg.server, "broadcast": seg.ranks[0]}.get(seg.sync, rank)
            if rank == owner:
                opt = make_optimizer(sc, params)
            if seg.sync == "allreduce" and seg.overlap:
                module = rt["ddp_sum"](module, group, bucket_mb=seg.bucket_mb)
        segs.append(dict(seg=seg, group=group, sync_group=sync_group, sync_ranks=sync_ranks,
                         module=module, params=params if module is not None else [], opt=opt))

    loss_fn = getattr(nn, sc.loss)()
    losses = []
    for step in range(sc.steps):
        x, y = global_batch(rt, sc, step, shapes[-1])  # the whole batch, on every rank
        for p in full.parameters():
            p.grad = None
        for s in segs:
            if s["seg"].sync == "broadcast" and rank in s["seg"].ranks:
                rt["broadcast_sync_before_forward"](s["params"], s["group"], s["seg"].ranks[0],
                                                    s["seg"].bucket_mb)
        # forward, segment by segment; keep (input, output) of each
        acts, h = [], None
        for k, s in enumerate(segs):
            seg = s["seg"]
            if k == 0:
                inp = rt["local_slice"](x, seg.ranks, rank) if rank in seg.ranks else None
            else:
                inp = rt["redistribute"](h, segs[k - 1]["seg"].ranks, seg.ranks, shapes[k],
                                         route=seg.route)
            h = None
            if rank in seg.ranks:
                if k > 0:
                    inp.requires_grad_()
                h = s["module"](inp)
            acts.append((inp, h))
        # loss on the last segment's ranks, scaled by their share of the batch
        loss_local = torch.zeros(())
        last = segs[-1]["seg"]
        if rank in last.ranks:
            tgt = rt["local_slice"](y, last.ranks, rank)
            loss_local = loss_fn(h, tgt) * (h.shape[0] / sc.batch)
        # backward, segments in reverse: output grad in, input grad back to the previous group
        grad = None
        for k in reversed(range(len(segs))):
            seg = segs[k]["seg"]
            inp, out = acts[k]
            if rank in seg.ranks:
                if k == len(segs) - 1:
                    loss_local.backward()
                else:
                    torch.autograd.backward(out, grad)
            if k > 0:
                g_in = inp.grad if rank in seg.ranks else None
                grad = rt["redistribute_grad"](g_in, segs[k - 1]["seg"].ranks, seg.ranks,
                                               shapes[k], route=seg.route)
        # gradient sync and optimizer steps, in spec order
        for s in segs:
            seg = s["seg"]
            if rank not in s["sync_ranks"]:
                continue
            if seg.sync == "parameter_server":
                outside = seg.server not in seg.ranks
                rt["param_server_step"](s["params"], s["opt"], s["sync_group"], seg.server,
                                        seg.bucket_mb, buffers=list(s["module"].buffers()),
                                        buffers_from=seg.ranks[0] if outside else None)
            elif seg.sync == "broadcast":
                rt["broadcast_sync_after_backward"](s["params"], s["opt"], s["group"],
                                                    seg.ranks[0], seg.bucket_mb)
            else:
                if seg.sync == "allreduce" and not seg.overlap:
                    rt["all_reduce_grads"](s["params"], s["group"], seg.bucket_mb)
                s["opt"].step()
        total = loss_local.detach().clone()
        dist.all_reduce(total)  # ranks without the loss add 0
        losses.append(total.item())

    for s in segs:  # broadcast: bring every replica up to the root's final weights
        if s["seg"].sync == "broadcast" and rank in s["seg"].ranks:
            rt["broadcast_sync_before_forward"](s["params"], s["group"], s["seg"].ranks[0],
                                                s["seg"].bucket_mb)
    held = sorted(i for s in segs if s["module"] is not None for i in range(*s["seg"].layers))
    state = {f"{i}.{k}": v.clone() for i in held for k, v in full[i].state_dict().items()}
    return {"losses": losses, "state": state}


# ---------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, jobs, out_dir):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    rt = pasted_runtime()
    results = {}
    for job in jobs:
        t0 = time.perf_counter()
        if isinstance(job, Scenario):
            results[job.name] = run_program(rt, job, rank)
        else:  # (name, function, args): a plain function of (rt, rank, world, *args)
            name, fn, args = job
            results[name] = fn(rt, rank, world, *args)
        dist.barrier()
        results.setdefault("_seconds", {})[job.name if isinstance(job, Scenario) else job[0]] = (
            time.perf_counter() - t0)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, jobs: list, timeout: float = 180.0) -> list[dict]:
    """Run all jobs in one gloo world of `world` ranks; return each rank's results."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.spawn(_worker, args=(world, free_port(), jobs, out_dir), nprocs=world,
                       join=False)
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"ranks still running after {timeout:.0f}s")
        return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]


def check_scenario(sc: Scenario, per_rank: list[dict]) -> None:
    """Losses on every rank, and every parameter/buffer copy any rank holds, equal the
    one-process reference."""
    ref = reference(sc)
    ref_state = ref["state"]
    seen = set()
    for rank, res in enumerate(per_rank):
        got = res[sc.name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                                   rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{sc.name} rank {rank} losses: {m}")
        for key, value in got["state"].items():
            seen.add(key)
            torch.testing.assert_close(value, ref_state[key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{sc.name} rank {rank} {key}: {m}")
    missing = set(ref_state) - seen
    assert not missing, f"{sc.name}: no rank holds {sorted(missing)}"


# ---------------------------------------------------------------------------- plain jobs


def redistribute_cases(rt, rank, world, cases):
    """For each (src, dst, full_shape, dim, route): move known values src -> dst and a
    gradient back; return the failures this rank saw (empty when all exact)."""
    failures = []
    for src, dst, full_shape, dim, route in cases:
        n = 1
        for s in full_shape:
            n *= s
        full = torch.arange(n, dtype=torch.float32).reshape(full_shape)
        x = rt["local_slice"](full, src, rank, dim) if rank in src else None
        got = rt["redistribute"](x, src, dst, full_shape, dim=dim, route=route)
        want = rt["local_slice"](full, dst, rank, dim) if rank in dst else None
        if (got is None) != (want is None) or (got is not None and not torch.equal(got, want)):
            failures.append(f"forward {src}->{dst} dim {dim} {route}: rank {rank} got {got}")
        grad = -got if got is not None else None
        back = rt["redistribute_grad"](grad, src, dst, full_shape, dim=dim, route=route)
        want = rt["local_slice"](-full, src, rank, dim) if rank in src else None
        if (back is None) != (want is None) or (back is not None and not torch.equal(back, want)):
            failures.append(f"backward {src}->{dst} dim {dim} {route}: rank {rank} got {back}")
    return failures
