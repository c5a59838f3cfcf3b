"""Sharded data segments (runtime/sharding.py), for real over gloo: `shard: optimizer`
(ZeroRedundancyOptimizer after summed gradients, with and without DDP) and `shard: full`
(FSDP2 with summed gradients) train exactly like one device, alone and between other
segments, and their whole parameters come back under their own names."""

import pytest

try:
    from . import _harness as h
except ImportError:
    import _harness as h

pytestmark = pytest.mark.distributed

MLP, S = h.MLP, h.Segment
SCENARIOS = [
    h.Scenario("zero_ddp_whole_model_3", MLP, [
        S((0, 5), [0, 1, 2], sync="allreduce", shard="optimizer")]),
    h.Scenario("zero_no_overlap_then_head", MLP, loss="CrossEntropyLoss", segments=[
        S((0, 4), [1, 2], sync="allreduce", overlap=False, shard="optimizer"), S((4, 5), [0])]),
    # 16 rows over 3 ranks: uneven shards; the loss on the FSDP ranks
    h.Scenario("fsdp_whole_model_3", MLP, [S((0, 5), [1, 2, 3], sync="allreduce", shard="full")]),
    # one rank -> FSDP over 2 -> one rank: gradients in and out of a sharded segment
    h.Scenario("fsdp_between_ranks", MLP, loss="CrossEntropyLoss", segments=[
        S((0, 2), [3]), S((2, 4), [0, 1], sync="allreduce", shard="full"), S((4, 5), [2])]),
]


# tensor: unsharded_state_dict gathers FSDP's DTensor parameters
results = h.world_results(SCENARIOS, ["ddp_sum", "buckets", "sharding", "tensor"])
test_training_equals_one_device = h.training_test(SCENARIOS)


def test_params_and_optimizer_state_are_sharded(results):
    for sc in SCENARIOS:
        for rank, res in enumerate(results):
            fsdp = any(seg.shard == "full" and rank in seg.ranks for seg in sc.segments)
            assert res[sc.name]["dtensor_params"] == fsdp, (sc.name, rank)
        for seg in sc.segments:
            if seg.shard == "optimizer":  # ZeRO: each rank steps a part
                counts = [results[r][sc.name]["zero_params"] for r in seg.ranks]
                assert all(n < counts[0][1] for n, _ in counts), (sc.name, counts)
                assert sum(n for n, _ in counts) == counts[0][1], (sc.name, counts)
                # one flat bucket of parameters a rank: it broadcasts its shard as one message
                assert all(results[r][sc.name]["zero_bucket_view"] for r in seg.ranks), sc.name
