"""The static shape rules of `placer.spec.shapes` agree with torch."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from placer.spec import shapes
from placer.spec.types import Layer


def _torch_len(module: nn.Module, n: int) -> int | None:
    """Output length of a 1-d module on input length n, None where torch refuses it."""
    try:
        return module(torch.zeros(1, 1, n)).shape[-1]
    except RuntimeError:
        return None


GRID = list(itertools.product((1, 2, 3), (1, 2, 3), (0, 1), (1, 2), (False, True), (3, 4, 5, 7, 8)))


@pytest.mark.parametrize("op", ["MaxPool1d", "AvgPool1d", "Conv1d"])
def test_output_length_matches_torch(op):
    """kernel, stride, padding, dilation, ceil_mode, input length: the same output length as torch."""
    checked = 0
    for k, s, p, d, ceil, n in GRID:
        if (op == "AvgPool1d" and d > 1) or (op == "Conv1d" and ceil) or (op != "Conv1d" and p > k // 2):
            continue  # no such argument, or torch refuses the module itself
        if op == "MaxPool1d":
            args = (k, s, p, d, False, ceil)
            module, layer = nn.MaxPool1d(*args), Layer(name="x", op=op, args=args)
        elif op == "AvgPool1d":
            module, layer = nn.AvgPool1d(k, s, p, ceil), Layer(name="x", op=op, args=(k, s, p, ceil))
        else:
            module, layer = nn.Conv1d(1, 1, k, s, p, d), Layer(name="x", op=op, args=(1, 1, k, s, p, d))
        want = _torch_len(module, n)
        got = shapes.infer(layer, (1, n))
        assert got == ((1, want) if want else f"{op} output would be empty for input [1, {n}]"), (k, s, p, d, ceil, n)
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("layer, shape", [
    (Layer(name="p", op="AvgPool2d", args=(2, 2, 0, True)), (4, 7, 7)),
    (Layer(name="p", op="AvgPool2d", args=(3,), kwargs={"stride": 2, "ceil_mode": True}), (4, 8, 6)),
    (Layer(name="p", op="MaxPool2d", args=(2, 2), kwargs={"ceil_mode": True}), (4, 5, 7)),
    (Layer(name="p", op="MaxPool2d", args=(3, 2, 1, 2, False, True)), (4, 9, 10)),
    (Layer(name="p", op="AvgPool3d", args=([2, 1, 2], None, 0, True)), (2, 5, 3, 3)),
    (Layer(name="c", op="Conv2d", args=(4, 6, [3, 1], [2, 1], [1, 0], [1, 1])), (4, 9, 5)),
])
def test_ceil_mode_and_positional_arguments(layer, shape):
    """AvgPool's fourth argument is ceil_mode and MaxPool's is dilation, as in torch."""
    module = getattr(nn, layer.op)(*layer.args, **layer.kwargs)
    assert shapes.infer(layer, shape) == tuple(module(torch.zeros(1, *shape)).shape[1:])


def test_window_reads_each_family_in_torch_order():
    avg = shapes.window(Layer(name="p", op="AvgPool2d", args=(2, None, 1, True)))
    assert avg == shapes.Window(kernel=(2, 2), stride=(2, 2), padding=(1, 1), dilation=(1, 1), ceil_mode=True)
    mx = shapes.window(Layer(name="p", op="MaxPool1d", args=(3, 1, 0, 2)))
    assert (mx.dilation, mx.ceil_mode) == ((2,), False)
    conv = shapes.window(Layer(name="c", op="Conv2d", args=(1, 1, 3), kwargs={"padding": "same"}))
    assert conv.stride == (1, 1) and not conv.static
    assert shapes.window(Layer(name="l", op="Linear", args=(2, 2))) is None
