"""Shared harness for the runtime tests: spawn gloo workers once per test module, run
small "programs" composed from the runtime pieces, compare with a one-process reference.

The runtime pieces are not imported as a package here: every worker pastes them with
``runtime.source(...)`` and execs the text, exactly as a generated program contains them.
A worker pastes only the pieces its module names (``world_results(jobs, pieces)``): the
pipelining, FSDP and DTensor imports of the others cost a second or more per worker.

`run_program` is the step loop the code generator emits, written once as a loop over
segments instead of unrolled per segment; keep the two in step.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

RUNTIME_DIR = Path(__file__).resolve().parents[2] / "placer" / "codegen" / "runtime"
RTOL, ATOL = 1e-5, 4e-5
WORLD = 4
BASE_PIECES = ["batch", "transfer"]  # what run_program and global_batch always call


def module_pairs(module) -> list[tuple[str, str]]:
    """The (column, row) Linear pairs among module's children, by placer's one rule."""
    from placer.modes import tensor
    from placer.spec.shapes import op_kind

    names = [n for n, _ in module.named_children()]
    kinds = [op_kind(type(m).__name__) for _, m in module.named_children()]
    return [(names[c], names[r]) for c, r in tensor.pairs(kinds)]


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
    ranks: list[int]  # listed order: slice order
    sync: str | None = None  # None (one device) | allreduce | parameter_server | broadcast
    overlap: bool = True  # allreduce: DDP (True) or bucketed all-reduce after backward
    server: int | None = None
    bucket_mb: float = 25.0
    sync_batchnorm: bool = False
    route: str = "direct"  # how this segment's input arrives
    shard: str = "none"  # allreduce: none | optimizer (ZeRO-1) | full (FSDP2)
    mode: str | None = None  # None (rows, or one device) | channel | tensor: replicated groups

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole activation (channel and tensor groups)."""
        return self.mode in ("channel", "tensor")


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


MLP = [("Linear", 6, 16), ("ReLU",), ("Linear", 16, 16), ("ReLU",), ("Linear", 16, 4)]


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


def segment_module(full: nn.Sequential, layers: tuple[int, int]) -> nn.Sequential:
    """full's layers [start, stop), under their own names (as a generated program's stages)."""
    return nn.Sequential(OrderedDict((str(i), full[i]) for i in range(*layers)))


def held_state(rt, full: nn.Sequential, held, whole: bool = False) -> dict:
    """{"<layer>.<name>": tensor} of the layers `held`. whole: DTensor parameters (tensor
    parallel, FSDP) gathered by unsharded_state_dict, a collective over each one's group."""
    state = {}
    for i in held:
        layer = rt["unsharded_state_dict"](full[i]) if whole else full[i].state_dict()
        state.update({f"{i}.{k}": v.detach().clone() for k, v in layer.items()})
    return state


