"""Gradient synchronisation of data segments (runtime/buckets.py, ddp_sum.py,
param_server.py, broadcast_sync.py), for real over gloo: training runs equal one device's."""

import pytest

try:
    from . import _harness as h
except ImportError:
    import _harness as h

pytestmark = pytest.mark.distributed

MLP, S = h.MLP, h.Segment
TINY = 0.0005  # MB: about 500 bytes, so the 16x16 weight alone fills a bucket

SCENARIOS = [
    # (c) overlap: false: no DDP, bucketed all-reduce (SUM) after backward
    h.Scenario("overlap_false_small_buckets", MLP, [
        S((0, 4), [0, 1], sync="allreduce", overlap=False, bucket_mb=TINY), S((4, 5), [2])]),
    h.Scenario("overlap_false_whole_model_4", MLP, loss="CrossEntropyLoss", segments=[
        S((0, 5), [0, 1, 2, 3], sync="allreduce", overlap=False)]),
    # DDP with several buckets and the loss on the data ranks
    h.Scenario("ddp_small_buckets_whole_model", MLP, [
        S((0, 5), [0, 1, 2], sync="allreduce", bucket_mb=TINY)]),
    # (d) parameter server inside the group, outside it (and holding the next segment),
    # and outside on a rank that holds nothing else
    h.Scenario("ps_inside", MLP, [S((0, 4), [0, 1], sync="parameter_server", server=0),
                                  S((4, 5), [2])]),
    h.Scenario("ps_outside_next_segment", MLP, [
        S((0, 4), [0, 1], sync="parameter_server", server=2), S((4, 5), [2])]),
    h.Scenario("ps_outside_idle_rank", MLP, loss="CrossEntropyLoss", segments=[
        S((0, 2), [0]), S((2, 5), [1, 2], sync="parameter_server", server=3, bucket_mb=TINY)]),
    # (e) broadcast from the first device of the group (also one listed out of rank order)
    h.Scenario("broadcast_then_merge", MLP, [S((0, 4), [0, 1, 2], sync="broadcast"),
                                             S((4, 5), [3])]),
    h.Scenario("broadcast_root_not_lowest", MLP, [S((0, 2), [3]),
                                                  S((2, 5), [2, 0], sync="broadcast")]),
]


results = h.world_results(SCENARIOS, ["buckets", "ddp_sum", "param_server", "broadcast_sync"])
test_training_equals_one_device = h.training_test(SCENARIOS)
