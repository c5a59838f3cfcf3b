"""What verifying a checkpoint costs a resume: the sha256 of a rank's file (checked against its
COMPLETE before loading) against loading it (torch.load with weights_only, then the state into
the modules and the optimizer, as the generated program's read_checkpoint and load_checkpoint
do). An MLP with Adam, saved by the program's own save_hashed; the file in the page cache (a
restart right after a failure: hashing weighs most), then evicted from it before each try (a
resume another day: both read the disk).

    python bench/checkpoint_verify.py                 # 3 layers of 640: a 5 MB file
    python bench/checkpoint_verify.py --width 2048    # 50 MB

Prints the file's size and the median seconds of each over --repeat tries.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from placer.codegen import program  # noqa: E402


def template() -> dict:
    """The generated program's helpers and checkpoint functions, as it pastes them."""
    ns = {m.split(".")[0]: importlib.import_module(m.split(".")[0]) for m in program.STDLIB + ["torch"]}
    ns["dist"] = importlib.import_module("torch.distributed")
    ns["DTensor"] = importlib.import_module("torch.distributed.tensor").DTensor
    for name in ("helpers.py", "checkpoint.py"):
        exec(compile((program.TEMPLATES / name).read_text(), name, "exec"), ns)
    return ns


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one worker's share of a small machine
    ns = template()
    model = nn.Sequential(nn.Linear(16, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    state = {"step": 2, "rank": 0, "world": 1, "modules": [ns["local_tensors"](model.state_dict())],
             "optimizers": [ns["optimizer_state"](opt)], "schedulers": [], "rng": torch.get_rng_state(),
             "cuda_rng": None, "losses": [1.0, 0.9]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rank0.pt"
        entry = ns["save_hashed"](state, str(path))
        assert ns["file_sha256"](str(path)) == entry["sha256"]
        timings: dict[str, list[float]] = {"sha256 (verify)": [], "blake2b (for comparison)": [],
                                           "zlib.crc32 (for comparison)": [], "load": []}
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            ns["file_sha256"](str(path))
            t1 = time.perf_counter()
            hashlib.blake2b(path.read_bytes()).hexdigest()
            t2 = time.perf_counter()
            zlib.crc32(path.read_bytes())
            t3 = time.perf_counter()
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            ns["load_checkpoint"](loaded, [model], [opt])
            t4 = time.perf_counter()
            timings["sha256 (verify)"].append(t1 - t0)
            timings["blake2b (for comparison)"].append(t2 - t1)
            timings["zlib.crc32 (for comparison)"].append(t3 - t2)
            timings["load"].append(t4 - t3)
        cold: dict[str, list[float]] = {"load": [], "verify, then load": []}
        for _ in range(args.repeat if hasattr(os, "posix_fadvise") else 0):
            for name in cold:
                evict(path)
                t0 = time.perf_counter()
                if name != "load":
                    ns["file_sha256"](str(path))
                ns["load_checkpoint"](torch.load(path, map_location="cpu", weights_only=True), [model], [opt])
                cold[name].append(time.perf_counter() - t0)
    load = statistics.median(timings["load"])
    print(f"checkpoint file: {entry['bytes'] / 1e6:.1f} MB, median of {args.repeat}; in the page cache:")
    for name, values in timings.items():
        t = statistics.median(values)
        print(f"  {name:<26} {t * 1e3:8.2f} ms  ({t / load:.0%} of the load)")
    if cold["load"]:
        load = statistics.median(cold["load"])
        print("read from the disk (evicted from the page cache first):")
        for name, values in cold.items():
            t = statistics.median(values)
            print(f"  {name:<26} {t * 1e3:8.2f} ms  ({t / load:.0%} of the load)")


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache, so that the next read goes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
