"""Start-up: `placer run SPEC` against `torchrun` on the same generated program, and `placer
generate` against a bare `import torch`. Wall time of whole commands (subprocess + time only),
interleaved: each repetition runs every command once, in turn, so load on the machine hits them
alike; medians over the repetitions, then differences and ratios.

    python bench/startup.py                      # specs/mlp_layerwise_direct.yaml, 5 steps, 5 repetitions
    python bench/startup.py --spec specs/tinygpt.yaml --steps 5 -n 7

Commands, per repetition (the program is generated once, before, with `placer generate`):
    placer run SPEC --steps S --run-dir D1                 generate + launch + train + results
    torchrun --standalone --nproc-per-node K P --steps S --out D2 --measure   P: the same program,
    python P --steps S --out D3 --measure                  the same flags as `placer run` gives it
    placer generate SPEC -o P2
    python -c "import torch"

Measured on the 2-core development machine while other work kept its load average near 10,
so every command ran 5-10x slower than on a quiet machine and the spread is wide; read the
ratios (mlp_layerwise_direct, 2 simulated CPU workers, 5 steps, n=3, `--baseline` = main at
fad0115, before this change, in the same interleaved run):
    placer run / torchrun            1.12x (+4.6 s)    baseline 1.46x (+17.2 s)
    placer generate / import torch   1.12x (+2.0 s)    baseline 1.62x (+10.0 s)
    python program.py / torchrun     1.01x             baseline 0.97x (1.36x quiet, issue 15)
On a quiet machine the issue measured placer run at +1.95 s (1.44x); the same cut (-73%)
would leave about +0.5 s.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def placer(*args: str) -> list[str]:
    return [sys.executable, "-m", "placer.cli.main", *args]  # the placer of the working directory


def timed(cmd: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--spec", default=str(ROOT / "specs" / "mlp_layerwise_direct.yaml"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("-n", "--repeat", type=int, default=5, help="repetitions (default 5)")
    ap.add_argument("--out", type=Path, help="result JSON (default bench/results/startup-<time>.json)")
    ap.add_argument("--baseline", metavar="DIR", help="another placer checkout (an older commit, say): its "
                    "placer run, placer generate and python program.py join the comparison")
    args = ap.parse_args()
    spec = str(Path(args.spec).resolve())
    with tempfile.TemporaryDirectory(prefix="placer-startup-") as tmp:
        work = Path(tmp)
        program = work / "program.py"
        timed(placer("generate", spec, "-o", str(program)), ROOT)
        base, old_program = Path(args.baseline).resolve() if args.baseline else None, work / "old_program.py"
        if base:
            timed(placer("generate", spec, "-o", str(old_program)), base)
        text = program.read_text()
        nproc = next(line.split("--nproc-per-node")[1].split()[0] for line in text.splitlines()
                     if "torchrun --nproc-per-node" in line)
        steps = ["--steps", str(args.steps)]
        commands = {
            "placer run": lambda i: placer("run", spec, *steps, "--run-dir", str(work / f"run{i}")),
            "torchrun": lambda i: [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nproc,
                                   str(program), *steps, "--out", str(work / f"torchrun{i}"), "--measure"],
            "python program.py": lambda i: [sys.executable, str(program), *steps, "--out", str(work / f"py{i}"),
                                            "--measure"],
            "placer generate": lambda i: placer("generate", spec, "-o", str(work / f"gen{i}.py")),
            "import torch": lambda i: [sys.executable, "-c", "import torch"],
        }
        cwd = {name: ROOT for name in commands}
        if base:
            commands |= {
                "placer run (baseline)": lambda i: placer("run", spec, *steps, "--run-dir", str(work / f"brun{i}")),
                "placer generate (baseline)": lambda i: placer("generate", spec, "-o", str(work / f"bgen{i}.py")),
                "python program.py (baseline)": lambda i: [sys.executable, str(old_program), *steps, "--out",
                                                           str(work / f"bpy{i}"), "--measure"],
            }
            cwd |= {name: base for name in commands if "baseline" in name}
        times: dict[str, list[float]] = {name: [] for name in commands}
        print(f"{Path(spec).name}: {nproc} workers, {args.steps} steps, {args.repeat} repetitions, interleaved")
        for i in range(args.repeat):
            for name, cmd in commands.items():
                times[name].append(timed(cmd(i), cwd[name]))
            print(f"  {i + 1}/{args.repeat}: " + ", ".join(f"{n} {t[-1]:.2f}" for n, t in times.items()), flush=True)
            for old in work.glob("*[0-9]"):
                shutil.rmtree(old, ignore_errors=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"\n{'command':<30} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, t in times.items():
        print(f"{name:<30} {med[name]:>9.2f} {min(t):>7.2f} {max(t):>7.2f}")
    print()
    pairs = [("placer run", "torchrun"), ("python program.py", "torchrun"), ("placer generate", "import torch")]
    pairs += [(f"{a} (baseline)", b) for a, b in pairs if f"{a} (baseline)" in med]
    for a, b in pairs:
        print(f"{a} vs {b}: {med[a] - med[b]:+.2f} s ({med[a] / med[b]:.2f}x)")
    # the same differences repetition by repetition (paired: each pair ran back to back)
    for a, b in (("placer run", "torchrun"), ("placer generate", "import torch")):
        print(f"{a} - {b}, per repetition: " + " ".join(f"{x - y:+.2f}" for x, y in zip(times[a], times[b])))
    out = args.out or ROOT / "bench" / "results" / f"startup-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "what": "wall seconds of whole commands, interleaved repetitions", "spec": spec, "steps": args.steps,
        "workers": int(nproc), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                            "load_average_1m": os.getloadavg()[0]},
        "seconds": times, "median_s": med,
        "run_minus_torchrun_s": med["placer run"] - med["torchrun"],
        "generate_minus_import_torch_s": med["placer generate"] - med["import torch"]}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
