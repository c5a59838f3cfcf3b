"""Plan time against model size: GPT-like models (specs/models/tinygpt.py) of ~10M, ~100M and ~1B
parameters, each an 8-stage 1F1B pipeline over 8 devices, planned the way `placer plan` does.

    python bench/plan_time.py              # 3 runs per size, median shown
    python bench/plan_time.py --runs 1

Columns: build (the model traced on the meta device: shapes, FLOPs, saved bytes), place + lower
(the plan IR, every pass verified), estimate (memory, communication, FLOPs), and all of it.
The first build in a process also pays for importing torch; that is reported on its own line.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # name: (vocab, d_model, n_layers, n_heads, seq)
    "10M": (8192, 256, 8, 4, 256),
    "100M": (16384, 768, 12, 12, 512),
    "1B": (50304, 2048, 16, 16, 1024),
}
DEVICES = 8


def spec_text(name: str, vocab: int, d: int, layers: int, heads: int, seq: int) -> str:
    """An 8-stage pipeline: the embedding with the first blocks, the head with the last ones."""
    per = [layers // DEVICES + (i < layers % DEVICES) for i in range(DEVICES)]
    starts = [sum(per[:i]) for i in range(DEVICES)]
    stages = []
    for i, (start, n) in enumerate(zip(starts, per)):
        sel = [f"blocks.{start}..blocks.{start + n - 1}"] if n else []
        sel = (["embed"] if i == 0 else []) + sel + (["ln_f", "lm_head"] if i == DEVICES - 1 else [])
        stages.append(f"  - {{name: stage{i}, layers: [{', '.join(sel)}], device: cuda:{i}}}")
    return f"""\
placer: 1
name: gpt_{name}
model:
  module: models/tinygpt.py:TinyGPT
  kwargs: {{vocab: {vocab}, d_model: {d}, n_layers: {layers}, seq: {seq}, n_heads: {heads}}}
  input: {{shape: [B, {seq}], dtype: int64, high: {vocab}}}
  target: {{shape: [B, {seq}], dtype: int64, high: {vocab}}}
  loss: CrossEntropyLoss
devices: [{', '.join(f'cuda:{i}' for i in range(DEVICES))}]
placement:
{chr(10).join(stages)}
pipeline: {{microbatches: 8, schedule: 1f1b}}
training:
  batch_size: 32
  steps: 1
  optimizer: {{op: AdamW, lr: 0.0003}}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    t0 = time.perf_counter()
    import torch  # noqa: F401

    from placer.estimate.cost import estimate
    from placer.model.build import build_graph
    from placer.plan.lower import lower
    from placer.plan.place import place
    from placer.spec.check import load_spec
    print(f"import torch and placer: {time.perf_counter() - t0:.2f} s")

    rows = [("model", "params", "layers", "ops", "build s", "place+lower s", "estimate s", "total s")]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "models").symlink_to(ROOT / "specs" / "models")
        for name, cfg in SIZES.items():
            path = Path(tmp) / f"gpt_{name}.yaml"
            path.write_text(spec_text(name, *cfg))
            spec = load_spec(str(path))
            times = {"build": [], "plan": [], "estimate": []}
            for _ in range(args.runs):
                a = time.perf_counter()
                graph = build_graph(spec)
                b = time.perf_counter()
                plan = lower(place(spec, graph), spec, graph)
                c = time.perf_counter()
                estimate(plan, graph, spec.training.optimizer)
                d = time.perf_counter()
                times["build"].append(b - a)
                times["plan"].append(c - b)
                times["estimate"].append(d - c)
            med = {k: statistics.median(v) for k, v in times.items()}
            n_ops = sum(len(v) for v in plan.ops.values())
            rows.append((name, f"{graph.total_params:,}", str(len(graph.layers)), str(n_ops),
                         f"{med['build']:.2f}", f"{med['plan']:.3f}", f"{med['estimate']:.3f}",
                         f"{sum(med.values()):.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
