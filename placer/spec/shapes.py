"""Static shape chaining for inline layers, without torch.

Shapes exclude the batch dim. Each known layer kind maps an input shape to an
output shape or explains why the layer cannot take it; an unknown layer ends
the chain (the rest is checked by `validate --deep` on the meta device).
"""
from __future__ import annotations

import math

from placer.spec.torch_names import NN_MODULE_KINDS
from placer.spec.types import Layer


def arg(layer: Layer, index: int, name: str, default=None):
    """A constructor argument given positionally or by keyword."""
    if name in layer.kwargs:
        return layer.kwargs[name]
    return layer.args[index] if len(layer.args) > index else default


def _tup(v, n: int) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,) * n


def conv_out(size: int, k: int, s: int, p: int, d: int) -> int:
    return math.floor((size + 2 * p - d * (k - 1) - 1) / s) + 1


def kind(layer: Layer) -> str:
    return NN_MODULE_KINDS.get(layer.op, "other")


def _spatial(layer: Layer, shape: tuple, nd: int, channels_out: int | None, pool: bool):
    if len(shape) != nd + 1:
        return f"{layer.op} expects {nd + 1} dims per sample (C, spatial...), got {list(shape)}"
    k = _tup(arg(layer, 0 if pool else 2, "kernel_size"), nd)
    s = _tup(arg(layer, 1 if pool else 3, "stride", None) or (k if pool else 1), nd)
    p = _tup(arg(layer, 2 if pool else 4, "padding", 0), nd)
    d = _tup(arg(layer, 3 if pool else 5, "dilation", 1), nd)
    if not all(isinstance(x, int) for x in k + s + p + d):
        return None
    if min(k + s + d) < 1 or min(p) < 0:
        return f"{layer.op} needs kernel_size, stride and dilation >= 1 and padding >= 0"
    out = tuple(conv_out(n, *a) for n, a in zip(shape[1:], zip(k, s, p, d)))
    if any(o < 1 for o in out):
        return f"{layer.op} output would be empty for input {list(shape)}"
    return (channels_out if channels_out is not None else shape[0],) + out


def infer(layer: Layer, shape: tuple | None):
    """Output shape, None if unknown, or an error string."""
    if shape is None:
        return None
    k = kind(layer)
    if k in ("elementwise", "dropout"):
        return shape
    if layer.op == "Linear":
        fin, fout = arg(layer, 0, "in_features"), arg(layer, 1, "out_features")
        if not shape or not isinstance(fin, int) or not isinstance(fout, int):
            return None
        if shape[-1] != fin:
            return f"Linear in_features is {fin} but its input has {shape[-1]} features (shape {list(shape)})"
        return shape[:-1] + (fout,)
    if layer.op in ("Conv1d", "Conv2d", "Conv3d"):
        cin, cout = arg(layer, 0, "in_channels"), arg(layer, 1, "out_channels")
        if not shape or not isinstance(cin, int):
            return None
        if shape[0] != cin:
            return f"{layer.op} in_channels is {cin} but its input has {shape[0]} channels (shape {list(shape)})"
        if arg(layer, 5, "dilation", 1) is None or isinstance(arg(layer, 4, "padding", 0), str):
            return None
        return _spatial(layer, shape, int(layer.op[-2]), cout, pool=False)
    if k == "pool" and layer.op[-2] in "123":
        return _spatial(layer, shape, int(layer.op[-2]), None, pool=True)
    if layer.op.startswith("BatchNorm"):
        n = arg(layer, 0, "num_features")
        if isinstance(n, int) and shape and shape[0] != n:
            return f"{layer.op} num_features is {n} but its input has {shape[0]} channels"
        return shape
    if layer.op == "LayerNorm":
        ns = arg(layer, 0, "normalized_shape")
        ns = tuple(ns) if isinstance(ns, list) else (ns,)
        if all(isinstance(n, int) for n in ns) and tuple(shape[-len(ns):]) != ns:
            return f"LayerNorm normalized_shape is {list(ns)} but its input ends with {list(shape[-len(ns):])}"
        return shape
    if layer.op == "Flatten":
        start, end = arg(layer, 0, "start_dim", 1), arg(layer, 1, "end_dim", -1)
        if start != 1 or end != -1:
            return None
        return (math.prod(shape),)
    if layer.op == "Embedding":
        dim = arg(layer, 1, "embedding_dim")
        return shape + (dim,) if isinstance(dim, int) else None
    return None


def chain(layers, input_shape: tuple):
    """Yield (layer, in_shape, out_shape_or_error) along the inline model."""
    shape = input_shape
    for layer in layers:
        out = infer(layer, shape)
        yield layer, shape, out
        shape = out if isinstance(out, tuple) else None
