"""Static shape chaining for inline layers, without torch.

Shapes exclude the batch dim. Each known layer kind maps an input shape to an
output shape or explains why the layer cannot take it; an unknown layer ends
the chain (the rest is checked by `validate --deep` on the meta device).

`param` and `window` are the one reading of Conv/Pool arguments (kernel, stride,
padding, dilation, ceil_mode) that the checks, the shapes and the plan's halos use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from placer.spec.torch_names import NN_MODULE_KINDS
from placer.spec.types import Layer


def arg(layer: Layer, index: int, name: str, default=None):
    """A constructor argument given positionally or by keyword."""
    if name in layer.kwargs:
        return layer.kwargs[name]
    return layer.args[index] if len(layer.args) > index else default


def _tup(v, n: int) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,) * n


def op_kind(op: str) -> str:
    """`linear`, `conv`, `elementwise`, `dropout`, ... of a torch.nn class name; `other` if unlisted."""
    return NN_MODULE_KINDS.get(op, "other")


def kind(layer: Layer) -> str:
    return op_kind(layer.op)


# torch's positional order of the constructor arguments that placer reads, per layer family
# (AvgPool's fourth argument is ceil_mode, MaxPool's is dilation).
_PARAMS = {
    "Conv": ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "bias",
             "padding_mode"),
    "MaxPool": ("kernel_size", "stride", "padding", "dilation", "return_indices", "ceil_mode"),
    "AvgPool": ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
}


def param(layer: Layer, name: str, default=None):
    """A Conv/MaxPool/AvgPool constructor argument by name, given positionally or by keyword;
    `default` also for a parameter the layer's class lacks (AvgPool has no dilation)."""
    params = _PARAMS[layer.op[:-2]]
    return arg(layer, params.index(name), name, default) if name in params else default


@dataclass(frozen=True)
class Window:
    """How a Conv or Pool slides over its spatial dims, one entry per dim, read as torch reads
    the arguments. Entries are what the user wrote: not ints for `padding: same` and the like."""

    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    ceil_mode: bool = False

    @property
    def static(self) -> bool:
        """Every size is an int, so output sizes and halos are known without torch."""
        return all(isinstance(x, int) for x in self.kernel + self.stride + self.padding + self.dilation)

    def out_size(self, j: int, n: int) -> int:
        """Output length along spatial dim j for input length n, as torch computes it."""
        k, s, p, d = self.kernel[j], self.stride[j], self.padding[j], self.dilation[j]
        span = n + 2 * p - d * (k - 1) - 1
        if not self.ceil_mode:
            return span // s + 1
        out = -(-span // s) + 1
        # torch drops a last window that would start in the right padding
        return out - 1 if (out - 1) * s >= n + p else out


def window(layer: Layer) -> Window | None:
    """The window of an inline Conv1d-3d, MaxPool1d-3d or AvgPool1d-3d; None for other layers."""
    if kind(layer) not in ("conv", "pool") or layer.op[-2] not in "123":
        return None
    n, pool = int(layer.op[-2]), kind(layer) == "pool"
    k = _tup(param(layer, "kernel_size"), n)
    stride = param(layer, "stride", None if pool else 1)
    return Window(kernel=k, stride=k if stride is None else _tup(stride, n),
                  padding=_tup(param(layer, "padding", 0), n), dilation=_tup(param(layer, "dilation", 1), n),
                  ceil_mode=bool(param(layer, "ceil_mode", False)))


def _spatial(layer: Layer, shape: tuple, channels_out: int | None):
    w, nd = window(layer), int(layer.op[-2])
    assert w is not None  # every "conv" and "pool" kind is a 1-3d Conv/Pool: it has a window
    if len(shape) != nd + 1:
        return f"{layer.op} expects {nd + 1} dims per sample (C, spatial...), got {list(shape)}"
    if not w.static:
        return None
    if min(w.kernel + w.stride + w.dilation) < 1 or min(w.padding) < 0:
        return f"{layer.op} needs kernel_size, stride and dilation >= 1 and padding >= 0"
    out = tuple(w.out_size(j, n) for j, n in enumerate(shape[1:]))
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
    if k == "conv":
        cin, cout = param(layer, "in_channels"), param(layer, "out_channels")
        if not shape or not isinstance(cin, int):
            return None
        if shape[0] != cin:
            return f"{layer.op} in_channels is {cin} but its input has {shape[0]} channels (shape {list(shape)})"
        return _spatial(layer, shape, cout)
    if k == "pool":
        return _spatial(layer, shape, None)
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
    shape: tuple | None = input_shape
    for layer in layers:
        out = infer(layer, shape)
        yield layer, shape, out
        shape = out if isinstance(out, tuple) else None
