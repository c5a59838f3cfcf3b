# spatial: a Conv/Pool stack split along one spatial dim (H or W). Every tensor of the
# segment is held as contiguous bands of that dim, one per rank in listed order, sized as
# evenly as possible (band_ranges). Before a Conv or Pool each rank gets from the others
# the halo rows that its output band reads (from kernel, stride, padding, dilation), pads
# only at the true image borders (zeros, or -inf for max pooling), and runs the layer with
# no padding on that dim: the result is exactly the unsplit layer's rows. In backward the
# halo rows' gradients go back to their owners and are added to theirs. Weights are whole
# on every rank and each rank's weight gradient covers its rows only: sum them over the
# group after backward (buckets.all_reduce_grads). BatchNorm runs as CPUSyncBatchNorm over
# the group (statistics of every band together), elementwise layers run on the band.
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .syncbn import convert_sync_batchnorm_cpu
from .transfer import Posted

SPATIAL_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
SPATIAL_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d,
                 nn.AvgPool3d)
SPATIAL_ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
                       nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish,
                       nn.Hardsigmoid, nn.Softplus, nn.Identity)


def band_ranges(n, d):
    """[(start, stop)] of n rows over d ranks, as evenly as possible, larger bands first
    (equal to transfer's slices when d divides n)."""
    q, r = divmod(n, d)
    sizes = [q + 1 if i < r else q for i in range(d)]
    starts = [sum(sizes[:i]) for i in range(d)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def _overlap(a, b):
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def _post_halo(x, ranks, me, send_rows, recv_rows, origin, dim, shape):
    """Post, for every peer, the send of my rows send_rows(peer) (x starts at row origin)
    and the receive of rows recv_rows(peer); returns (posted, {start: buffer})."""
    posted, got = Posted("direct"), {}
    for i, peer in enumerate(ranks):
        if i == me:
            continue
        rows = send_rows(i)
        if rows:
            posted.send(x.narrow(dim, rows[0] - origin, rows[1] - rows[0]), peer)
        rows = recv_rows(i)
        if rows:
            buf_shape = list(shape)
            buf_shape[dim] = rows[1] - rows[0]
            got[rows[0]] = posted.recv(buf_shape, x.dtype, peer, x.device)
    return posted, got


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ranks, owned, needed, dim, border):
        me = ranks.index(dist.get_rank())
        ctx.args, ctx.shape = (ranks, me, owned, needed, dim, border), x.shape
        with torch.no_grad():
            posted, pieces = _post_halo(
                x, ranks, me, lambda i: _overlap(owned[me], needed[i]),
                lambda i: _overlap(owned[i], needed[me]), owned[me][0], dim, x.shape)
            mine = _overlap(owned[me], needed[me])
            if mine:
                pieces[mine[0]] = x.narrow(dim, mine[0] - owned[me][0], mine[1] - mine[0])
            posted.wait()
            lo, hi, value = border  # the image border's padding rows, made in the same copy
            parts = [_rows(x, dim, lo, value)] + [pieces[s] for s in sorted(pieces)] + [_rows(x, dim, hi, value)]
            return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        ranks, me, owned, needed, dim, (lo, hi, _) = ctx.args
        origin = owned[me][0]
        with torch.no_grad():
            grad = grad.narrow(dim, lo, grad.shape[dim] - lo - hi).contiguous()  # padding rows: no one's
            # the rows I received go back to their owners; the rows I sent come back to me
            posted, back = _post_halo(
                grad, ranks, me, lambda i: _overlap(owned[i], needed[me]),
                lambda i: _overlap(owned[me], needed[i]), needed[me][0], dim, ctx.shape)
            dx = grad.new_zeros(ctx.shape)
            mine = _overlap(owned[me], needed[me])
            if mine:
                dx.narrow(dim, mine[0] - origin, mine[1] - mine[0]).add_(
                    grad.narrow(dim, mine[0] - needed[me][0], mine[1] - mine[0]))
            posted.wait()
            for start, g in back.items():
                dx.narrow(dim, start - origin, g.shape[dim]).add_(g)
        return dx, None, None, None, None, None