def is_dtensor(t) -> bool:
    """Without importing DTensor: a worker that never loaded it holds none."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


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
    """A rank's whole training run, composed from the runtime pieces as codegen emits it:
    one-device and data segments (every sync and shard), channel and tensor groups."""
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
        module, opt, params = None, None, []
        if rank in sync_ranks:  # keep only what this rank holds
            module = segment_module(full, seg.layers)
            if seg.sync_batchnorm:
                module = rt["convert_sync_batchnorm_cpu"](module, group)
            if seg.mode == "channel":
                module = rt["ChannelSplit"](module, group, seg.ranks)
            elif seg.mode == "tensor":
                rt["tensor_parallelize"](module, group, module_pairs(module))
            elif seg.shard == "full":
                module = rt["fully_shard_segment"](module, group)
            params = list(module.parameters())
            owner = {"parameter_server": seg.server, "broadcast": seg.ranks[0]}.get(seg.sync, rank)
            if seg.sync == "allreduce" and seg.overlap and seg.shard != "full":
                module = rt["ddp_sum"](module, group, bucket_mb=seg.bucket_mb)
            if seg.shard == "optimizer":  # each rank steps its part, after the summed gradients
                opt = rt["zero_optimizer"](params, group, torch.optim.SGD, lr=sc.lr,
                                           momentum=sc.momentum)
            elif rank == owner and params:
                opt = make_optimizer(sc, params)
        segs.append(dict(seg=seg, group=group, sync_group=sync_group, sync_ranks=sync_ranks,
                         module=module, params=params, opt=opt))
    rep = [seg.replicated for seg in sc.segments]

    loss_fn = getattr(nn, sc.loss)()
    losses = []
    for step in range(sc.steps):
        x, y = global_batch(rt, sc, step, shapes[-1])  # the whole batch, on every rank
        for s in segs:
            if s["module"] is not None:
                s["module"].zero_grad(set_to_none=True)
        for s in segs:
            if s["seg"].sync == "broadcast" and rank in s["seg"].ranks:
                rt["broadcast_sync_before_forward"](s["params"], s["group"], s["seg"].ranks[0],
                                                    s["seg"].bucket_mb)
        # forward, segment by segment; keep (input, output) of each
        acts, h = [], None
        for k, s in enumerate(segs):
            seg = s["seg"]
            if k == 0:
                inp = None
                if rank in seg.ranks:
                    inp = x if rep[0] else rt["local_slice"](x, seg.ranks, rank)
            elif rep[k - 1] or rep[k]:
                inp = rt["redistribute_replicated"](
                    h, segs[k - 1]["seg"].ranks, seg.ranks, shapes[k], src_replicated=rep[k - 1],
                    dst_replicated=rep[k], route=seg.route)
            else:
                inp = rt["redistribute"](h, segs[k - 1]["seg"].ranks, seg.ranks, shapes[k],
                                         route=seg.route)
            h = None
            if rank in seg.ranks:
                if k > 0:
                    inp.requires_grad_()
                h = s["module"](inp)
            acts.append((inp, h))
        # loss on the last segment's ranks, scaled by their share of the batch (a replicated
        # group: every rank holds the whole batch and backpropagates the whole loss)
        loss_local = torch.zeros(())
        last = segs[-1]["seg"]
        if rank in last.ranks:
            tgt = y if rep[-1] else rt["local_slice"](y, last.ranks, rank)
            loss_local = loss_fn(h, tgt) * (h.shape[0] / sc.batch)
        # backward, segments in reverse: output grad in, input grad back to the previous group
        grad = None
        for k in reversed(range(len(segs))):
            seg = segs[k]["seg"]
            inp, out = acts[k]
            if rank in seg.ranks:
                if k == len(segs) - 1:
                    loss_local.backward()
                elif out.requires_grad:  # not so for a first segment without weights
                    torch.autograd.backward(out, grad)
            if k > 0:
                g_in = inp.grad if rank in seg.ranks else None
                prev = segs[k - 1]
                if rep[k - 1] or rep[k]:
                    grad = rt["redistribute_replicated_grad"](
                        g_in, prev["seg"].ranks, seg.ranks, shapes[k], src_replicated=rep[k - 1],
                        dst_replicated=rep[k], route=seg.route)
                else:
                    grad = rt["redistribute_grad"](g_in, prev["seg"].ranks, seg.ranks, shapes[k],
                                                   route=seg.route)
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
                if seg.sync == "allreduce" and not seg.overlap and seg.shard != "full":
                    rt["all_reduce_grads"](s["params"], s["group"], seg.bucket_mb)
                if s["opt"] is not None:
                    s["opt"].step()
        total = loss_local.detach().clone()
        if rep[-1] and rank != last.ranks[0]:
            total.zero_()  # the group's ranks hold the same loss: it counts once
        dist.all_reduce(total)  # ranks without the loss add 0
        losses.append(total.item())

    for s in segs:  # broadcast: bring every replica up to the root's final weights
        if s["seg"].sync == "broadcast" and rank in s["seg"].ranks:
            rt["broadcast_sync_before_forward"](s["params"], s["group"], s["seg"].ranks[0],
                                                s["seg"].bucket_mb)
    out = {"losses": losses, "state": {}, "held": {}, "dtensor_params": False, "zero_params": None}
    for k, s in enumerate(segs):  # in spec order: gathering DTensors is a collective
        seg, module = s["seg"], s["module"]
        if module is None:
            continue
        params = list(module.parameters())  # what this rank holds of segment k, now
        out["held"][k] = sum((p.to_local() if is_dtensor(p) else p).numel() for p in params)
        out["dtensor_params"] |= any(is_dtensor(p) for p in params)
        if seg.shard == "optimizer":  # ZeRO: (parameters this rank steps, all of them)
            out["zero_params"] = (sum(len(g["params"]) for g in s["opt"].optim.param_groups),
                                  len(params))
            out["zero_bucket_view"] = s["opt"].parameters_as_bucket_view
        if seg.mode == "channel":
            rt["channel_unshard"](module)  # the slices back into the full layers
        out["state"].update(held_state(rt, full, range(*seg.layers),
                                       whole=seg.mode == "tensor" or seg.shard == "full"))
    return out


# ---------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, jobs, pieces, out_dir):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    rt = pasted_runtime(BASE_PIECES + list(pieces))
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
    os._exit(0)  # as the generated program does: gloo's threads may abort Python's shutdown


def run_world(jobs: list, pieces, world: int = WORLD, timeout: float = 180.0) -> list[dict]:
    """Run all jobs in one gloo world of `world` ranks whose runtime is BASE_PIECES plus
    `pieces` (and what they import); return each rank's results."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.spawn(_worker, args=(world, free_port(), jobs, pieces, out_dir), nprocs=world,
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


