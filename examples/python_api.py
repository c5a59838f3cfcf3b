"""placer from Python: load a spec, plan it, generate its program.

    python examples/python_api.py [SPEC]

In Jupyter, a cell that ends with `placer.plan(...)` shows the placement graph
(graphviz's `dot` renders it); `print(report.table())` shows what `placer plan` prints.
"""
import json
import sys
from pathlib import Path

import placer

spec_path = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent / "data_parallel" / "spec.yaml")

# 1. Load: the validated Spec, or SpecError with the same file:line:col diagnostics the CLI prints.
try:
    spec = placer.load(spec_path)
except placer.SpecError as e:
    sys.exit(str(e))
print(f"{spec.name}: {len(spec.placement)} segments on {', '.join(spec.devices)}")

# Overrides work as `--set` does on the command line.
bigger = placer.load(spec_path, overrides=["training.batch_size=64"])
print(f"with --set training.batch_size=64: batch {bigger.training.batch_size}")

# 2. Plan: memory, communication and FLOPs per device.
report = placer.plan(spec)
print(report.table())
plan = json.loads(report.to_json())  # the stable keys of docs/plan-json.md
busiest = max(plan["devices"], key=lambda d: d["total_bytes"])
print(f"most memory: {busiest['device']} ({busiest['total_bytes']:,} bytes)")

# 3. Generate: the standalone torch program (also written to a file when given one).
source = placer.generate(spec)
print(f"program: {len(source.splitlines())} lines; run it with torchrun or `python program.py`")
