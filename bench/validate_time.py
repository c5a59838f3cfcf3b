"""Wall time of `placer validate SPEC`, one fresh process per run, for every spec in specs/.

Plain validate is meant for editors, CI and pre-commit hooks: it must answer in
under 0.3 s (interpreter start-up included) and never import torch.

    python bench/validate_time.py               # 5 runs per spec
    python bench/validate_time.py --runs 10 specs/mlp_tensor.yaml
    python bench/validate_time.py --check       # exit 1 if a median is over the target

When a spec is over the target, look at the import path:
    python -X importtime -m placer.cli.main validate -q SPEC 2>&1 | sort -t'|' -k2 -n | tail
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 0.3


def command() -> list[str]:
    """The installed `placer` script when there is one (what users run), else the module."""
    exe = shutil.which("placer")
    return [exe] if exe else [sys.executable, "-m", "placer.cli.main"]


def timed_runs(argv: list[str], runs: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (user + system) seconds per run. On a busy machine wall time
    includes waiting for a core; CPU time is close to what an idle machine's wall time would be."""
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if done.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr}")
    return walls, cpus


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", type=Path, help="spec files (default: specs/*.yaml)")
    ap.add_argument("--runs", type=int, default=5, help="runs per spec (default 5)")
    ap.add_argument("--target", type=float, default=TARGET_S, help=f"seconds (default {TARGET_S})")
    ap.add_argument("--check", action="store_true", help="exit 1 if any median is over the target")
    args = ap.parse_args()
    specs = args.specs or sorted((ROOT / "specs").glob("*.yaml"))
    cmd = command()

    base, base_cpu = timed_runs([sys.executable, "-c", "pass"], args.runs)
    print(f"command: {' '.join(cmd)} validate -q SPEC   ({args.runs} runs each, target {args.target:.2f} s)")
    print(f"python start-up alone: wall min {min(base):.3f} s, median {statistics.median(base):.3f} s; "
          f"cpu median {statistics.median(base_cpu):.3f} s")
    print(f"machine load (1 min): {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          "if it is above the core count, trust the cpu column\n")
    width = max(len(p.name) for p in specs)
    print(f"{'spec':<{width}}  {'wall min':>8}  {'wall median':>11}  {'cpu median':>10}")
    over = []
    for path in specs:
        walls, cpus = timed_runs(cmd + ["validate", "-q", str(path)], args.runs)
        med = statistics.median(walls)
        if med > args.target:
            over.append(path.name)
        print(f"{path.name:<{width}}  {min(walls):8.3f}  {med:11.3f}  {statistics.median(cpus):10.3f}  "
              f"{'OVER' if med > args.target else 'ok'}")
    print(f"\n{len(specs) - len(over)}/{len(specs)} specs within {args.target:.2f} s (median)")
    return 1 if over and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
