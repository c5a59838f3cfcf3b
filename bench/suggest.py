"""The placement search against the clock: for each case, the candidates the search keeps (every plan
of its bounded space that fits, up to --top of them, fastest predicted first) are each run on this
machine, and the suggested plan's measured time per step is set beside the best measured one.

    python bench/suggest.py                      # every case, 2 repetitions, the 6 fastest predicted
    python bench/suggest.py --top 10 --reps 3 mlp_capped tinygpt

Per case it reports: suggested / best measured (goal <= 1.10), the Spearman rank correlation of
predicted and measured step times over the candidates run (goal >= 0.8), and the suggested plan's
estimated peak against every stated memory. The search scores on the `cpu` profile (this machine,
measured and cached, as `placer suggest` does); each run starts its workers directly, as
bench/vs_torch.py does, and its time per step is the median of its step intervals after --warmup
steps; a plan's figure is the median over repetitions. Writes bench/results/suggest-*.json.
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

SUGGEST = ROOT / "tests" / "cases" / "suggest"
CPUS = "[cpu, cpu:1]"
CASES = {  # name: (spec, --set overrides): 2 simulated devices each, scored on this machine
    "mlp": (SUGGEST / "mlp_capped.yaml", [f"devices={CPUS}", "training.batch_size=256"]),
    "mlp_capped": (SUGGEST / "mlp_capped.yaml", ["devices=[{name: cpu, memory: 3MiB}, {name: cpu:1, memory: 3MiB}]",
                                                 "training.batch_size=256"]),
    "cnn": (BENCH / "suggest_cnn.yaml", []),
    "tinygpt": (SUGGEST / "tinygpt_auto.yaml", [f"devices={CPUS}"]),
    "hf_gpt2": (BENCH / "suggest_gpt2.yaml", []),
    "hf_llama": (SUGGEST / "hf_llama_auto.yaml", [f"devices={CPUS}"]),
}


def spearman(a: list[float], b: list[float]) -> float | None:
    if len(a) < 3:
        return None
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("cases", nargs="*", help=f"cases (default all: {', '.join(CASES)})")
    parser.add_argument("--top", type=int, default=6, help="candidates run per case, fastest predicted first")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from placer import search
    from placer.api import generate, load
    from placer.spec.check import load_spec_text

    rows = {}
    with tempfile.TemporaryDirectory(prefix="placer-suggest-") as tmp:
        for name in args.cases or CASES:
            path, overrides = CASES[name]
            spec = load(str(path), overrides + [f"training.steps={args.steps}"])
            found = search.suggest(spec, "cpu", lambda msg: print(f"  {msg}", flush=True))
            tried = found.kept[:args.top]
            plans = []
            for k, c in enumerate(tried):
                text = search.spec_text(spec, c, found.kept, found.hardware, found.caps)
                program = Path(tmp) / f"{name}-{k}.py"
                generate(load_spec_text(text, spec.file), str(program))
                runs = []
                for rep in range(args.reps):
                    work = Path(tmp) / f"{name}-{k}-{rep}"
                    work.mkdir()
                    runs.append(run_generated(program, args.steps, args.warmup, work, world=len(spec.devices))[0])
                plans.append({"plan": c.describe(), "predicted_s": c.step_s, "measured_s": runs,
                              "measured_median_s": statistics.median(runs), "memory": c.memory})
                print(f"{name:<10} {c.describe():<60} predicted {c.step_s * 1e3:7.2f} ms  "
                      f"measured {statistics.median(runs) * 1e3:7.2f} ms", flush=True)
            best = min(p["measured_median_s"] for p in plans)
            rho = spearman([p["predicted_s"] for p in plans], [p["measured_median_s"] for p in plans])
            within = all(b <= found.caps[d] for d, b in found.best.memory.items() if d in found.caps)
            rows[name] = {"spec": str(path.relative_to(ROOT)), "overrides": overrides, "candidates": found.evaluated,
                          "search_s": found.seconds, "plans": plans,
                          "suggested_over_best": plans[0]["measured_median_s"] / best, "spearman": rho,
                          "capacities": found.caps, "suggested_within_caps": within}
            print(f"{name:<10} suggested / best measured {rows[name]['suggested_over_best']:.3f}, spearman "
                  f"{'-' if rho is None else f'{rho:.2f}'}, search {found.seconds:.1f} s\n", flush=True)
    import torch

    out = args.out or BENCH / "results" / f"suggest-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"what": "the suggested plan's measured step time against the best measured one of the candidates run",
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                       "python": platform.python_version(), "load_average_1m": os.getloadavg()[0]},
           "top": args.top, "reps": args.reps, "steps": args.steps, "warmup": args.warmup, "cases": rows}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
