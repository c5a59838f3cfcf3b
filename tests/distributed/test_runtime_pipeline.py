"""Pipelines on torch.distributed.pipelining (runtime/pipeline.py), for real over gloo:
every schedule by name trains exactly like one device (losses summed over microbatches,
gradients of the global mean with scale_grads=False), on a subgroup of the world, with
stage owners out of rank order, several stages per rank, and data-parallel stages."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from . import _harness as h
except ImportError:
    import _harness as h

pytestmark = pytest.mark.distributed


def run_pipeline(rt, rank, world, sc, schedule, n_microbatches):
    """sc.segments are the stages in order, each on d ranks (pipeline j: the j-th rank of
    every stage); the generated program's pipeline step, written once."""
    full = h.build_model(sc)
    stage_ranks = [seg.ranks for seg in sc.segments]
    n_stages, d = len(stage_ranks), len(stage_ranks[0])
    pp_size = len({ranks[0] for ranks in stage_ranks})
    pipelines = []  # pipeline j's ranks, in stage-owner order
    for j in range(d):
        owners = [None] * pp_size
        for s, ranks in enumerate(stage_ranks):
            owners[rt["pipeline_stage_owner"](schedule, s, pp_size)] = ranks[j]
        pipelines.append(owners)
    pp_groups = [rt["pipeline_group"](owners) for owners in pipelines]  # every rank, in order
    data_groups = [dist.new_group(ranks) if d > 1 else None for ranks in stage_ranks]
    mine = [j for j, owners in enumerate(pipelines) if rank in owners]
    losses, held = [], []
    if mine:
        j = mine[0]
        modules = {s: h.segment_module(full, seg.layers)
                   for s, seg in enumerate(sc.segments) if seg.ranks[j] == rank}
        held = [i for s in modules for i in range(*sc.segments[s].layers)]
        stages = rt["pipeline_stages"](modules, n_stages, pp_groups[j])
        sched = rt["make_pipeline_schedule"](schedule, stages, n_microbatches,
                                             getattr(nn, sc.loss)(), sc.batch)
        opt = h.make_optimizer(sc, [p for m in modules.values() for p in m.parameters()])
    out_shape = h.activation_shapes(sc, full)[-1]
    for step in range(sc.steps):
        x, y = h.global_batch(rt, sc, step, out_shape)
        reported = torch.zeros(())
        if mine:
            opt.zero_grad(set_to_none=True)
            x = rt["pipeline_local_batch"](x, n_microbatches, d, j)
            y = rt["pipeline_local_batch"](y, n_microbatches, d, j)
            reported = rt["pipeline_step"](sched, x if 0 in modules else None,
                                           y if n_stages - 1 in modules else None)
            for s, module in modules.items():
                if data_groups[s] is not None:
                    rt["all_reduce_grads"](module.parameters(), data_groups[s])
            opt.step()
        dist.all_reduce(reported)  # the last stage's ranks hold the losses, the others 0
        losses.append(reported.item())
    return {"losses": losses, "state": h.held_state(rt, full, held)}


S = h.Segment
MLP = [("Linear", 6, 8), ("Tanh",), ("Linear", 8, 8), ("ReLU",), ("Linear", 8, 8), ("Tanh",),
       ("Linear", 8, 4)]
TWO, FOUR = [(0, 4), (4, 7)], [(0, 2), (2, 4), (4, 6), (6, 7)]


def pipe(name, schedule, bounds, ranks, n_microbatches=4, **kw):
    sc = h.Scenario(name, MLP, [S(b, r) for b, r in zip(bounds, ranks)], batch=8, **kw)
    return sc, (name, run_pipeline, (sc, schedule, n_microbatches))


CASES = [
    pipe("gpipe_2", "gpipe", TWO, [[0], [1]]),
    # stage owners out of rank order (the pipeline group keeps listed order), 3 stages
    pipe("1f1b_3", "1f1b", [(0, 2), (2, 4), (4, 7)], [[3], [1], [2]],
         loss="CrossEntropyLoss"),
    # 2 stages per rank: stage s on pipeline rank s % 2
    pipe("interleaved_1f1b_2x2", "interleaved_1f1b", FOUR, [[1], [2], [1], [2]]),
    pipe("looped_bfs_2x2", "looped_bfs", FOUR, [[0], [3], [0], [3]]),
    pipe("interleaved_zero_bubble_2x2", "interleaved_zero_bubble", FOUR, [[0], [1], [0], [1]]),
    # V shape: rank r holds stages r and 3 - r (the first rank holds the loss)
    pipe("zbv_zero_bubble_2x2", "zbv_zero_bubble", FOUR, [[2], [0], [0], [2]]),
    pipe("dualpipev_2x2", "dualpipev", FOUR, [[1], [3], [3], [1]], loss="CrossEntropyLoss"),
    # data-parallel stages: 2 stages x 2 data ranks, 2 microbatches of 4 rows, 2 per pipeline
    pipe("1f1b_data_2x2", "1f1b", TWO, [[0, 1], [2, 3]], n_microbatches=2),
    pipe("gpipe_data_crossed", "gpipe", TWO, [[3, 0], [1, 2]], n_microbatches=2,
         loss="CrossEntropyLoss"),
]
SCENARIOS = [sc for sc, _ in CASES]
JOBS = [job for _, job in CASES]


results = h.world_results(JOBS, ["pipeline", "buckets"])
test_training_equals_one_device = h.training_test(SCENARIOS)


def test_stage_owners_and_local_batches():
    rt = h.pasted_runtime(["pipeline"])
    owner = rt["pipeline_stage_owner"]
    assert [owner("1f1b", s, 3) for s in range(3)] == [0, 1, 2]
    assert [owner("interleaved_1f1b", s, 2) for s in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [owner("dualpipev", s, 2) for s in range(4)] == [0, 1, 1, 0]
    x = torch.arange(8)
    # microbatches [0..3], [4..7]; pipeline 1 of 2 takes the second half of each
    assert rt["pipeline_local_batch"](x, 2, 2, 1).tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        rt["make_pipeline_schedule"]("zigzag", [], 2, nn.MSELoss(), 8)
