"""Generated programs against hand-written torch: the steady-state time per step of the program
placer generates for each spec in bench/specs/ and of its plain-torch twin in bench/baselines/
(same model, batch, optimizer, data, steps, gloo, one worker per rank with
max(1, cores // local_world_size) threads), run side by side with interleaved repetitions.

    python bench/vs_torch.py                           # every mode, 5 repetitions, 30 steps
    python bench/vs_torch.py --modes layerwise,data --reps 8 --steps 40
    python bench/vs_torch.py --device cuda --modes single,data --steps 100 --warmup 20

Each run's workers are started directly (RANK, WORLD_SIZE, ... as torchrun sets them, with
OMP_NUM_THREADS=1 as torchrun does), so start-up is left out; inside the run, rank 0 notes the
time at the end of every step (the generated program in progress.jsonl, the baseline in its
--out file). A run's time per step is the median of its step-to-step intervals after --warmup
steps; a mode's is the median over repetitions, and its ratio is generated / hand-written (and
the median of the per-repetition ratios; p10: the same of each run's 10th-percentile interval,
the figure least disturbed by other work on a shared machine). Prints a table and writes bench/results/vs_torch-*.json.

`--device cuda` runs both on GPUs (rank r on GPU r, NCCL): each spec's devices become cuda:N
and the baselines run with BENCH_DEVICE=cuda (the modes of CUDA_MODES). There a run's figure is
its mean step from the end of the warm-up to the run's end after the GPU is done (the generated
program's `wall_s`, after it reads the last losses; the baseline's, after
torch.cuda.synchronize()), which does not depend on when the host notes a step's end: a step
noted once queued, before the GPU ran it, would look short. The p10 stays the host's view. `single` (one device,
bench/specs_gpu/single.yaml against bench/baselines/single.py) is run only when named.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

# mode -> (spec under bench/specs, baseline under bench/baselines, what the baseline uses)
MODES = {
    "data": ("data.yaml", "data_ddp.py", "DistributedDataParallel"),
    "zero1": ("zero1.yaml", "zero1.py", "DDP + ZeroRedundancyOptimizer"),
    "fsdp2": ("fsdp2.yaml", "fsdp2.py", "fully_shard per Linear, then the model"),
    "1f1b": ("pipeline_1f1b.yaml", "pipeline_1f1b.py", "torch.distributed.pipelining Schedule1F1B"),
    "layerwise": ("layerwise.yaml", "layerwise.py", "dist.send / dist.recv between two ranks"),
    "tensor": ("tensor.yaml", "tensor.py", "DTensor ColwiseParallel / RowwiseParallel"),
    "spatial": ("spatial.yaml", "spatial.py", "halo rows by batch_isend_irecv, autograd.Function"),
    "single": ("../specs_gpu/single.yaml", "single.py", "a plain training loop on one device"),
}
DEFAULT_MODES = [m for m in MODES if m != "single"]
WORLD = 2  # every bench spec has two devices but single's
WORLDS = {"single": 1}
CUDA_MODES = ("single", "data", "zero1", "fsdp2")
"""The modes whose baselines run on GPUs too (BENCH_DEVICE=cuda)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], cwd: Path, log: Path, tries: int = 2, world: int = WORLD, env: dict | None = None) -> None:
    """Run `python argv` as `world` workers of one group, as torchrun would start them. A run
    that fails is run again once, and says so (the baselines leave with os._exit, as placer's
    programs do: Python's shutdown while gloo's threads free tensors now and then aborts)."""
    for attempt in range(tries):
        codes = _workers(argv, cwd, log, world, env or {})
        if not any(codes):
            return
        if attempt + 1 < tries:
            print(f"  {Path(argv[0]).name} failed ({codes}); running it again", flush=True)
    raise SystemExit(f"{' '.join(argv)} failed ({codes}); its output:\n{log.read_text()[-3000:]}")


def _workers(argv: list[str], cwd: Path, log: Path, world: int, extra: dict) -> list[int]:
    port, procs = free_port(), []
    with open(log, "w") as out:
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", **extra)
            procs.append(subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env,
                                          stdout=out, stderr=subprocess.STDOUT))
        return [p.wait() for p in procs]


def per_step(ends: list[float], warmup: int) -> tuple[float, float]:
    """(median, 10th percentile) of the step-to-step intervals after `warmup` steps, leaving out
    the last step (the generated program reports a step's loss at the end of the next one, the
    last at the end). The 10th percentile is the less disturbed by other work on the machine."""
    ends = ends[warmup - 1:-1]
    intervals = [b - a for a, b in zip(ends, ends[1:])]
    return statistics.median(intervals), statistics.quantiles(intervals, n=10)[0]


def synced(ends: list[float], wall_s: float, warmup: int) -> float:
    """The mean step from the end of step `warmup` to `wall_s`, the run's end after the GPU is
    done (on a GPU a step's end is when the host queued it: its intervals are the host's)."""
    return (wall_s - ends[warmup - 1]) / (len(ends) - warmup)


def run_generated(program: Path, steps: int, warmup: int, work: Path, world: int = WORLD,
                  device: str = "cpu") -> tuple[float, float]:
    out = work / "out"
    launch([str(program), "--steps", str(steps), "--out", str(out)], work, work / "generated.log", world=world)
    records = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    ends = [r["elapsed_s"] for r in records if "step" in r]
    median, p10 = per_step(ends, warmup)
    if device == "cuda":
        return synced(ends, json.loads((out / "metrics.json").read_text())["wall_s"], warmup), p10
    return median, p10


