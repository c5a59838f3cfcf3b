"""Run a generated program's worker under torch's profiler and write the peak of the bytes that
torch's CPU allocator holds for tensors (the profiler's `Total Allocated`), as
`torch.cuda.max_memory_allocated` reports on GPUs: `peak_bytes` until the last optimizer step
ends (training), `run_peak_bytes` over the whole run (with the final parameters gathered).

The allocator keeps that running total only on threads the profiler follows, unless c10's flag
`caffe2_report_cpu_memory_usage` is on: a tensor that gloo's worker thread frees (a collective's
input, DDP's initial broadcast buffer) then stayed in the total for the rest of the run, and one
that thread allocates was never in it, so the same program's peak moved by up to 2.6 MiB between
runs. The flag (set here through ctypes: torch has no Python call for it) makes every thread's
tensors count; the peak is read at the main thread's memory events. The profiler's
`profile_all_threads` would follow other threads but drops the memory events (torch 2.13).

    python bench/tensor_peak.py RESULT.json program.py [program arguments]

bench/memory.py starts each worker this way (RANK and the rest set as torchrun sets them). The
program leaves with `os._exit`, past the profiler: that call is held back until the trace is read.
"""
from __future__ import annotations

import ctypes
import json
import os
import runpy
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile


def count_every_thread() -> None:
    """Turn on c10's `caffe2_report_cpu_memory_usage`, so that the CPU allocator's running total
    counts tensors that any thread allocates or frees, not only the profiled ones."""
    libc10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(libc10, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def main() -> None:
    result, program = sys.argv[1], sys.argv[2]
    sys.argv = sys.argv[2:]
    leave = os._exit

    def held_back(code: int) -> None:
        raise SystemExit(code)

    os._exit = held_back  # type: ignore[assignment]
    count_every_thread()
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
