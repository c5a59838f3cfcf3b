"""How long the placement search takes: `search.suggest` on an inline MLP of 4096-wide Linears
(batch 512, AdamW) over N devices that are each an `h100` with 80 GiB, for each DEVICESxLAYERS.

    python bench/suggest_time.py                  # 8x48 and 64x96 (goals: < 10 s and < 60 s)
    python bench/suggest_time.py 16x32

Prints and writes bench/results/suggest_time-*.json: candidates, CPU and wall seconds, the plan.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def spec_text(devices: int, layers: int) -> str:
    devs = ", ".join(f"{{name: cuda:{i}, hardware: h100, memory: 80GiB}}" for i in range(devices))
    return f"""placer: 1
name: suggest_time
model:
  layers:
    - {{name: inp, op: Linear, args: [1024, 4096]}}
    - {{name: block, op: Linear, args: [4096, 4096], repeat: {layers - 2}}}
    - {{name: head, op: Linear, args: [4096, 1024]}}
  input: {{shape: [B, 1024]}}
  target: {{shape: [B, 1024]}}
  loss: MSELoss
devices: [{devs}]
training:
  batch_size: 512
  steps: 1
  optimizer: {{op: AdamW, lr: 0.001}}
"""


def main() -> None:
    from placer import search
    from placer.spec.check import load_spec_text

    rows = []
    for case in sys.argv[1:] or ["8x48", "64x96"]:
        n, layers = map(int, case.split("x"))
        spec = load_spec_text(spec_text(n, layers), str(ROOT / "bench" / "suggest_time.yaml"))
        cpu, wall = time.process_time(), time.perf_counter()
        s = search.suggest(spec, "h100")
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        rows.append({"devices": n, "layers": layers, "candidates": s.evaluated, "cpu_s": cpu, "wall_s": wall,
                     "suggested": s.best.describe(), "predicted_step_s": s.best.step_s})
        print(f"{case}: {s.evaluated} candidates, {cpu:.1f} s CPU, {wall:.1f} s wall: {s.best.describe()} "
              f"({s.best.step_s * 1e3:.2f} ms)", flush=True)
    out = ROOT / "bench" / "results" / f"suggest_time-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                           "load_average_1m": os.getloadavg()[0]}, "cases": rows}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
