"""The cost model against the clock: `placer plan --hardware cpu`'s predicted time per step
against the measured time per step of the generated program, for every spec in bench/specs/
(or those given), on this machine.

    python bench/cost_model.py                         # every bench spec, 3 repetitions
    python bench/cost_model.py --reps 5 bench/specs/data.yaml examples/pipeline_gpipe/spec.yaml

The prediction is the plan's (`placer.cli.plan_cmd.predict`: the `cpu` profile measured on this
machine, the spec's own layers and optimizer steps timed at each device's shapes, as `placer plan
--hardware cpu` does). Both are measured afresh for each spec, right before its measured runs (a
cache folder of its own, about 20 s), so that the profile sees the machine in the state that
those runs see it: on this 2-core VM a collective right after compute costs about twice as much
in some spells of minutes as in others. A profile cached an hour before predicted spatial's and
1F1B's steps at 0.69-0.71; one measured at the start of the bench, 1F1B's at 0.70 and 1.26 in
two runs. `--cached` takes the user's cached profile instead, as `placer plan` does. Each measured run starts its workers directly, as bench/vs_torch.py does
(one gloo group, max(1, cores // workers) threads each, start-up left out); its time per step
is the median of its step-to-step intervals after --warmup steps, and a spec's is the median
over repetitions (p10: the same of each run's 10th-percentile interval, the figure least
disturbed by other work on a shared machine). Prints predicted / measured per spec and writes
bench/results/cost_model-*.json. The target is within 25% (ratio 0.75 to 1.25).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from vs_torch import run_generated  # noqa: E402  (bench/ is a folder of scripts, not a package)


def predicted(path: Path) -> tuple[float, str]:
    from placer.api import load
    from placer.cli.plan_cmd import build_and_plan, predict

    spec = load(str(path))
    graph, plan, est, _ = build_and_plan(spec)
    st, _ = predict(plan, graph, est, "cpu", lambda msg: print(msg, flush=True), spec)
    return st.step_s, st.hardware.source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("specs", nargs="*", type=Path, help="specs with two devices (default: bench/specs/*.yaml)")
    parser.add_argument("--reps", type=int, default=3, help="measured runs of each spec (default 3)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out at the start (default 5)")
    parser.add_argument("--cached", action="store_true",
                        help="use the cached cpu profile and layer times (default: measure them afresh for each spec)")
    parser.add_argument("--out", type=Path, help="result JSON (default bench/results/cost_model-<time>.json)")
    args = parser.parse_args()
    specs = args.specs or sorted((BENCH / "specs").glob("*.yaml"))
    from placer.api import generate

    rows = {}
    with tempfile.TemporaryDirectory(prefix="placer-cost-") as tmp:
        for spec in specs:
            if not args.cached:  # placer keeps its profile under XDG_CACHE_HOME: an empty one measures anew
                os.environ["XDG_CACHE_HOME"] = str(Path(tmp) / f"cache-{spec.stem}")
            pred, source = predicted(spec)
            program = Path(tmp) / f"{spec.stem}_program.py"
            generate(str(spec), str(program), overrides=[f"training.steps={args.steps}"])
            runs = []
            for rep in range(args.reps):
                work = Path(tmp) / f"{spec.stem}-{rep}"
                work.mkdir()
                runs.append(run_generated(program, args.steps, args.warmup, work))
            med = statistics.median(m for m, _ in runs)
            p10 = statistics.median(p for _, p in runs)
            rows[str(spec)] = {"predicted_s": pred, "measured_s": [m for m, _ in runs],
                               "measured_p10_s": [p for _, p in runs], "measured_median_s": med,
                               "ratio": pred / med, "p10_ratio": pred / p10}
            print(f"{spec.stem:<16} predicted {pred * 1e3:7.2f} ms  measured {med * 1e3:7.2f} ms "
                  f"(p10 {p10 * 1e3:7.2f})  predicted/measured {pred / med:5.2f} (p10 {pred / p10:5.2f})",
                  flush=True)
    import torch

    within = sum(0.75 <= r["ratio"] <= 1.25 for r in rows.values())
    print(f"\n{within} of {len(rows)} specs predicted within 25% of the measured median")
    out = args.out or BENCH / "results" / f"cost_model-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"what": "predicted (placer plan --hardware cpu) vs measured seconds per step of the generated program",
           "profile": source, "fresh_profile": not args.cached,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                       "python": platform.python_version(), "load_average_1m": os.getloadavg()[0]},
           "reps": args.reps, "steps": args.steps, "warmup": args.warmup, "specs": rows}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
