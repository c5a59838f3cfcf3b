"""The GPU check: placer's CUDA and NCCL paths in one command, for the first session that has a
GPU machine (issue 28, item 3), and its CPU half everywhere else.

    python bench/gpu_check.py                  # every case this machine allows (< 8 min, one H200)
    python bench/gpu_check.py --quick          # fewer steps and repetitions
    python bench/gpu_check.py --cpu-only       # the CPU half alone (what the unit test runs)
    python bench/gpu_check.py --out DIR        # the JSON under DIR (default bench/results/)

Each case runs `placer` (this checkout's, PYTHONPATH) or a bench script as subprocesses under the
case's timeout (the process group killed when it runs past it), so a case that fails, raises or
hangs is recorded and the next one runs. Cases that need more GPUs than the machine has are
skipped with that reason, and so is what no longer fits in --budget. The results go to
DIR/gpu-<host>-<time>.json (every case: status, reason, figures, the tail of a failing run's
output); a summary is printed at the end. Exit 0 when every case that ran passed, 1 otherwise.

A case passes when its commands exit 0: `placer run --check` also needs its check to pass, and a
GPU case must really run on the GPU (`runtime.simulate: never`, and metrics.json says it was not
simulated). The figures beside them are measured, never adjusted, and held against
bench/targets.py's targets for the reader (memory 0.90-1.10, step time 0.75-1.25, parity <= 1.02);
a figure off its target is a finding, not a failed case:

- memory: per device, the plan's `total_bytes` (`placer plan --format json`) over metrics.json's
  `peak_memory`: on a GPU `torch.cuda.max_memory_allocated`, on a CPU worker the most bytes torch's
  CPU allocator held for tensors in the first two steps (`tensor_peak_bytes`, docs/run.md).
- step time: the plan's predicted step (`--hardware`, default h200: the data sheet's figures times
  0.6, placer/estimate/hardware.py) over the measured one: two runs of the spec, the difference of
  their `wall_s` over the difference of their steps (start-up, the first steps' CUDA warm-up and
  the end cancel). CPU workers are not an h200: their figures are recorded without a ratio.
- parity: bench/vs_torch.py --device cuda, the generated program against the hand-written torch
  twin in bench/baselines/ (the median of the back-to-back pairs' ratios).

Tolerance on the GPU: `--check` keeps placer's float32 tolerance (rtol 1e-5, atol 4e-5; bf16 runs
their looser one). That holds only if a GPU computes float32 as float32: TF32 (10-bit mantissa)
matmuls would differ from the reference by ~1e-3. torch leaves TF32 off for matmuls by default
(torch.backends.cuda.matmul.allow_tf32) but on for cuDNN convolutions, and placer's programs set
neither (nothing in placer/ mentions tf32 or deterministic algorithms), so every case runs with
NVIDIA_TF32_OVERRIDE=0 (the CUDA libraries then use no TF32 whatever a program asks) and
CUBLAS_WORKSPACE_CONFIG=:4096:8 (cuBLAS picks reproducible reductions). The programs do not call
torch.use_deterministic_algorithms (no spec option or environment variable turns it on from
outside); the cases' layers (Linear, ReLU, cross-entropy over class indices) have deterministic
CUDA kernels, and a data-parallel run sums its ranks' gradients in another order than the
one-device reference in any case, which the tolerance allows for.

One GPU: placer refuses a device listed twice (S009) and a data group of one device (P021), so
data parallelism and FSDP2 on one GPU run as a CPU worker and a GPU worker (`[cpu, cuda:0]`, gloo);
NCCL between GPUs, and the multi-GPU modes, need two GPUs or more.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from targets import COST, MEMORY, PARITY  # noqa: E402  (bench/ is a folder of scripts, not a package)
from vs_torch import per_step  # noqa: E402

from placer.cli.run_cmd import measured_peak  # noqa: E402

PLACER = [sys.executable, "-c", "from placer.cli.main import main; main()"]
ENV = {"NVIDIA_TF32_OVERRIDE": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""Set for every case (see the docstring: the check's float32 tolerance on a GPU)."""
WARMUP = 5
BUDGET_S = 450.0