def check_held_slices(scenarios, per_rank: list[dict]) -> None:
    """On every rank of a multi-rank segment: less than the whole segment's weights, and
    the group's holdings together at least all of them."""
    for sc in scenarios:
        model = build_model(sc)
        for k, seg in enumerate(sc.segments):
            if len(seg.ranks) < 2:
                continue
            whole = sum(p.numel() for i in range(*seg.layers) for p in model[i].parameters())
            held = [per_rank[r][sc.name]["held"][k] for r in seg.ranks]
            assert all(n < whole for n in held) and sum(held) >= whole, (sc.name, k, held)


# ---------------------------------------------------------------------------- test modules


def world_results(jobs: list, pieces, world: int = WORLD):
    """A test module's `results` fixture: its jobs (Scenarios for run_program, or (name,
    function, args)) run once in one gloo world that pasted BASE_PIECES plus `pieces`."""
    @pytest.fixture(scope="module", name="results")
    def results():
        return run_world(jobs, pieces, world)
    return results


def training_test(scenarios: list):
    """A test module's test_training_equals_one_device over its scenarios (needs the
    module's `results` fixture): see check_scenario."""
    @pytest.mark.parametrize("scenario", scenarios, ids=lambda sc: sc.name)
    def test_training_equals_one_device(results, scenario):
        check_scenario(scenario, results)
    return test_training_equals_one_device


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


# -- `placer run` as a process, and its workers ---------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]


def placer_run_popen(*args: str, cwd: Path, **kw) -> subprocess.Popen:
    """`placer run ARGS` started in the background from this checkout, with no torchrun
    variables of ours leaking into it (tests may run inside a worker's environment)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", "placer.cli.main", "run", *args], cwd=cwd, env=env, **kw)


def worker(program: Path, rank: int) -> int | None:
    """The pid of rank `rank` of `program` (this test's run directory's, so ours alone)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(program).encode() in (proc / "cmdline").read_bytes() and \
                        f"RANK={rank}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                    return int(proc.name)
            except OSError:
                pass
    return None