def _rows(x, dim, n, value):
    """n rows of `value` shaped as x's rows along dim."""
    shape = list(x.shape)
    shape[dim] = n
    return x.new_full(shape, value)


def halo_exchange(x, ranks, owned, needed, dim, border=(0, 0, 0.0)):
    """x: this rank's rows owned[me] = (start, stop) of a tensor split along dim over the
    global ranks `ranks` (listed order; owned[i] for every rank i, a partition). Returns rows
    needed[me] (inside the tensor), assembled from the owners, with border = (lo, hi, value):
    lo rows of value before them and hi after (the image border's padding), in one copy.
    Backward sends each halo row's gradient back to its owner and adds it there. Every rank of
    `ranks` calls it."""
    return _HaloExchange.apply(x, list(ranks), [tuple(r) for r in owned],
                               [tuple(r) for r in needed], dim, tuple(border))


def _tuple(v, n):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def _geometry(layer):
    """(n spatial dims, kernel, stride, dilation, [(pad lo, pad hi)] per spatial dim)."""
    n = 1 + [nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
             nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d].index(type(layer)) % 3
    k = _tuple(layer.kernel_size, n)
    s = _tuple(layer.stride if layer.stride is not None else layer.kernel_size, n)
    dil = _tuple(getattr(layer, "dilation", 1), n)
    if isinstance(layer.padding, str):  # conv 'valid' / 'same' (stride 1): lo gets the less
        total = [0 if layer.padding == "valid" else dil[j] * (k[j] - 1) for j in range(n)]
        pads = [(t // 2, t - t // 2) for t in total]
    else:
        pads = [(p, p) for p in _tuple(layer.padding, n)]
    return n, k, s, dil, pads


def _out_size(layer, n_in, j):
    _, k, s, dil, pads = _geometry(layer)
    span = n_in + pads[j][0] + pads[j][1] - dil[j] * (k[j] - 1) - 1
    if not getattr(layer, "ceil_mode", False):
        return span // s[j] + 1
    out = -(-span // s[j]) + 1
    return out - 1 if (out - 1) * s[j] >= n_in + pads[j][0] else out  # torch's rule


def _check_layer(layer):
    if isinstance(layer, SPATIAL_CONVS) and layer.padding_mode != "zeros":
        raise ValueError(f"spatial split of {type(layer).__name__} with padding_mode="
                         f"{layer.padding_mode!r} is not supported (only 'zeros')")
    if isinstance(layer, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)) and layer.return_indices:
        raise ValueError("spatial split of a MaxPool with return_indices=True is not supported")
    padded = any(map(any, _geometry(layer)[4])) if isinstance(layer, SPATIAL_POOLS) else False
    if isinstance(layer, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)) and (
            layer.ceil_mode or padded and not layer.count_include_pad):
        raise ValueError("spatial split of an AvgPool needs ceil_mode=False and, with "
                         "padding, count_include_pad=True")


class SpatialSplit(nn.Sequential):
    """A segment (the full layers, in order, under their own names) split along dim (an
    index into the activation, >= 2: 2 is H and 3 is W of NCHW) over the global ranks
    `ranks` (listed order = band order) of `group`; size is the input's length along dim.
    forward takes this rank's band of the input (band_ranges(size, d)[me]) and returns its
    band of the output (band_ranges(self.out_size, d)[me]). BatchNorm children become
    CPUSyncBatchNorm over group, sharing the full layer's parameters and buffers."""

    def __init__(self, layers, group, ranks, dim, size):
        named = list(layers.named_children()) if isinstance(layers, nn.Module) else list(layers)
        ranks = list(ranks)
        d, me = len(ranks), ranks.index(dist.get_rank())
        super().__init__()
        plan = []
        for name, layer in named:
            if isinstance(layer, SPATIAL_CONVS + SPATIAL_POOLS):
                _check_layer(layer)
                n, k, s, dil, pads = _geometry(layer)
                j = dim - 2  # which spatial dim
                if not 0 <= j < n:
                    raise ValueError(f"{name}: {type(layer).__name__} has no spatial dim {dim}")
                out = _out_size(layer, size, j)
                if out < d:
                    raise ValueError(f"{name}: {out} output rows along dim {dim} cannot be "
                                     f"split over {d} ranks")
                owned, needed, padding = band_ranges(size, d), [], []
                for a, b in band_ranges(out, d):
                    lo = a * s[j] - pads[j][0]
                    hi = (b - 1) * s[j] - pads[j][0] + dil[j] * (k[j] - 1) + 1
                    inside = (min(max(lo, 0), size), max(min(hi, size), 0))
                    needed.append((inside[0], max(inside)))  # empty if all is padding
                    padding.append((max(0, min(hi, 0) - lo), max(0, hi - max(lo, size))))
                # no rank reads another's rows (a 2x2 pool on even bands): no exchange, no copy
                exchange = any(a != b for a, b in zip(owned, needed))
                plan.append(("halo", owned, needed, padding[me], pads, n, exchange))
                size = out
            elif isinstance(layer, nn.modules.batchnorm._BatchNorm):
                layer = convert_sync_batchnorm_cpu(layer, group)
                plan.append(("band",))
            elif isinstance(layer, SPATIAL_ELEMENTWISE):
                plan.append(("band",))
            else:
                raise ValueError(f"{name}: {type(layer).__name__} cannot run on a band of "
                                 f"rows (spatial split takes Conv, Pool, BatchNorm and "
                                 "elementwise layers)")
            self.add_module(name, layer)
        self.group, self.ranks, self.dim, self.out_size = group, ranks, dim, size
        self._plan = plan

    def forward(self, x):
        for layer, step in zip(self.children(), self._plan):
            if step[0] == "band":
                x = layer(x)
                continue
            _, owned, needed, (lo, hi), pads, n, exchange = step
            # the image border's rows on the split dim: zeros, or -inf before a max pool
            value = float("-inf") if isinstance(layer, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)) else 0.0
            if exchange:
                x = halo_exchange(x, self.ranks, owned, needed, self.dim, (lo, hi, value))
            else:
                x = _pad_dim(x, self.dim, lo, hi, value)
            x = _apply_on_rows(layer, x, self.dim, pads, n)
        return x