class CaseTimeout(Exception):
    pass


@dataclass
class Context:
    """What a case's steps share: its folder, its deadline, the options."""
    work: Path
    deadline: float
    quick: bool = False
    hardware: str = "h200"
    env: dict = field(default_factory=dict)

    def call(self, argv: list[str], name: str) -> tuple[int, str, str]:
        """Run `argv` in the repository root until the case's deadline: (exit code, stdout, stderr).
        Past the deadline its process group is stopped (SIGTERM, then SIGKILL) and CaseTimeout raised."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise CaseTimeout(f"no time left for {name}")
        out, err = self.work / f"{name}.out", self.work / f"{name}.err"
        with open(out, "w") as o, open(err, "w") as e:
            proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=o, stderr=e, start_new_session=True)
            try:
                rc = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                stop(proc)
                raise CaseTimeout(f"{name} ran past the case's timeout") from None
        return rc, out.read_text(errors="replace"), err.read_text(errors="replace")


def stop(proc: subprocess.Popen) -> None:
    """End `proc` and everything it started in its session (torch's launcher, placer's workers):
    SIGTERM (placer run stops its workers), then SIGKILL for whatever of the group is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass
class Case:
    name: str
    half: str
    """"gpu" or "cpu"."""
    what: str
    gpus: int
    """GPUs it needs (0: the CPU half)."""
    run: Callable[[Context], dict]
    """Returns the case's record: `ok` (bool), figures, details; raises to fail."""
    timeout_s: float = 120.0


def tail(text: str, n: int = 3000) -> str:
    return text[-n:]


# ---------------------------------------------------------------------------- placer run cases


def run_case(spec: str, sets: list[str], *, check: bool, gpu: bool, steps: int | None = None,
             short: int | None = None) -> Callable[[Context], dict]:
    """A case of `placer plan` (memory, predicted step) then `placer run` of `spec` with `sets`
    (`steps` of them, or the spec's), and with `short` a second run of that many steps, whose
    difference from the first times the steps between (step_time)."""
    sets = [*sets, f"runtime.simulate={'never' if gpu else 'always'}"]

    def run(ctx: Context) -> dict:
        over = [a for s in sets for a in ("--set", s)]
        rc, out, err = ctx.call([*PLACER, "plan", spec, "--format", "json", "--hardware", ctx.hardware, *over], "plan")
        if rc:
            return {"ok": False, "reason": f"placer plan exited {rc}", "log_tail": tail(out + err)}
        plan = json.loads(out)
        run_dir = ctx.work / "run"
        argv = [*PLACER, "run", spec, "--run-dir", str(run_dir), *over]
        argv += ["--check"] * check + (["--steps", str(steps)] if steps else [])
        rc, out, err = ctx.call(argv, "run")
        record: dict = {"spec": spec, "sets": sets, "command": " ".join(["placer", *argv[len(PLACER):]])}
        problems = [f"placer run exited {rc}"] if rc else []
        shorter = None
        if short and not rc:
            short_dir = ctx.work / "run_short"
            rc2, out2, err2 = ctx.call([*PLACER, "run", spec, "--run-dir", str(short_dir), *over, "--steps", str(short)],
                                       "run_short")
            shorter = _json(short_dir / "metrics.json")
            if rc2:
                problems.append(f"the {short}-step run exited {rc2}")
                out, err = out2, err2
        metrics = _json(run_dir / "metrics.json")
        if metrics:
            record["run"] = {k: metrics.get(k) for k in ("devices", "backend", "simulated", "simulate_reason", "steps")}
            record["memory"] = memory(plan, metrics)
            record["step_time"] = step_time(plan, metrics, run_dir, ctx.hardware, shorter)
        if check:
            record["check"] = _check_summary(run_dir / "check.json")
        if check and not (record["check"] or {}).get("ok"):
            problems.append("the check did not pass" if record["check"] else "no check.json")
        if gpu and metrics and metrics.get("simulated"):
            problems.append(f"it ran simulated on CPU workers: {metrics.get('simulate_reason')}")
        record["ok"] = not problems
        if problems:
            record["reason"] = "; ".join(problems)
            record["log_tail"] = tail(out + err)
        return record

    run.spec, run.sets = spec, sets  # type: ignore[attr-defined]  # for the tests: what it would run
    return run


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _check_summary(path: Path) -> dict | None:
    doc = _json(path)
    if doc is None:
        return None
    keys = ("ok", "rtol", "atol", "problem", "first_bad_step", "first_bad_param", "first_bad_grad",
            "max_loss_abs_diff", "max_param_abs_diff")
    return {k: doc.get(k) for k in keys}


