"""The plan's memory estimate against what each rank of the generated program really holds:
for every spec in bench/specs/ (or those given), each device's estimated bytes (`placer plan`'s
`total_bytes`) beside its worker's measured peak.

    python bench/memory.py
    python bench/memory.py bench/specs/data.yaml examples/pipeline_gpipe/spec.yaml

Measured: each worker's peak resident set (Linux VmHWM, read from /proc every 10 ms while it
runs) less the peak of a baseline process that runs the same program's imports and constants
(everything before `def build_model`), joins a gloo group the same way and takes one step of a
one-parameter model, so that what torch loads on first use (autograd's engine, torch._dynamo with
the first optimizer step: about 70 MB) counts in neither; both with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors go back to the system instead
of staying in malloc's pools (without it a peak keeps every freed block). The workers are
started directly, as bench/vs_torch.py does. Prints estimated / measured per device and writes
bench/results/memory-*.json. The target is within 10% (ratio 0.9 to 1.1).

`allocated` leaves out the file-backed pages (RssFile) on both sides: the code of torch's
libraries that the step runs for the first time (its matmul, loss and optimizer kernels: about
8 MiB a worker) is paged in from the shared libraries, shared by every process on the machine,
and allocated by nobody. It is the peak less the most file-backed memory seen, a lower bound of
the anonymous memory at the peak.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from vs_torch import free_port  # noqa: E402  (bench/ is a folder of scripts, not a package)

JOIN = """
dist.init_process_group("gloo")
_p = torch.nn.Parameter(torch.ones(1))
(_p * 2).sum().backward()
torch.optim.SGD([_p], lr=0.1).step()
dist.all_reduce(_p.grad)
dist.barrier()
dist.destroy_process_group()
"""


def baseline_of(program: str) -> str:
    """The program's imports and constants, then a gloo group joined, one tiny step, and left."""
    return program[:program.index("\ndef build_model")] + "\n" + JOIN


def status(pid: int) -> tuple[int, int]:
    """(VmHWM, RssFile) of a process in bytes; (0, 0) once it is gone."""
    found = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("VmHWM", "RssFile"):
                    found[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return found.get("VmHWM", 0), found.get("RssFile", 0)


def peaks(argv_of, world: int, cwd: Path, log: Path) -> list[tuple[int, int]]:
    """Each rank's (peak resident bytes, most file-backed resident bytes: code pages of torch's
    libraries first run), for `argv_of(rank)` started as `world` gloo workers."""
    port, procs = free_port(), []
    with open(log, "w") as out:
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)),
                       MALLOC_MMAP_THRESHOLD_="65536")
            procs.append(subprocess.Popen([sys.executable, *argv_of(rank)], cwd=cwd, env=env,
                                          stdout=out, stderr=subprocess.STDOUT))
        best = [(0, 0)] * world
        while any(p.poll() is None for p in procs):
            for r, p in enumerate(procs):
                peak, file = status(p.pid)
                best[r] = (max(best[r][0], peak), max(best[r][1], file))
            time.sleep(0.01)
    if any(p.returncode for p in procs):
        raise SystemExit(f"{argv_of(0)} failed; its output:\n{log.read_text()[-3000:]}")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("specs", nargs="*", type=Path, help="specs (default: bench/specs/*.yaml)")
    parser.add_argument("--steps", type=int, default=5, help="steps per run (default 5)")
    parser.add_argument("--traces", type=Path, help="keep each worker's profiler trace here (<spec>-<rank>.json)")
    parser.add_argument("--out", type=Path, help="result JSON (default bench/results/memory-<time>.json)")
    args = parser.parse_args()
    specs = args.specs or sorted((BENCH / "specs").glob("*.yaml"))
    from placer.api import generate, plan

    rows: dict[str, list] = {}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="placer-memory-") as tmp:
        for spec in specs:
            overrides = [f"training.steps={args.steps}", "training.prefetch=0"]
            report = plan(str(spec), overrides=overrides)
            devices = report.as_dict()["devices"]
            world = len(devices)
            work = Path(tmp) / spec.stem
            work.mkdir()
            program = work / "program.py"
            generate(str(spec), str(program), overrides=overrides)
            base_file = work / "baseline.py"
            base_file.write_text(baseline_of(program.read_text()))
            base, base_file = max(peaks(lambda r: [str(base_file)], world, work, work / "base.log"))
            measured = peaks(lambda r: [str(program), "--out", str(work / "out")], world, work, work / "run.log")
            if args.traces:
                args.traces.mkdir(parents=True, exist_ok=True)
                os.environ["TENSOR_PEAK_TRACE"] = str(args.traces.resolve() / f"{spec.stem}-{{rank}}.json")
            peaks(lambda r: [str(BENCH / "tensor_peak.py"), str(work / f"tensors{r}.json"), str(program),
                             "--out", str(work / "out-tensors")], world, work, work / "tensors.log")
            tensors = [json.loads((work / f"tensors{r}.json").read_text()) for r in range(world)]
            rows[str(spec)] = []
            for d, (peak, file), t in zip(devices, measured, tensors):
                held = peak - base
                allocated = (peak - file) - (base - base_file)  # code pages left out on both sides
                ratio = d["total_bytes"] / held if held > 0 else float("nan")
                ratio_alloc = d["total_bytes"] / allocated if allocated > 0 else float("nan")
                ratio_t = d["total_bytes"] / t["peak_bytes"] if t["peak_bytes"] else float("nan")
                ratios.append(ratio_t)
                rows[str(spec)].append({"device": d["device"], "estimate_bytes": d["total_bytes"],
                                        "measured_bytes": held, "allocated_bytes": allocated, "peak_rss_bytes": peak,
                                        "rss_file_bytes": file, "baseline_bytes": base,
                                        "baseline_rss_file_bytes": base_file, "ratio": ratio,
                                        "ratio_allocated": ratio_alloc, "tensor_peak_bytes": t["peak_bytes"],
                                        "tensor_peak_at": t["peak_at"],
                                        "run_tensor_peak_bytes": t["run_peak_bytes"], "run_tensor_peak_at": t["run_peak_at"], "ratio_tensors": ratio_t,
                                        "estimate": {k: d[k] for k in d if k.endswith("_bytes")}})
                print(f"{spec.stem:<16} {d['device']:<7} estimate {d['total_bytes'] / 2**20:6.1f} MiB  "
                      f"measured {held / 2**20:6.1f} MiB ({ratio:4.2f})  allocated {allocated / 2**20:6.1f} MiB "
                      f"({ratio_alloc:4.2f})  tensors {t['peak_bytes'] / 2**20:6.1f} MiB ({ratio_t:4.2f})", flush=True)
    within = sum(0.9 <= r <= 1.1 for r in ratios)
    print(f"\n{within} of {len(ratios)} devices estimated within 10% of the measured tensor peak")
    import torch

    out = args.out or BENCH / "results" / f"memory-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"what": "plan's per-device memory estimate vs measured peak RSS over a torch + gloo baseline "
                   "(measured_bytes) and the same less file-backed pages (allocated_bytes)",
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                       "python": platform.python_version()},
           "steps": args.steps, "specs": rows}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
