"""Copy, split, merge and re-split between device groups (runtime/transfer.py), for real
over gloo: exact values for many group pairs, and training runs that equal one device's."""

import pytest

try:
    from . import _harness as h
except ImportError:
    import _harness as h

pytestmark = pytest.mark.distributed

MLP, S = h.MLP, h.Segment

SCENARIOS = [
    # (a) layer-wise model parallel over 3 ranks: 1 -> 1 copies
    h.Scenario("mp3_direct", MLP, [S((0, 2), [0]), S((2, 4), [1]), S((4, 5), [2])]),
    h.Scenario("mp3_via_host", MLP, loss="CrossEntropyLoss", segments=[
        S((0, 2), [0]), S((2, 4), [1], route="via_host"), S((4, 5), [2], route="via_host")]),
    # (b) data segment (DDP, summed gradients) then one rank: merge (rank 0 keeps its part)
    h.Scenario("data_then_merge", MLP, [S((0, 4), [0, 1], sync="allreduce"), S((4, 5), [0])]),
    h.Scenario("data_then_merge_elsewhere", MLP, loss="CrossEntropyLoss", segments=[
        S((0, 4), [0, 1], sync="allreduce"), S((4, 5), [2], route="via_host")]),
    # ... and the reverse: one rank, then a data segment (split)
    h.Scenario("split_then_data", MLP, [S((0, 2), [2]), S((2, 5), [0, 1], sync="allreduce")]),
    # d -> d' re-split with partial overlaps (12 rows: halves to thirds), loss on 3 ranks
    h.Scenario("resplit_2_to_3", MLP, [S((0, 2), [0, 1], sync="allreduce"),
                                       S((2, 5), [1, 2, 3], sync="allreduce")]),
]

CASES = [  # (src ranks, dst ranks, full shape, dim, route)
    ([0], [1], [12, 3], 0, "direct"),
    ([0], [0, 1, 2, 3], [12, 3], 0, "direct"),
    ([1, 2, 3], [0], [12, 2, 3], 0, "via_host"),
    ([0, 1], [1, 2, 3], [12, 3], 0, "direct"),
    ([3, 2], [0, 1], [12, 3], 0, "via_host"),  # group order is slice order, not rank order
    ([0, 1, 2, 3], [2], [12, 3], 0, "direct"),
    ([0, 1], [2, 3], [4, 12], 1, "direct"),  # channel dim
    ([0], [1, 2, 3], [2, 12, 2], 1, "via_host"),
    ([0, 1, 2], [0, 1, 2], [12, 3], 0, "direct"),  # same group: local copies only
]

results = h.world_results(SCENARIOS + [("cases", h.redistribute_cases, (CASES,))], ["ddp_sum"])


def test_redistribute_moves_exact_values_and_gradients_back(results):
    failures = [f for res in results for f in res["cases"]]
    assert not failures, "\n".join(failures)


test_training_equals_one_device = h.training_test(SCENARIOS)
