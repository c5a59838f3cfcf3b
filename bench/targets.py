"""Issue 15's targets in one run: every bench, one after the other on this machine, each held
against its target.

    python bench/targets.py                 # about 15-20 minutes on the 2-core machine
    python bench/targets.py --quick         # fewer repetitions: a rough look in about 8 minutes

It runs, in turn, as subprocesses (each writes its own JSON under the run's folder):
    bench/vs_torch.py     generated program / hand-written torch, per mode    target <= 1.02
                          (the median of the back-to-back pairs' ratios)
    bench/startup.py      placer run - torchrun on the same program           target <= +0.5 s
    bench/memory.py       plan's estimate / measured tensor peak, per device  target 0.90-1.10
    bench/cost_model.py   plan's predicted / measured time per step, per spec target 0.75-1.25
and prints one table of every figure with whether it meets its target, and writes it all to
bench/results/targets-<time>.json (with each bench's own JSON inside). The figures are what the
benches measured: nothing here adjusts them. A shared machine's load moves step times by several
percent between runs; the JSON keeps each bench's repetitions and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

PARITY, STARTUP_S, MEMORY, COST = 1.02, 0.5, (0.9, 1.1), (0.75, 1.25)


def bench(script: str, out: Path, *args: str) -> dict:
    """Run bench/`script` with --out `out`, its output shown as it goes; its JSON."""
    print(f"\n== {script} {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, str(BENCH / script), *args, "--out", str(out)], check=True, cwd=ROOT)
    return json.loads(out.read_text())


def rows(parity: dict, startup: dict, memory: dict, cost: dict) -> list[tuple[str, str, float, str, bool]]:
    """(bench, what, figure, target, met) for every figure."""
    # parity: the median of the repetitions' ratios, each of a generated run and its hand-written twin
    # run back to back, so that this VM's spells of slow collectives (minutes long) fall on both
    # sides of a ratio; the ratio of the two medians stays in the JSON beside it
    table = [("parity", mode, r["paired_ratio_median"], f"<= {PARITY}", r["paired_ratio_median"] <= PARITY)
             for mode, r in parity["modes"].items()]
    gap = startup["run_minus_torchrun_s"]
    table.append(("start-up", "placer run - torchrun (s)", gap, f"<= +{STARTUP_S}", gap <= STARTUP_S))
    for spec, devices in memory["specs"].items():
        for d in devices:
            r = d["ratio_tensors"]
            table.append(("memory", f"{Path(spec).stem} {d['device']}", r, "0.90-1.10", MEMORY[0] <= r <= MEMORY[1]))
    for spec, r in cost["specs"].items():
        table.append(("step time", Path(spec).stem, r["ratio"], "0.75-1.25", COST[0] <= r["ratio"] <= COST[1]))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="3 repetitions of parity, 3 of start-up, 2 of the cost model")
    parser.add_argument("--out", type=Path, help="result JSON (default bench/results/targets-<time>.json)")
    args = parser.parse_args()
    reps = ("3", "3", "2") if args.quick else ("6", "9", "3")  # start-up: a run's start varies by +-0.5 s
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="placer-targets-") as tmp:
        work = Path(tmp)
        parity = bench("vs_torch.py", work / "parity.json", "--reps", reps[0], "--steps", "40")
        startup = bench("startup.py", work / "startup.json", "-n", reps[1])
        memory = bench("memory.py", work / "memory.json")
        cost = bench("cost_model.py", work / "cost.json", "--reps", reps[2], "--steps", "40")
    load.append(os.getloadavg()[0])
    table = rows(parity, startup, memory, cost)
    print(f"\n{'bench':<10} {'figure':<28} {'value':>7}  {'target':<10} met")
    for kind, what, value, target, met in table:
        print(f"{kind:<10} {what:<28} {value:>7.3f}  {target:<10} {'yes' if met else 'NO'}")
    met = sum(r[-1] for r in table)
    print(f"\n{met} of {len(table)} figures meet their targets (load average {load[0]:.1f} before, {load[1]:.1f} after)")
    out = args.out or BENCH / "results" / f"targets-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "what": "issue 15's targets, every bench in one run", "load_average_1m": load,
        "figures": [dict(zip(("bench", "what", "value", "target", "met"), r)) for r in table],
        "met": met, "of": len(table),
        "benches": {"parity": parity, "startup": startup, "memory": memory, "cost_model": cost}}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
