"""Channel split (runtime/channel.py) and copies into and out of replicated groups
(runtime/replicate.py), for real over gloo: training equals one device's, uneven channel
counts, Conv and BatchNorm slices, group order that is not rank order."""

from collections import OrderedDict
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from . import _harness as h
except ImportError:
    import _harness as h

pytestmark = pytest.mark.distributed

WORLD = 4


@dataclass
class ModeSegment:
    layers: tuple[int, int]  # [start, stop) into Scenario.layers
    ranks: list[int]  # listed order: slice order
    mode: str | None = None  # None (one rank) | channel | tensor


def _build(rt, mode, seq, group, ranks):
    if mode == "channel":
        return rt["ChannelSplit"](seq, group, ranks)
    if mode == "tensor":
        rt["tensor_parallelize"](seq, group)
    return seq


def run_modes(rt, rank, world, sc):
    """A training run whose segments are single ranks or replicated groups (channel,
    tensor), as the code generator composes them; returns losses and the held state."""
    full = h.build_model(sc)
    shapes = h.activation_shapes(sc, full)
    segs = []
    for seg in sc.segments:
        group = dist.new_group(seg.ranks)
        module = opt = None
        if rank in seg.ranks:
            seq = nn.Sequential(OrderedDict((str(i), full[i]) for i in range(*seg.layers)))
            module = _build(rt, seg.mode, seq, group, seg.ranks)
            params = list(module.parameters())
            opt = h.make_optimizer(sc, params) if params else None
        segs.append((seg, group, module, opt))
    rep = [len(seg.ranks) > 1 for seg in sc.segments]  # every multi-rank group here is
    loss_fn = getattr(nn, sc.loss)()                     # replicated
    losses = []
    for step in range(sc.steps):
        x, y = h.global_batch(rt, sc, step, shapes[-1])
        acts, out = [], None
        for k, (seg, group, module, _) in enumerate(segs):
            if k == 0:
                inp = x if rank in seg.ranks else None
            else:
                inp = rt["redistribute_replicated"](
                    out, segs[k - 1][0].ranks, seg.ranks, shapes[k],
                    src_replicated=rep[k - 1], dst_replicated=rep[k])
                if inp is not None:
                    inp.requires_grad_()
            out = module(inp) if module is not None else None
            acts.append((inp, out))
        last = segs[-1][0]
        reported = torch.zeros(())
        if rank in last.ranks:
            loss = loss_fn(out, y)  # the whole batch on every rank of a replicated group
            if rank == last.ranks[0]:
                reported = loss.detach().clone()
        grad = None
        for k in reversed(range(len(segs))):
            seg, group, module, opt = segs[k]
            inp, out = acts[k]
            if module is not None:
                module.zero_grad(set_to_none=True)
                if k == len(segs) - 1:
                    loss.backward()
                elif out.requires_grad:  # not so for a first segment without weights
                    torch.autograd.backward(out, grad)
            if k > 0:
                prev = segs[k - 1]
                grad = rt["redistribute_replicated_grad"](
                    inp.grad if module is not None else None, prev[0].ranks, seg.ranks,
                    shapes[k], src_replicated=rep[k - 1], dst_replicated=rep[k],
                    src_group=prev[1])
        for _, _, module, opt in segs:
            if opt is not None:
                opt.step()
        dist.all_reduce(reported)
        losses.append(reported.item())
    state, held = {}, {}
    for k, (seg, _, module, _) in enumerate(segs):
        if module is None:
            continue
        held[k] = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                      for p in module.parameters())  # what this rank holds of segment k
        if seg.mode == "channel":
            rt["channel_unshard"](module)
        for i in range(*seg.layers):
            layer_state = rt["unsharded_state_dict"](full[i])
            state.update({f"{i}.{k}": v.detach().clone() for k, v in layer_state.items()})
    return {"losses": losses, "state": state, "held": held}


def job(sc):
    return (sc.name, run_modes, (sc,))


