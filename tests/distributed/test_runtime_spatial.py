"""Spatial split with halo exchange (runtime/spatial.py), for real over gloo: a Conv/Pool
stack split along H or W trains exactly like one device, bands even and uneven, stride,
dilation, ceil_mode, padding only at the image borders, BatchNorm synced over the bands."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from . import _harness as h
except ImportError:
    import _harness as h

pytestmark = pytest.mark.distributed


def run_spatial(rt, rank, world, sc, ranks, dim, stop, merge_to):
    """Layers [0, stop) split along dim over ranks, the rest (the classifier) on rank
    merge_to (output bands merged by transfer.redistribute, needs even bands) or, with
    merge_to None, replicated on the spatial ranks after an all-gather of the bands."""
    full = h.build_model(sc)
    shapes = h.activation_shapes(sc, full)  # sc.segments: [spatial, classifier]
    group = dist.new_group(ranks)
    head_ranks = ranks if merge_to is None else [merge_to]
    split = head = None
    if rank in ranks:
        split = rt["SpatialSplit"](h.segment_module(full, (0, stop)), group, ranks, dim,
                                   sc.in_shape[dim - 1])
        split_opt = h.make_optimizer(sc, split.parameters())
    if rank in head_ranks:
        head = nn.Sequential(*[full[i] for i in range(stop, len(full))])
        head_opt = h.make_optimizer(sc, head.parameters())
    loss_fn = getattr(nn, sc.loss)()
    me = ranks.index(rank) if rank in ranks else None
    losses = []
    for step in range(sc.steps):
        x, y = h.global_batch(rt, sc, step, shapes[-1])
        for m in (split, head):
            if m is not None:
                m.zero_grad(set_to_none=True)
        band = out = None
        if split is not None:
            lo, hi = rt["band_ranges"](x.shape[dim], len(ranks))[me]
            out = split(x.narrow(dim, lo, hi - lo))
            assert out.shape[dim] == len(range(*rt["band_ranges"](split.out_size, len(ranks))[me]))
        if merge_to is None:
            if split is not None:
                sizes = [b - a for a, b in rt["band_ranges"](split.out_size, len(ranks))]
                band = rt["gather_channels"](out, group, sizes, dim, ranks)  # any dim will do
        else:
            band = rt["redistribute"](out, ranks, head_ranks, shapes[1], dim=dim)
            if band is not None:
                band.requires_grad_()
        reported = torch.zeros(())
        if head is not None:
            loss = loss_fn(head(band), y)
            loss.backward()
            if rank == head_ranks[0]:
                reported = loss.detach().clone()
        if merge_to is not None:
            g = rt["redistribute_grad"](band.grad if head is not None else None, ranks,
                                        head_ranks, shapes[1], dim=dim)
            if split is not None:
                torch.autograd.backward(out, g)
        if split is not None:  # each band's weight gradient covers its rows only: sum
            rt["all_reduce_grads"](split.parameters(), group)
            split_opt.step()
        if head is not None:
            head_opt.step()
        dist.all_reduce(reported)
        losses.append(reported.item())
    held = (list(range(stop)) if split is not None else []) + (
        list(range(stop, len(full))) if head is not None else [])
    return {"losses": losses, "state": h.held_state(rt, full, held)}


def case(sc, ranks, dim, stop, merge_to):
    sc.segments = [h.Segment((0, stop), ranks), h.Segment((stop, len(sc.layers)), [0])]
    return sc, (sc.name, run_spatial, (sc, ranks, dim, stop, merge_to))


CASES = [
    # H over 2 ranks, even bands: conv (padding 1), pool, dilated conv; merged on rank 0
    case(h.Scenario("conv_pool_h2", segments=[], layers=[
        ("Conv2d", 2, 4, 3), ("ReLU",), ("MaxPool2d", 2), ("Conv2d", 4, 3, 3), ("ReLU",),
        ("Flatten",), ("Linear", 60, 4)], in_shape=(2, 8, 10), loss="CrossEntropyLoss",
        batch=4, kwargs={0: {"padding": 1}, 3: {"padding": 2, "dilation": 2}}),
        ranks=[0, 1], dim=2, stop=5, merge_to=0),
    # W over 3 ranks listed out of order, uneven bands (11 as 4, 4, 3): dilated conv,
    # BatchNorm2d, (3, 4) kernel with stride 2, ceil_mode max pool, padded avg pool
    case(h.Scenario("strided_w3", segments=[], layers=[
        ("Conv2d", 2, 3, 3), ("BatchNorm2d", 3), ("ReLU",), ("Conv2d", 3, 3, (3, 4)),
        ("MaxPool2d", 2), ("AvgPool2d", 2), ("Flatten",), ("Linear", 36, 4)],
        in_shape=(2, 6, 11), batch=4,
        kwargs={0: {"padding": 2, "dilation": 2}, 3: {"stride": 2, "padding": 1},
                4: {"ceil_mode": True}, 5: {"stride": 1, "padding": 1}}),
        ranks=[2, 0, 3], dim=3, stop=6, merge_to=None),
    # H over 4 ranks, 2 rows each: halos of 3 rows reach past the nearest neighbour
    case(h.Scenario("wide_kernel_h4", segments=[], layers=[
        ("Conv2d", 1, 2, 7), ("Tanh",), ("MaxPool2d", 3), ("Flatten",), ("Linear", 96, 3)],
        in_shape=(1, 8, 6), batch=4, kwargs={0: {"padding": 3}, 2: {"stride": 1, "padding": 1}}),
        ranks=[0, 1, 2, 3], dim=2, stop=3, merge_to=3),
]
SCENARIOS = [sc for sc, _ in CASES]
JOBS = [job for _, job in CASES]


# channel: gather_channels; buckets: all_reduce_grads
results = h.world_results(JOBS, ["spatial", "channel", "buckets"])
test_training_equals_one_device = h.training_test(SCENARIOS)


def test_band_ranges_and_unsupported_layers():
    rt = h.pasted_runtime(["spatial"])
    assert rt["band_ranges"](11, 3) == [(0, 4), (4, 8), (8, 11)]
    assert rt["band_ranges"](8, 2) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="padding_mode"):
        rt["_check_layer"](nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect"))
    with pytest.raises(ValueError, match="ceil_mode"):
        rt["_check_layer"](nn.AvgPool2d(2, ceil_mode=True))
