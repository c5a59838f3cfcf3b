"""The progress line's loss is summed over the ranks off the critical path: the shares of a window
of steps travel in one asynchronous all-reduce that is read when the next window is sent
(BatchLosses, pasted into every program), while the losses kept, the progress lines and a NaN's
stop stay what they were."""
from __future__ import annotations

import importlib
import json
import time
import types

import pytest
import torch

from placer.codegen import program as program_module


class FakeDist:
    """An all-reduce of two ranks whose peer holds the same loss shares and proposes no window (0
    in the last slot): the sum is written into the tensor only when the caller waits, as a real
    asynchronous one may."""

    def __init__(self):
        self.calls, self.waited = [], []

    def all_reduce(self, tensor, async_op=False):
        assert async_op, "the loss's all-reduce must not block the step"
        self.calls.append(tensor.tolist())
        dist = self

        class Work:
            def wait(self):
                dist.waited.append(tensor.tolist())
                tensor[:-1].mul_(2)

        return Work()


def batch_losses(tmp_path, steps=8, report_s=None, most=None):
    ns = {m.split(".")[0]: importlib.import_module(m.split(".")[0]) for m in program_module.STDLIB + ["torch"]}
    ns |= {"BATCH_SIZE": 4, "dist": FakeDist()}
    exec(compile((program_module.TEMPLATES / "helpers.py").read_text(), "helpers.py", "exec"), ns)
    args = types.SimpleNamespace(out=str(tmp_path), steps=steps)
    losses: list[float] = []
    tracker = ns["BatchLosses"](losses, args, 0, time.perf_counter())
    if report_s is not None:
        tracker.REPORT_S = report_s
    if most is not None:
        tracker.MOST = most
    return ns, losses, tracker


def shown(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]


def test_a_window_of_steps_shares_one_all_reduce_read_when_the_next_is_sent(tmp_path):
    ns, losses, tracker = batch_losses(tmp_path, most=4)  # steps of microseconds: the longest window
    tracker.add(0, torch.tensor(1.0))  # the first step goes at once, with rank 0's proposal of 4
    assert ns["dist"].calls == [[1.0, 4.0]] and ns["dist"].waited == [] and losses == []
    tracker.add(1, torch.tensor(2.0))  # reads step 0's sum, sends step 1 alone (the agreed window is read now)
    assert ns["dist"].waited == [[1.0, 4.0]] and losses == [2.0] and ns["dist"].calls[-1] == [2.0, 4.0]
    for step in range(2, 5):
        tracker.add(step, torch.tensor(step + 1.0))
    assert len(ns["dist"].calls) == 2 and losses == [2.0]  # steps 2..4 wait for a fourth
    tracker.add(5, torch.tensor(6.0))
    assert ns["dist"].calls[-1] == [3.0, 4.0, 5.0, 6.0, 4.0] and losses == [2.0, 4.0]
    tracker.add(6, torch.tensor(7.0))
    tracker.settle()  # a checkpoint or the end: the unsent step too
    tracker.settle()  # nothing left: no-op
    assert losses == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0] and len(ns["dist"].calls) == 4
    records = shown(tmp_path)
    assert [(r["step"], r["loss"]) for r in records] == [(i + 1, 2.0 * (i + 1)) for i in range(7)]
    ends = [r["elapsed_s"] for r in records]  # when each step ended, not when it was shown
    assert ends == sorted(ends) and ends[-1] < records[-1]["step_s"] + ends[-2] + 1e-3


def test_slow_steps_are_summed_one_at_a_time(tmp_path):
    """A window of about REPORT_S: steps slower than that go alone, as each ends."""
    ns, losses, tracker = batch_losses(tmp_path, report_s=0.0)
    for step in range(3):
        tracker.add(step, torch.tensor(1.0))
    assert [len(c) for c in ns["dist"].calls] == [2, 2, 2] and losses == [2.0, 2.0]


def test_a_non_finite_loss_stops_the_run_naming_its_own_step(tmp_path):
    ns, losses, tracker = batch_losses(tmp_path, most=2)
    tracker.add(0, torch.tensor(1.0))
    tracker.add(1, torch.tensor(float("nan")))  # sent alone: step 0's window was read as it went
    tracker.add(2, torch.tensor(1.0))
    with pytest.raises(ns["StopRun"]) as stop:
        tracker.add(3, torch.tensor(1.0))  # the window of 2 is full: step 1's sum is read
    assert stop.value.step == 2 and "nan at step 2" in str(stop.value) and losses == [2.0]
