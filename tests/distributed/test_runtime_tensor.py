"""Tensor parallelism with DTensor's ColwiseParallel/RowwiseParallel on a mesh made from a
segment's own group (runtime/tensor.py), for real over gloo: training equals one device's,
pairs found across elementwise layers, replicated layers around them, uneven splits,
copies into and out of the group, and whole parameters back under their own names."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from . import _harness as h
except ImportError:
    import _harness as h

pytestmark = pytest.mark.distributed

S = h.Segment
TWO_PAIRS = [("Tanh",), ("Linear", 6, 16), ("GELU",), ("Linear", 16, 6), ("LayerNorm", 6),
             ("Linear", 6, 8), ("ReLU",), ("Tanh",), ("Linear", 8, 4)]

SCENARIOS = [
    # two pairs with a replicated LayerNorm between, the loss on both ranks (reported once)
    h.Scenario("two_pairs_2", TWO_PAIRS, [S((0, 9), [0, 1], mode="tensor")]),
    # one rank -> 3-way tensor group (16 features as 6, 6, 4) -> one rank; layer 5 has
    # no partner (the segment ends after it) and runs replicated
    h.Scenario("between_ranks_3", TWO_PAIRS, loss="CrossEntropyLoss", segments=[
        S((0, 1), [3]), S((1, 6), [1, 2, 0], mode="tensor"), S((6, 9), [3])]),
    # tensor group -> channel group: replicated to replicated
    h.Scenario("tensor_to_channel", TWO_PAIRS, segments=[
        S((0, 5), [0, 1], mode="tensor"), S((5, 9), [1, 2, 3], mode="channel")]),
]




def unread_outputs(rt, rank, world, steps):
    """A tensor group of ranks 0 and 1 runs `steps` forwards and backwards whose outputs no rank
    reads (as where the next segment runs on other ranks): how many collectives torch's registry
    still holds unwaited afterwards, with each one's output."""
    group = dist.new_group([0, 1])  # (every rank of the world makes a group)
    if rank > 1:
        return None
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    rt["tensor_parallelize"](seq, group, [("0", "2")])
    for _ in range(steps):
        out = seq(torch.ones(2, 4))
        torch.autograd.backward(out, torch.ones(2, 4))
    return torch._C._distributed_c10d._get_work_registry_size()


JOBS = SCENARIOS + [("unread_outputs", unread_outputs, (3,))]
results = h.world_results(JOBS, ["tensor", "channel", "replicate"])
test_training_equals_one_device = h.training_test(SCENARIOS)


def test_a_row_halfs_all_reduce_is_waited_for_where_nobody_reads_it(results):
    # RowwiseParallel all-reduces its output asynchronously, waited on where it is first read:
    # unread, each step's output stayed in torch's registry for the rest of the run
    assert [results[r]["unread_outputs"] for r in range(2)] == [0, 0]


def test_split_segments_hold_a_slice_of_their_weights(results):
    h.check_held_slices(SCENARIOS, results)


def test_pairs_are_linears_joined_by_elementwise_layers():
    seq = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Dropout(), nn.Linear(4, 4),
                        nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    # Dropout acts on each feature alone like ReLU; LayerNorm needs every feature: 4 is alone
    assert h.module_pairs(seq) == [("0", "3"), ("6", "8")]
    assert h.module_pairs(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), nn.Linear(2, 2))) == []
