"""The progress line's loss is summed over the ranks off the critical path: a step hands its
share to an asynchronous all-reduce and reads the sum one step later (BatchLosses, pasted into
every program), while the losses kept and a NaN's stop stay what they were."""
from __future__ import annotations

import importlib
import json
import types

import pytest
import torch

from placer.codegen import program as program_module


class FakeDist:
    """An all-reduce of two ranks whose peer holds the same share: the sum is twice the share,
    written into the tensor only when the caller waits, as a real asynchronous one may."""

    def __init__(self):
        self.calls, self.waited = [], []

    def all_reduce(self, tensor, async_op=False):
        assert async_op, "the loss's all-reduce must not block the step"
        self.calls.append(float(tensor))
        dist = self

        class Work:
            def wait(self):
                dist.waited.append(float(tensor))
                tensor.mul_(2)

        return Work()


def batch_losses(tmp_path, steps=3):
    ns = {m.split(".")[0]: importlib.import_module(m.split(".")[0]) for m in program_module.STDLIB + ["torch"]}
    ns |= {"BATCH_SIZE": 4, "dist": FakeDist()}
    exec(compile((program_module.TEMPLATES / "helpers.py").read_text(), "helpers.py", "exec"), ns)
    args = types.SimpleNamespace(out=str(tmp_path), steps=steps)
    losses: list[float] = []
    return ns, losses, ns["BatchLosses"](losses, args, 0, 0.0)


def test_a_steps_sum_is_read_one_step_later_and_every_loss_is_kept(tmp_path):
    ns, losses, tracker = batch_losses(tmp_path)
    tracker.add(0, torch.tensor(1.0))
    assert ns["dist"].calls == [1.0] and ns["dist"].waited == [] and losses == []  # step 0 did not wait
    tracker.add(1, torch.tensor(2.0))
    assert ns["dist"].waited == [1.0] and losses == [2.0]
    tracker.add(2, torch.tensor(3.0))
    tracker.settle()
    tracker.settle()  # nothing pending: no-op
    assert losses == [2.0, 4.0, 6.0]
    shown = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in shown] == [(1, 2.0), (2, 4.0), (3, 6.0)]


def test_a_non_finite_loss_stops_the_run_naming_its_own_step(tmp_path):
    ns, losses, tracker = batch_losses(tmp_path)
    tracker.add(0, torch.tensor(1.0))
    tracker.add(1, torch.tensor(float("nan")))
    with pytest.raises(ns["StopRun"]) as stop:
        tracker.add(2, torch.tensor(1.0))
    assert stop.value.step == 2 and "nan at step 2" in str(stop.value)