def _pad_dim(x, dim, lo, hi, value=0.0):
    if not lo and not hi:
        return x
    return F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [lo, hi], value=value)


def _apply_on_rows(layer, x, dim, pads, n):
    """layer on rows that already hold its whole receptive field along dim, the image border's
    padding rows included; the other spatial dims keep the layer's own padding."""
    j = dim - 2
    padding = [0 if i == j else pads[i][0] for i in range(n)]
    if isinstance(layer, SPATIAL_CONVS):
        for i in range(n):  # the kernel pads the other dims itself, unless unevenly ('same', even kernel)
            if i != j and pads[i][0] != pads[i][1]:
                x, padding[i] = _pad_dim(x, 2 + i, *pads[i]), 0
        fsdp = sys.modules.get("torch.distributed.fsdp")  # (a layer cannot be FSDP2's before it is imported)
        if fsdp is None or not isinstance(layer, fsdp.FSDPModule):
            conv = (F.conv1d, F.conv2d, F.conv3d)[n - 1]  # not the module: a placed layer's hooks stay out
            return conv(x, layer.weight, layer.bias, layer.stride, tuple(padding), layer.dilation, layer.groups)
        # an FSDP2 unit is called as a module (its padding this meanwhile), so its hooks run: the
        # gather of its weights before its forward and its backward, its gradients' reduce-scatter
        kept, layer.padding = layer.padding, tuple(padding)
        try:
            return layer(x)
        finally:
            layer.padding = kept
    padding = tuple(padding)
    if isinstance(layer, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
        pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[n - 1]
        return pool(x, layer.kernel_size, layer.stride, padding, layer.dilation,
                    ceil_mode=layer.ceil_mode)
    if n == 1:
        return F.avg_pool1d(x, layer.kernel_size, layer.stride, padding, False,
                            layer.count_include_pad)
    pool = (None, F.avg_pool2d, F.avg_pool3d)[n - 1]
    return pool(x, layer.kernel_size, layer.stride, padding, False, layer.count_include_pad,
                layer.divisor_override)
