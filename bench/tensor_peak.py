"""Run a generated program's worker under torch's profiler and write the peak of the bytes that
torch's CPU allocator holds for tensors (the profiler's `Total Allocated`), as
`torch.cuda.max_memory_allocated` reports on GPUs: `peak_bytes` until the last optimizer step
ends (training), `run_peak_bytes` over the whole run (with the final parameters gathered). The profiler follows the main thread and the
autograd engine's; it does not see what other threads allocate (a data prefetch thread: so
bench/memory.py runs with `training.prefetch=0`), and its `profile_all_threads` drops the
memory events (torch 2.13).

    python bench/tensor_peak.py RESULT.json program.py [program arguments]

bench/memory.py starts each worker this way (RANK and the rest set as torchrun sets them). The
program leaves with `os._exit`, past the profiler: that call is held back until the trace is read.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile

from torch.profiler import ProfilerActivity, profile


def main() -> None:
    result, program = sys.argv[1], sys.argv[2]
    sys.argv = sys.argv[2:]
    leave = os._exit

    def held_back(code: int) -> None:
        raise SystemExit(code)

    os._exit = held_back  # type: ignore[assignment]
    code = 0
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        try:
            runpy.run_path(program, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    # a path: keep the trace there (chrome://tracing); {rank} stands for RANK
    keep = os.environ.get("TENSOR_PEAK_TRACE", "").replace("{rank}", os.environ.get("RANK", "0"))
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(keep or f.name)
        events = json.load(open(keep or f.name))["traceEvents"]
    memory = [e for e in events if e.get("name") == "[memory]"]
    # training ends with the last optimizer step (torch's optimizers record `Optimizer.step#...`);
    # what follows (gathering the final parameters to write them) is reported apart
    steps = [e["ts"] + e.get("dur", 0) for e in events if e.get("ph") == "X" and e["name"].startswith("Optimizer.step#")]
    end = max(steps, default=float("inf"))
    doc = {}
    for key, seen in (("peak", [e for e in memory if e["ts"] <= end]), ("run_peak", memory)):
        peak = max(seen, key=lambda e: e["args"]["Total Allocated"], default=None)
        at = sorted((e for e in events if e.get("ph") == "X" and peak
                     and e["ts"] <= peak["ts"] <= e["ts"] + e.get("dur", 0)), key=lambda e: e["ts"])
        doc[f"{key}_bytes"] = peak["args"]["Total Allocated"] if peak else 0
        doc[f"{key}_at"] = [e["name"] for e in at]
    with open(result, "w") as f:
        json.dump(doc, f)
    sys.stdout.flush()
    sys.stderr.flush()
    leave(code)


if __name__ == "__main__":
    main()
