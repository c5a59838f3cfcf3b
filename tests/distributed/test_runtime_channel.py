"""Channel split (runtime/channel.py) and copies into and out of replicated groups
(runtime/replicate.py), for real over gloo: training equals one device's, uneven channel
counts, Conv and BatchNorm slices, group order that is not rank order."""

import pytest
import torch
import torch.nn as nn

try:
    from . import _harness as h
except ImportError:
    import _harness as h

pytestmark = pytest.mark.distributed


S = h.Segment
MLP_BN = [("Linear", 6, 8), ("ReLU",), ("Linear", 8, 8), ("BatchNorm1d", 8), ("Tanh",),
          ("Linear", 8, 5)]
CONV = [("Conv2d", 2, 5, 3), ("BatchNorm2d", 5), ("ReLU",), ("MaxPool2d", 2),
        ("Conv2d", 5, 3, 3), ("ReLU",), ("Flatten",), ("Linear", 12, 7), ("ReLU",),
        ("Linear", 7, 4)]

SCENARIOS = [
    # whole model over 3 ranks: 8 features as [3, 3, 2], 5 as [2, 2, 1]; BatchNorm1d on
    # the slice; the loss computed on every rank of the group and reported once
    h.Scenario("mlp_bn_3", MLP_BN, [S((0, 6), [0, 1, 2], mode="channel")]),
    # listed order is not rank order: rank 2 holds slice 0
    h.Scenario("mlp_out_of_order_4", MLP_BN, loss="CrossEntropyLoss", classes=5, segments=[
        S((0, 6), [2, 0, 3, 1], mode="channel")]),
    # one rank -> channel group (Conv, BatchNorm2d, pool, Flatten gathers, Linear split
    # again) -> one rank outside the group, and from a group to another group
    h.Scenario("conv_between_ranks", CONV, in_shape=(2, 8, 8), kwargs={0: {"padding": 1}},
               loss="CrossEntropyLoss", segments=[
                   S((0, 1), [0]), S((1, 8), [1, 2], mode="channel"), S((8, 10), [3])]),
    h.Scenario("group_to_group", CONV, in_shape=(2, 8, 8), kwargs={0: {"padding": 1}},
               segments=[S((0, 5), [0, 1, 2], mode="channel"), S((5, 10), [3, 1], mode="channel")]),
]


results = h.world_results(SCENARIOS, ["channel", "replicate"])
test_training_equals_one_device = h.training_test(SCENARIOS)


def test_split_segments_hold_a_slice_of_their_weights(results):
    h.check_held_slices(SCENARIOS, results)


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