def run_baseline(baseline: Path, steps: int, warmup: int, work: Path, world: int = WORLD,
                 device: str = "cpu") -> tuple[float, float]:
    times = work / "baseline.json"
    launch([str(baseline), "--steps", str(steps), "--out", str(times)], baseline.parent,
           work / "baseline.log", world=world, env={"BENCH_DEVICE": device})
    doc = json.loads(times.read_text())
    median, p10 = per_step(doc["step_ends_s"], warmup)
    return (synced(doc["step_ends_s"], doc["wall_s"], warmup) if device == "cuda" else median), p10


def summarise(args, modes, times, out: Path) -> None:
    """Print the table of every mode so far and write it to `out`."""
    results = {}
    print(f"\n{'mode':<10} {'generated ms':>12} {'torch ms':>9} {'ratio':>6} {'paired':>7} {'p10':>6}  baseline")
    for mode in modes:
        g, t = [m for m, _ in times[mode]["generated"]], [m for m, _ in times[mode]["torch"]]
        g10, t10 = [p for _, p in times[mode]["generated"]], [p for _, p in times[mode]["torch"]]
        ratio = statistics.median(g) / statistics.median(t)
        paired = statistics.median(a / b for a, b in zip(g, t))
        p10 = statistics.median(g10) / statistics.median(t10)
        results[mode] = {"spec": str((BENCH / "specs" / MODES[mode][0]).resolve().relative_to(ROOT)), "baseline": f"bench/baselines/{MODES[mode][1]}",
                         "generated_s": g, "torch_s": t, "generated_p10_s": g10, "torch_p10_s": t10,
                         "generated_median_s": statistics.median(g), "torch_median_s": statistics.median(t),
                         "ratio": ratio, "paired_ratio_median": paired, "p10_ratio": p10}
        print(f"{mode:<10} {statistics.median(g) * 1e3:12.2f} {statistics.median(t) * 1e3:9.2f} "
              f"{ratio:6.3f} {paired:7.3f} {p10:6.3f}  {MODES[mode][2]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    doc = {"what": "steady-state seconds per step, generated program vs hand-written torch",
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                       "python": platform.python_version(), "device": args.device,
                       "backend": "nccl" if args.device == "cuda" else "gloo",
                       "world_size": {m: WORLDS.get(m, WORLD) for m in modes},
                       "gpus": gpu_names() if args.device == "cuda" else [],
                       "load_average_1m": os.getloadavg()[0]},
           "placer": str(args.placer or ROOT), "set": args.set, "reps": args.reps, "steps": args.steps, "warmup": args.warmup, "modes": results}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}\n", flush=True)


def gpu_names() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def on_device(spec: Path, device: str, tmp: Path) -> Path:
    """A copy of bench spec `spec` with its devices (cpu:N or cuda:N) made `device`:N."""
    out = tmp / f"{spec.stem}-{device}.yaml"
    out.write_text(re.sub(r"\b(cpu|cuda):(\d+)", rf"{device}:\2", spec.read_text()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated, from {', '.join(MODES)} (default: all but single)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help=f"run both on CPU workers (gloo) or on GPUs (NCCL; {', '.join(CUDA_MODES)})")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each pair (default 5)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out at the start (default 5)")
    parser.add_argument("--out", type=Path, help="result JSON (default bench/results/vs_torch-<time>.json)")
    parser.add_argument("--placer", type=Path, help="generate with the placer package under this folder "
                        "(another version, e.g. from `git archive REV placer | tar -x -C DIR`)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a value of every bench spec, as `placer generate --set` does "
                             "(e.g. training.prefetch=0)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES or (args.device == "cuda" and m not in CUDA_MODES)]
    if unknown or args.steps < args.warmup + 3 or args.warmup < 1:
        parser.error(f"unknown modes {unknown}" if unknown else "need --warmup >= 1 and --steps >= warmup + 3")

    if args.placer:
        sys.path.insert(0, str(args.placer.resolve()))
    from placer.api import generate

    out = args.out or BENCH / "results" / f"vs_torch-{time.strftime('%Y%m%d-%H%M%S')}.json"
    times: dict[str, dict[str, list[tuple[float, float]]]] = {m: {"generated": [], "torch": []} for m in modes}
    with tempfile.TemporaryDirectory(prefix="placer-bench-") as tmp:
        programs = {}
        for mode in modes:
            programs[mode] = Path(tmp) / f"{mode}_program.py"
            spec = on_device(BENCH / "specs" / MODES[mode][0], args.device, Path(tmp))
            generate(str(spec), str(programs[mode]), overrides=args.set)
        for rep in range(args.reps):
            for mode in modes:
                work = Path(tmp) / f"{mode}-{rep}"
                work.mkdir()
                world = WORLDS.get(mode, WORLD)
                pair = [("generated", lambda: run_generated(programs[mode], args.steps, args.warmup, work, world,
                                                            args.device)),
                        ("torch", lambda: run_baseline(BENCH / "baselines" / MODES[mode][1], args.steps,
                                                       args.warmup, work, world, args.device))]
                for kind, run in pair if rep % 2 == 0 else pair[::-1]:  # alternate who goes first
                    times[mode][kind].append(run())
                g, t = times[mode]["generated"][-1][0], times[mode]["torch"][-1][0]
                print(f"rep {rep + 1}/{args.reps}  {mode:<10} generated {g * 1e3:7.2f} ms  "
                      f"torch {t * 1e3:7.2f} ms  ratio {g / t:.3f}", flush=True)
            summarise(args, modes, times, out)  # after every repetition: a long run keeps what it has



if __name__ == "__main__":
    main()