def memory(plan: dict, metrics: dict) -> list[dict]:
    """Per device: the plan's estimate, the run's measured peak (the CUDA allocator's on a GPU, the
    CPU allocator's tensor bytes on a CPU worker: placer run's own figure), and their ratio."""
    peaks = metrics.get("peak_memory") or {}
    rows = []
    for d in plan["devices"]:
        measured, measure = measured_peak(peaks.get(d["device"]) or {})
        row = {"device": d["device"], "planned_bytes": d["total_bytes"], "measured_bytes": measured,
               "measure": measure}
        if measured:
            row["ratio"] = d["total_bytes"] / measured
            row["target"], row["met"] = list(MEMORY), MEMORY[0] <= row["ratio"] <= MEMORY[1]
        else:
            row["ratio"] = None
            row["note"] = "no tensor peak measured (a run of fewer than one step, or an older program)"
        rows.append(row)
    return rows


def step_time(plan: dict, metrics: dict, run_dir: Path, hardware: str, shorter: dict | None = None) -> dict:
    """The plan's predicted step against the measured one: the difference of two runs' `wall_s`
    (each ends after the GPU is done: the program reads the last losses) over the difference of
    their steps, so start-up, the first steps' warm-up and the end cancel, whenever the host
    notes a step's end (the generated program copies each step's loss to the host, which waits
    for the step's kernels; a step's end noted before that would be when it was queued). Without
    the shorter run, CPU workers take the median step-to-step interval after WARMUP steps, as
    bench/vs_torch.py does; that host's view (`host_median_s`) is kept either way."""
    predicted = (plan.get("time") or {}).get("step_s")
    row: dict = {"hardware": hardware, "predicted_s": predicted, "measured_s": None, "method": None, "ratio": None}
    try:
        records = [json.loads(line) for line in (run_dir / "progress.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        records = []
    ends = [r["elapsed_s"] for r in records if "step" in r and "elapsed_s" in r]
    if len(ends) >= WARMUP + 4:  # per_step leaves out the warm-up and the last step, and takes quantiles
        row["host_median_s"], row["host_p10_s"] = per_step(ends, WARMUP)
    on_gpu = not metrics.get("simulated") and any(str(d).split("/")[-1].startswith("cuda")
                                                  for d in metrics.get("devices") or [])
    steps = (metrics.get("steps_trained"), (shorter or {}).get("steps_trained"))
    if shorter and steps[0] and steps[1] and steps[0] > steps[1]:
        row["measured_s"] = (metrics["wall_s"] - shorter["wall_s"]) / (steps[0] - steps[1])
        row["method"] = f"(wall_s of {steps[0]} steps - wall_s of {steps[1]}) / {steps[0] - steps[1]}"
    elif not on_gpu and "host_median_s" in row:
        row["measured_s"], row["method"] = row["host_median_s"], f"median step interval after {WARMUP} steps"
    else:
        row["note"] = (f"{len(ends)} steps in one run: a GPU step needs two runs" if on_gpu else
                       f"{len(ends)} steps: too few for a step time (needs {WARMUP + 4})")
        return row
    if not on_gpu:
        row["note"] = f"ran on CPU workers: the {hardware} profile does not predict them"
    elif row["measured_s"] <= 0:
        row["note"] = "the longer run took no longer than the shorter: start-up varied more than the steps took"
    elif predicted:
        row["ratio"] = predicted / row["measured_s"]
        row["target"], row["met"] = list(COST), COST[0] <= row["ratio"] <= COST[1]
    return row


# ---------------------------------------------------------------------------- parity


def parity_case(modes: str, device: str) -> Callable[[Context], dict]:
    """bench/vs_torch.py for `modes` on `device`: the generated program against its torch twin."""

    def run(ctx: Context) -> dict:
        # a GPU step of the bench's MLP is a millisecond or so: more steps, and a longer warm-up
        # past the first steps' CUDA start-up and autotuning
        steps, warmup, reps = {("cpu", True): (14, 3, 1), ("cpu", False): (30, 5, 2),
                               ("cuda", True): (100, 20, 2), ("cuda", False): (200, 40, 3)}[device, ctx.quick]
        out = ctx.work / "parity.json"
        argv = [sys.executable, "bench/vs_torch.py", "--device", device, "--modes", modes, "--reps", str(reps),
                "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
        rc, so, se = ctx.call(argv, "vs_torch")
        record: dict = {"command": " ".join(["python", *argv[1:]])}
        doc = _json(out)
        if rc or doc is None:
            return {**record, "ok": False, "reason": f"bench/vs_torch.py exited {rc}", "log_tail": tail(so + se)}
        record["parity"] = {}
        for mode, r in doc["modes"].items():
            record["parity"][mode] = {
                "generated_median_s": r["generated_median_s"], "torch_median_s": r["torch_median_s"],
                "ratio": r["ratio"], "paired_ratio_median": r["paired_ratio_median"], "p10_ratio": r["p10_ratio"],
                "target": PARITY, "met": r["paired_ratio_median"] <= PARITY}
        record["machine"] = doc["machine"]
        record["ok"] = True
        return record

    run.modes, run.device = modes.split(","), device  # type: ignore[attr-defined]
    return run


# ---------------------------------------------------------------------------- the cases


def data_sets(devices: list[str], shard: str | None = None) -> list[str]:
    """--set values that place the whole MLP (fc1..head) data-parallel over `devices`."""
    mode = f"{{mode: data, shard: {shard}}}" if shard else "data"
    group = ", ".join(devices)
    return [f"devices=[{group}]", f"placement=[{{layers: fc1..head, devices: [{group}], parallel: {mode}}}]"]


def cases(quick: bool) -> list[Case]:
    steps, short = (20, 5) if quick else (40, 10)
    one_gpu = ["devices=[cuda:0]", "placement=[{layers: fc1..head, device: cuda:0}]"]
    two = ["cuda:0", "cuda:1"]
    mixed = ["cpu", "cuda:0"]
    wide = "bench/specs_gpu/wide.yaml"
    return [
        # the CPU half: the same machinery on simulated devices (CI runs it)
        Case("cpu-check-mixed", "cpu", "cpu + cuda:0 layer-wise as CPU workers, run --check of 10 steps",
             0, run_case("specs/mlp_cpu_gpu_mixed.yaml", ["training.steps=10"], check=True, gpu=False), 120),
        Case("cpu-measure-single", "cpu", "the bench's MLP on one CPU worker, 10 and 4 steps: step time",
             0, run_case("bench/specs_gpu/single.yaml", [], check=False, gpu=False, steps=10, short=4), 120),
        Case("cpu-parity-data", "cpu", "data parallel (DDP) generated vs hand-written, 2 gloo workers",
             0, parity_case("data", "cpu"), 180),
        # one GPU
        Case("check-mixed", "gpu", "cpu + cuda:0 layer-wise (gloo, copies via the host), run --check",
             1, run_case("specs/mlp_cpu_gpu_mixed.yaml", [], check=True, gpu=True)),
        Case("check-single", "gpu", "the whole MLP on cuda:0, run --check (reference on cuda:0)",
             1, run_case("specs/mlp_single_device.yaml", one_gpu, check=True, gpu=True)),
        Case("check-data-mixed", "gpu", "data parallel (DDP) over cpu + cuda:0 (gloo), run --check",
             1, run_case("specs/mlp_data_allreduce.yaml", data_sets(mixed), check=True, gpu=True)),
        Case("check-fsdp2-mixed", "gpu", "FSDP2 (shard: full) over cpu + cuda:0 (gloo), run --check",
             1, run_case("specs/mlp_data_shard_full.yaml", data_sets(mixed, "full"), check=True, gpu=True)),
        Case("measure-wide", "gpu", f"50 M-parameter MLP on cuda:0, fp32, {steps} and {short} steps: memory, step time",
             1, run_case(wide, [], check=False, gpu=True, steps=steps, short=short), 150),
        Case("measure-wide-bf16", "gpu", f"the same under bf16 autocast, {steps} and {short} steps: memory, step time",
             1, run_case(wide, ["training.precision=bf16"], check=False, gpu=True, steps=steps, short=short), 150),
        Case("parity-single", "gpu", "one GPU: generated vs a plain torch loop (bench/baselines/single.py)",
             1, parity_case("single", "cuda"), 240),
        # two GPUs or more: NCCL
        Case("check-layerwise-nccl", "gpu", "cuda:0 -> cuda:1 layer-wise, direct copies (NCCL), run --check",
             2, run_case("specs/mlp_layerwise_direct.yaml", [], check=True, gpu=True)),
        Case("check-data-nccl", "gpu", "data parallel (DDP) over cuda:0, cuda:1 (NCCL), run --check",
             2, run_case("specs/mlp_data_allreduce.yaml", data_sets(two), check=True, gpu=True)),
        Case("check-fsdp2-nccl", "gpu", "FSDP2 (shard: full) over cuda:0, cuda:1 (NCCL), run --check",
             2, run_case("specs/mlp_data_shard_full.yaml", [], check=True, gpu=True)),
        Case("check-transitions", "gpu", "cpu -> data over cuda:0, cuda:1 -> cpu (gloo), run --check",
             2, run_case("specs/mlp_group_transitions.yaml", [], check=True, gpu=True)),
        Case("measure-wide-data", "gpu", f"the wide MLP data parallel over cuda:0, cuda:1, {steps} and {short} steps",
             2, run_case(wide, data_sets(two), check=False, gpu=True, steps=steps, short=short), 150),
        Case("measure-wide-fsdp2", "gpu", f"the wide MLP FSDP2 over cuda:0, cuda:1, {steps} and {short} steps",
             2, run_case(wide, data_sets(two, "full"), check=False, gpu=True, steps=steps, short=short), 150),
        Case("parity-data-nccl", "gpu", "DDP, ZeRO-1, FSDP2 generated vs hand-written on 2 GPUs (NCCL)",
             2, parity_case("data,zero1,fsdp2", "cuda"), 300),
    ]


# ---------------------------------------------------------------------------- running them


def gpus() -> tuple[int, list[str], str | None]:
    """(count, names, why none) of this machine's GPUs as torch sees them."""
    try:
        import torch
    except ImportError as e:
        return 0, [], f"torch does not import: {e}"
    if not torch.cuda.is_available():
        cuda = torch.version.cuda
        return 0, [], "torch.cuda.is_available() is False" + ("" if cuda else f" (torch {torch.__version__} is a CPU build)")
    n = torch.cuda.device_count()
    return n, [torch.cuda.get_device_name(i) for i in range(n)], None


def run_cases(todo: list[Case], have: int, *, work: Path, budget_s: float, quick: bool = False,
              hardware: str = "h200", cpu_only: bool = False, none_why: str | None = None,
              say: Callable[[str], None] = print,
              done: Callable[[list[dict]], object] = lambda results: None) -> list[dict]:
    """Run every case this machine allows, each isolated under its timeout; a record for each,
    `done` called with the records so far after each case that ran."""
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    end = time.monotonic() + budget_s
    results = []
    for case in todo:
        record: dict = {"name": case.name, "half": case.half, "what": case.what, "gpus_needed": case.gpus}
        left = end - time.monotonic()
        if case.gpus > have:
            why = f" ({none_why})" if none_why and have == 0 else ""
            record.update(status="skipped", reason=f"needs {case.gpus} GPU(s), {have} found{why}")
        elif cpu_only and case.gpus:
            record.update(status="skipped", reason="--cpu-only")
        elif left < min(30.0, case.timeout_s):
            record.update(status="skipped", reason=f"the check's time budget ({budget_s:.0f} s) is spent")
        else:
            say(f"-- {case.name}: {case.what}")
            folder = work / case.name
            folder.mkdir(parents=True)
            ctx = Context(folder, time.monotonic() + min(case.timeout_s, left), quick, hardware, env)
            t0 = time.monotonic()
            try:
                out = case.run(ctx)
                record.update(out, status="passed" if out.get("ok") else "failed")
            except CaseTimeout as e:
                record.update(status="timeout", reason=f"{e} ({min(case.timeout_s, left):.0f} s)")
            except Exception as e:  # a bug in the case itself must not stop the others
                record.update(status="error", reason=f"{type(e).__name__}: {e}", log_tail=tail(traceback.format_exc()))
            record.pop("ok", None)
            record["seconds"] = round(time.monotonic() - t0, 1)
            say(f"   {record['status']} in {record['seconds']} s" + (f": {record['reason']}" if record.get("reason") else ""))
        results.append(record)
        if "seconds" in record:
            done(results)
    return results


def figures(results: list[dict]) -> list[tuple[str, str, float, str, bool]]:
    """(case, figure, value, target, met) of every compared figure."""
    rows = []
    for r in results:
        for m in r.get("memory") or []:
            if m.get("ratio") is not None:
                rows.append((r["name"], f"memory {m['device']} planned/measured", m["ratio"], "0.90-1.10", m["met"]))
        st = r.get("step_time") or {}
        if st.get("ratio") is not None:
            rows.append((r["name"], f"step predicted ({st['hardware']})/measured", st["ratio"], "0.75-1.25", st["met"]))
        for mode, p in (r.get("parity") or {}).items():
            rows.append((r["name"], f"parity {mode} generated/torch", p["paired_ratio_median"], f"<= {PARITY}", p["met"]))
    return rows


def detail(r: dict) -> str:
    """What a case that passed measured, in a few words."""
    parts = []
    if r.get("check"):
        c = r["check"]
        parts.append(f"check passed (max |loss diff| {c['max_loss_abs_diff']:.2g}, "
                     f"max |param diff| {c['max_param_abs_diff']:.2g})")
    if r.get("run"):
        parts.append(f"{r['run']['backend']}{', simulated' if r['run']['simulated'] else ''}")
    st = r.get("step_time") or {}
    if st.get("measured_s"):
        predicted = f", predicted {st['predicted_s'] * 1e3:.2f} ms" if st.get("ratio") is not None else ""
        parts.append(f"step {st['measured_s'] * 1e3:.2f} ms{predicted}")
    for mode, p in (r.get("parity") or {}).items():
        parts.append(f"{mode}: generated {p['generated_median_s'] * 1e3:.2f} ms, torch {p['torch_median_s'] * 1e3:.2f} ms")
    return "; ".join(parts)


def summary(results: list[dict], machine: dict) -> str:
    counts = {s: sum(r["status"] == s for r in results) for s in ("passed", "failed", "timeout", "error", "skipped")}
    gpu = f"{len(machine['gpus'])} GPU(s): {', '.join(machine['gpus'])}" if machine["gpus"] else "no GPU"
    lines = [f"\nGPU check on {machine['host']} ({gpu}; torch {machine['torch']}): "
             + ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
    for r in results:
        if r["status"] == "skipped":
            continue
        lines.append(f"  {r['name']:<22} {r['status']:<8} {r['seconds']:6.1f} s  {r.get('reason') or detail(r)}")
    rows = figures(results)
    if rows:
        lines.append("figures (measured; targets as bench/targets.py's, for the reader, not pass/fail):")
        lines += [f"  {c:<22} {what:<36} {v:7.3f}  {t:<10} {'yes' if met else 'NO'}" for c, what, v, t, met in rows]
    skipped = [r for r in results if r["status"] == "skipped"]
    if skipped:
        lines.append(f"skipped {len(skipped)}:")
        lines += [f"  {r['name']:<22} {r['reason']}" for r in skipped]
    return "\n".join(lines)


def machine_info(n: int, names: list[str], why: str | None) -> dict:
    info = {"host": socket.gethostname() or platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "gpus": names, "no_gpu_reason": why, "env": ENV}
    try:
        import torch

        info["torch"], info["cuda"] = torch.__version__, torch.version.cuda
        if n:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            info["tf32_matmul_default"] = torch.backends.cuda.matmul.allow_tf32
            info["tf32_cudnn_default"] = torch.backends.cudnn.allow_tf32
    except Exception as e:  # what torch cannot say is recorded, not fatal
        info.setdefault("torch", f"unknown ({type(e).__name__}: {e})")
    return info


PREFLIGHT = ("import click, yaml, jsonschema, rich, numpy, torch, placer.cli.main\n"
             "from ruff.__main__ import find_ruff_bin\nfind_ruff_bin()")
"""What every case needs: placer's packages (ruff formats the generated programs)."""


def preflight() -> str | None:
    """Why placer cannot run here (a package missing), or None."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, "-c", PREFLIGHT], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        return "importing placer and torch ran past 120 s"
    if proc.returncode:
        return f"importing placer's packages failed: {tail(proc.stderr.strip(), 1500)}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--out", type=Path, default=BENCH / "results", help="folder of the result JSON (default bench/results)")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    parser.add_argument("--cpu-only", action="store_true", help="run the CPU half only, even where there are GPUs")
    parser.add_argument("--only", help="comma-separated case names to run (the others are left out)")
    parser.add_argument("--hardware", default="h200", help="the data-sheet profile that predicts the step (default h200)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for all cases (default {BUDGET_S:.0f})")
    parser.add_argument("--keep", type=Path, help="keep each case's run directory and output under this folder")
    args = parser.parse_args(argv)
    todo = cases(args.quick)
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {c.name for c in todo})
        if unknown:
            parser.error(f"unknown cases {unknown}; the cases are {', '.join(c.name for c in todo)}")
        todo = [c for c in todo if c.name in names]
    n, names, why = gpus()
    machine = machine_info(n, names, why)
    print(f"GPU check: {len(names)} GPU(s) {names or ''}{f' ({why})' if why else ''}; torch {machine.get('torch')}", flush=True)
    started = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"gpu-{machine['host']}-{started}.json"
    broken: str | None = None

    def write(results: list[dict], finished: bool = False) -> bool:
        """The JSON of the cases so far (after each one: a session cut short keeps what ran)."""
        ran = [r for r in results if r["status"] != "skipped"]
        ok = not broken and all(r["status"] == "passed" for r in ran)
        doc = {"what": "bench/gpu_check.py: placer's CUDA and NCCL paths (issue 28, item 3)", "started": started,
               "finished": finished, "machine": machine, "quick": args.quick, "cpu_only": args.cpu_only,
               "hardware": args.hardware, "preflight": broken, "passed": ok, "ran": len(ran),
               "skipped": len(results) - len(ran), "cases": results,
               "figures": [dict(zip(("case", "figure", "value", "target", "met"), f)) for f in figures(results)]}
        out.write_text(json.dumps(doc, indent=2) + "\n")
        return ok

    with tempfile.TemporaryDirectory(prefix="placer-gpu-check-") as tmp:
        work = args.keep / started if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        broken = preflight()
        if broken:
            print(f"placer cannot run here, so no case was started: {broken}\n"
                  "hint: pip install -r requirements-dev.txt -e . ; without internet, beforehand with the same "
                  "Python: pip install --target .gpu-deps click PyYAML jsonschema rich ruff graphviz, "
                  "then PYTHONPATH=$PWD/.gpu-deps")
            todo = []
        results = run_cases(todo, n, work=work, budget_s=args.budget, quick=args.quick, hardware=args.hardware,
                            cpu_only=args.cpu_only, none_why=why, say=lambda m: print(m, flush=True), done=write)
    ok = write(results, finished=True)
    print(summary(results, machine))
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
