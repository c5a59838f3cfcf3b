"""The `cpu` profile is measured here: two gloo processes, FSDP2 and DTensor included."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from placer.estimate.calibrate import CONV_SIZES, REDUCE_SIZES, calibrate  # noqa: E402
from placer.estimate.hardware import rate  # noqa: E402


def test_calibration_measures_every_figure_of_the_cpu_profile():
    hw = calibrate(1)
    figures = {k: v for k, v in vars(hw).items() if isinstance(v, float) and k != "batch_s"}  # batch_s: a plan's
    # step_overhead and action_s are what a timing leaves over its parts, clamped at 0 under load
    differences = ("step_overhead", "action_s", "overlap")  # overlap: a fraction, 0 where nothing hides
    assert all(math.isfinite(v) and v > 0 for k, v in figures.items() if k not in differences), figures
    assert all(getattr(hw, k) >= 0 for k in differences)
    assert len(hw.rates) >= 3 and rate(hw, 1e12) == hw.flops
    assert len(hw.conv_rates) == len(CONV_SIZES) and all(f > 0 and r > 0 and b > 0 for f, r, b in hw.conv_rates)
    assert [f for f, _, _ in hw.conv_rates] == sorted(f for f, _, _ in hw.conv_rates)  # interpolated by size
    assert [b for b, _ in hw.reduce_times] == [4 * n for n in REDUCE_SIZES] and all(t > 0 for _, t in hw.reduce_times)
    for table in (hw.gather_times, hw.scatter_times):  # keyed by the bytes each process sends: half the tensor
        assert [b for b, _ in table] == [2 * n for n in REDUCE_SIZES] and all(t > 0 for _, t in table)
    assert 0 <= hw.overlap <= 1
    # how the figures compare (a message against a layer's fixed cost, FSDP2's collectives against
    # a bare all-reduce) depends on the machine's load: bench/cost_model.py reports them, no assert