M = ModeSegment
MLP_BN = [("Linear", 6, 8), ("ReLU",), ("Linear", 8, 8), ("BatchNorm1d", 8), ("Tanh",),
          ("Linear", 8, 5)]
CONV = [("Conv2d", 2, 5, 3), ("BatchNorm2d", 5), ("ReLU",), ("MaxPool2d", 2),
        ("Conv2d", 5, 3, 3), ("ReLU",), ("Flatten",), ("Linear", 12, 7), ("ReLU",),
        ("Linear", 7, 4)]

SCENARIOS = [
    # whole model over 3 ranks: 8 features as [3, 3, 2], 5 as [2, 2, 1]; BatchNorm1d on
    # the slice; the loss computed on every rank of the group and reported once
    h.Scenario("mlp_bn_3", MLP_BN, [M((0, 6), [0, 1, 2], "channel")]),
    # listed order is not rank order: rank 2 holds slice 0
    h.Scenario("mlp_out_of_order_4", MLP_BN, loss="CrossEntropyLoss", classes=5, segments=[
        M((0, 6), [2, 0, 3, 1], "channel")]),
    # one rank -> channel group (Conv, BatchNorm2d, pool, Flatten gathers, Linear split
    # again) -> one rank outside the group, and from a group to another group
    h.Scenario("conv_between_ranks", CONV, in_shape=(2, 8, 8), kwargs={0: {"padding": 1}},
               loss="CrossEntropyLoss", segments=[
                   M((0, 1), [0]), M((1, 8), [1, 2], "channel"), M((8, 10), [3])]),
    h.Scenario("group_to_group", CONV, in_shape=(2, 8, 8), kwargs={0: {"padding": 1}},
               segments=[M((0, 5), [0, 1, 2], "channel"), M((5, 10), [3, 1], "channel")]),
]


@pytest.fixture(scope="module")
def results():
    return h.run_world(WORLD, [job(sc) for sc in SCENARIOS])


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda sc: sc.name)
def test_training_equals_one_device(results, scenario):
    h.check_scenario(scenario, results)


def test_split_segments_hold_a_slice_of_their_weights(results):
    check_held_slices(SCENARIOS, results)


def check_held_slices(scenarios, results):
    """On every rank of a multi-rank segment: less than the whole segment's weights, and
    the group's holdings together at least all of them."""
    for sc in scenarios:
        model = h.build_model(sc)
        for k, seg in enumerate(sc.segments):
            if len(seg.ranks) < 2:
                continue
            whole = sum(p.numel() for i in range(*seg.layers) for p in model[i].parameters())
            held = [results[r][sc.name]["held"][k] for r in seg.ranks]
            assert all(n < whole for n in held) and sum(held) >= whole, (sc.name, k, held)


def test_slices_are_as_even_as_possible_and_cover_the_layer():
    rt = h.pasted_runtime(["channel"])
    assert rt["channel_sizes"](8, 3) == [3, 3, 2]
    assert rt["channel_sizes"](5, 4) == [2, 1, 1, 1]
    torch.manual_seed(0)
    full = nn.Linear(4, 8)
    shards = [rt["shard_linear"](full, i, 3) for i in range(3)]
    assert [s.out_features for s in shards] == [3, 3, 2]
    torch.testing.assert_close(torch.cat([s.weight for s in shards]), full.weight)
    torch.testing.assert_close(torch.cat([s.bias for s in shards]), full.bias)
    conv = nn.Conv2d(3, 5, 3, stride=2, padding=1, bias=False)
    part = rt["shard_conv"](conv, 1, 2)
    assert (part.out_channels, part.stride, part.padding, part.bias) == (2, (2, 2), (1, 1), None)
    torch.testing.assert_close(part.weight, conv.weight[3:])
    state = torch.get_rng_state()
    rt["shard_batchnorm"](nn.BatchNorm1d(8), 2, 3)
    assert torch.equal(torch.get_rng_state(), state)  # shards draw no random numbers
    with pytest.raises(ValueError, match="grouped"):
        rt["shard_conv"](nn.Conv2d(4, 4, 3, groups=2), 0, 2)
