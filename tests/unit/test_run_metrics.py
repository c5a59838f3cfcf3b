"""What a run leaves to plot and to hold against the plan: metrics.csv and TensorBoard events
from the per-step records, the per-step facts the program reads locally (no collective), the
summary's measured memory beside the plan's, and DDP's all-reduce timed while it overlaps."""
from __future__ import annotations

import csv
import importlib
import json
import sys
import time
import types

import pytest
import torch

from placer.cli.run_cmd import summary_lines
from placer.codegen import program as program_module
from placer.codegen.runtime.ddp_sum import timed
from placer.launch.metrics import COLUMNS, MetricsWriter

RECORDS = [{"resumed_from": 0, "steps": 2},
           {"step": 1, "steps": 2, "loss": 2.5, "lr": 0.1, "step_s": 0.5, "memory_bytes": 1024, "elapsed_s": 0.5},
           {"step": 2, "steps": 2, "loss": 2.0, "lr": 0.05, "grad_norm": 3.0, "step_s": 0.25, "memory_bytes": 2048,
            "elapsed_s": 0.75}]


def rows(path):
    return list(csv.DictReader(path.open()))


def test_the_csv_has_a_row_per_step_and_the_steps_own_rate(tmp_path):
    writer = MetricsWriter(tmp_path, batch_size=8)
    for r in RECORDS:
        writer.add(r)
    writer.close()
    got = rows(tmp_path / "metrics.csv")
    assert tuple(got[0]) == COLUMNS
    assert [(r["step"], r["loss"], r["lr"], r["grad_norm"], r["samples_per_s"], r["memory_bytes"]) for r in got] == [
        ("1", "2.5", "0.1", "", "16.0", "1024"), ("2", "2.0", "0.05", "3.0", "32.0", "2048")]
    # a resumed run appends, without a second header
    writer = MetricsWriter(tmp_path, batch_size=8, append=True)
    writer.add(dict(RECORDS[2], step=3))
    writer.close()
    assert [r["step"] for r in rows(tmp_path / "metrics.csv")] == ["1", "2", "3"]


def test_without_tensorboard_one_line_says_so_and_the_csv_is_still_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # found nowhere, as if not installed
    writer = MetricsWriter(tmp_path, batch_size=8)
    for r in RECORDS:
        writer.add(r)
    writer.close()
    assert writer.note and "\n" not in writer.note and "pip install 'placer[tensorboard]'" in writer.note
    assert len(rows(tmp_path / "metrics.csv")) == 2 and not (tmp_path / "tensorboard").exists()


def test_tensorboard_events_hold_every_scalar(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, batch_size=8)
    assert writer.board is None  # made at the first step, off the workers' start
    for r in RECORDS:
        writer.add(r)
    writer.close()
    assert writer.note is None
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5), (2, 2.0)]
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([0.1, 0.05])
    assert [e.step for e in events.Scalars("train/grad_norm")] == [2]


class FakeDist:
    def all_reduce(self, tensor, async_op=False):
        return types.SimpleNamespace(wait=lambda: None)


def test_each_step_records_its_time_learning_rate_and_memory(tmp_path):
    ns = {m.split(".")[0]: importlib.import_module(m.split(".")[0]) for m in program_module.STDLIB + ["torch"]}
    ns |= {"BATCH_SIZE": 4, "dist": FakeDist()}
    exec(compile((program_module.TEMPLATES / "helpers.py").read_text(), "helpers.py", "exec"), ns)
    tracker = ns["BatchLosses"]([], types.SimpleNamespace(out=str(tmp_path), steps=2), 0, time.perf_counter())
    ns["watch_lr"]()
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    ns["BOUND"]["device"] = torch.device("cpu")
    # 64 MiB above the RSS the helpers started from: larger than glibc's largest mmap threshold,
    # so new pages (a smaller tensor may reuse heap that the long test process freed earlier)
    grown = torch.ones(16 << 20)
    tracker.add(0, torch.tensor(1.0))
    tracker.settle()
    (record,) = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert record["lr"] == 0.25 and record["step_s"] > 0
    assert record["memory_bytes"] >= 0.9 * grown.numel() * 4
    assert ns["peak_memory"]() == (pytest.approx(record["memory_bytes"], rel=0.5), "peak_rss_above_import")


def test_ddp_comm_time_counts_each_bucket_from_launch_to_completion_once():
    timing = {"overlapped": 0.0}
    futures = []

    def hook(group, bucket):
        futures.append(torch.futures.Future())
        return futures[-1]

    run = timed(hook, timing)
    first = run(None, None)
    time.sleep(0.05)
    second = run(None, None)  # launched while the first is in flight
    time.sleep(0.05)
    futures[0].set_result(torch.ones(1))
    time.sleep(0.05)
    futures[1].set_result(torch.zeros(1))
    assert first.wait().item() == 1 and second.wait().item() == 0  # the bucket passes through
    # in flight from the first launch to the last completion: ~0.15 s, not 0.1 + 0.1 counted twice
    assert 0.14 <= timing["overlapped"] < 0.2


def test_the_summary_prints_measured_memory_beside_the_plan_with_their_ratio():
    metrics = {"steps": 2, "devices": ["cpu", "cpu:1", "cuda:0"], "time_s": {"cpu": {"comm": 0.5}},
               "peak_memory": {"cpu": {"peak_bytes": 90 << 20, "measure": "peak_rss_above_import",
                                       "tensor_peak_bytes": 3 << 20},
                               "cpu:1": {"peak_bytes": 80 << 20, "measure": "peak_rss_above_import"},
                               "cuda:0": {"peak_bytes": 1 << 20, "measure": "cuda_max_memory_allocated"}}}
    lines = summary_lines(metrics, 1.0, planned={"cpu": 2 << 20, "cpu:1": 512 << 10, "cuda:0": 1 << 20})
    assert lines[1].split()[-4:] == ["peak", "memory", "planned", "ratio"]
    assert lines[2].startswith("cpu ") and lines[2].endswith("3.0 MiB    2.0 MiB   1.50")  # tensors, not the RSS
    assert lines[3].endswith("-  512.0 KiB      -")  # no tensor peak: the RSS is not set beside the plan
    assert lines[4].endswith("1.0 MiB    1.0 MiB   1.00")
    notes = "\n".join(lines)
    assert "CPU allocator held for tensors" in notes and "torch.cuda.max_memory_allocated" in notes
    assert "RSS is in metrics.json" in notes