# -- `placer run --check` in this process, and what it must show ------------------------------------
# ZeRO partitions whole parameters, the plan an even share of the bytes: within 1% there.
SENT_TOLERANCE = {"mlp_data_shard_optimizer": 0.01, "zero_optimizer": 0.01}


class Checked(NamedTuple):
    program: str  # the generated program's text
    params: dict  # the run's final parameters
    metrics: dict  # its metrics.json
    output: str  # what `placer run` printed


def checked_run(spec: Path, run_dir: Path, *extra: str, rtol: float = RTOL, atol: float = ATOL,
                min_params: int = 10) -> Checked:
    """`placer run SPEC --check`: it passed, and every final parameter is close to the reference's,
    compared here independently of placer.launch.check."""
    import json

    from click.testing import CliRunner

    from placer.cli.main import main

    if "hf_tiny" in spec.read_text():
        pytest.importorskip("transformers")
    result = CliRunner().invoke(main, ["run", str(spec), "--check", "--run-dir", str(run_dir), *extra])
    log = run_dir / "run.log"
    assert result.exit_code == 0, result.output + (log.read_text() if log.exists() else "")
    assert "check passed" in result.stdout
    run_p = torch.load(run_dir / "final_params.pt")
    ref_p = torch.load(run_dir / "reference" / "final_params.pt")
    assert set(run_p) == set(ref_p) and len(ref_p) >= min_params
    for key, value in ref_p.items():
        torch.testing.assert_close(run_p[key], value, rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")
    return Checked((run_dir / "program.py").read_text(), run_p, json.loads((run_dir / "metrics.json").read_text()),
                   result.output)


def assert_every_gradient_compared(run_dir: Path) -> dict:
    """run --check compared the first-step gradient of every parameter it compared (FSDP2's
    gathered whole from the shards, each tied copy under its own name); returns check.json."""
    import json

    check = json.loads((run_dir / "check.json").read_text())
    assert [g["name"] for g in check["grads"]] == [p["name"] for p in check["params"]], check["grads"]
    return check


def assert_sends_what_the_plan_says(name: str, spec: Path, metrics: dict, sets=(), slack: float | None = None) -> None:
    """Each device's bytes per step in the run equal the plan's `payload_bytes`: one definition of
    bytes (the payload handed to torch.distributed, docs/plan-json.md), on groups of any size.
    `sets`: the run's `--set` overrides; `slack`: the share of its bytes a device may be off by
    (default: `name`'s SENT_TOLERANCE, else none). An `expert` group's devices send what their
    routing makes them (the plan's is uniform): their sum equals the plan's (docs/spec.md)."""
    import json

    from click.testing import CliRunner

    from placer.cli.main import main

    overrides = [a for s in sets for a in ("--set", s)]
    planned = CliRunner().invoke(main, ["plan", str(spec), "--format", "json", "--deep", *overrides])
    assert planned.exit_code == 0, planned.output
    steps, doc = len(metrics["losses"]), json.loads(planned.stdout)
    # torch's pipeline stages also exchange two 4-byte handshakes per stage, once, at the first step
    handshakes = 8 * len(doc["segments"]) if doc["pipeline"] else 0
    # each device alone, or an expert group's devices together (a device in several: the union)
    parts: list[set] = [{d["device"]} for d in doc["devices"]]
    for s in doc["segments"]:
        if s["mode"] == "expert":
            joined = set(s["devices"]).union(*(p for p in parts if p & set(s["devices"])))
            parts = [p for p in parts if not p & joined] + [joined]
    planned_bytes = {d["device"]: d["payload_bytes"] * steps for d in doc["devices"]}
    for part in parts:
        sent = sum(metrics["bytes_sent"][d] for d in part)  # over the run, in whole bytes
        want = sum(planned_bytes[d] for d in part)  # (the loss's all-reduce is the progress line's: not counted)
        allowed = max(handshakes * len(part), (SENT_TOLERANCE.get(name, 0) if slack is None else slack) * want)
        assert abs(sent - want) <= allowed, (name, sorted(part), sent / steps, want / steps)
