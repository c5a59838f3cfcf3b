"""Sharded data segments (runtime/sharding.py), for real over gloo: `shard: optimizer`
(ZeroRedundancyOptimizer after summed gradients, with and without DDP) and `shard: full`
(FSDP2 with summed gradients) train exactly like one device, alone and between other
segments, and their whole parameters come back under their own names."""

from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

try:
    from . import _harness as h
except ImportError:
    import _harness as h

pytestmark = pytest.mark.distributed

WORLD = 4


def run_sharded(rt, rank, world, sc):
    """Segments (h.Segment; sync None for one rank, else the shard mode 'optimizer' /
    'optimizer_no_overlap' / 'full') joined by transfer.redistribute along the batch."""
    full = h.build_model(sc)
    shapes = h.activation_shapes(sc, full)
    segs = []
    for seg in sc.segments:
        group = dist.new_group(seg.ranks)
        module = opt = None
        if rank in seg.ranks:
            module = nn.Sequential(OrderedDict((str(i), full[i]) for i in range(*seg.layers)))
            if seg.sync == "full":
                module = rt["fully_shard_segment"](module, group)
            if seg.sync and seg.sync.startswith("optimizer"):
                if seg.sync == "optimizer":
                    module = rt["ddp_sum"](module, group)
                opt = rt["zero_optimizer"](module.parameters(), group, torch.optim.SGD,
                                           lr=sc.lr, momentum=sc.momentum)
            else:
                opt = h.make_optimizer(sc, module.parameters())
        segs.append((seg, group, module, opt))
    loss_fn = getattr(nn, sc.loss)()
    losses, sharded, zero = [], False, None
    for step in range(sc.steps):
        x, y = h.global_batch(rt, sc, step, shapes[-1])
        acts, out = [], None
        for k, (seg, _, module, _) in enumerate(segs):
            if k == 0:
                inp = rt["local_slice"](x, seg.ranks, rank) if module is not None else None
            else:
                inp = rt["redistribute"](out, segs[k - 1][0].ranks, seg.ranks, shapes[k])
                if inp is not None:
                    inp.requires_grad_()
            out = module(inp) if module is not None else None
            acts.append((inp, out))
        last = segs[-1][0]
        reported = torch.zeros(())
        if rank in last.ranks:
            loss = loss_fn(out, rt["local_slice"](y, last.ranks, rank)) * (out.shape[0] / sc.batch)
            reported = loss.detach().clone()
        grad = None
        for k in reversed(range(len(segs))):
            seg, group, module, opt = segs[k]
            inp, out = acts[k]
            if module is not None:
                opt.zero_grad(set_to_none=True)
                if k == len(segs) - 1:
                    loss.backward()
                else:
                    torch.autograd.backward(out, grad)
                if seg.sync == "optimizer_no_overlap":
                    rt["all_reduce_grads"](module.parameters(), group)
            if k > 0:
                grad = rt["redistribute_grad"](inp.grad if module is not None else None,
                                               segs[k - 1][0].ranks, seg.ranks, shapes[k])
        for seg, _, module, opt in segs:
            if opt is not None:
                opt.step()
                sharded |= any(isinstance(p, DTensor) for p in module.parameters())
                if hasattr(opt, "optim"):  # ZeRO: (parameters this rank steps, all of them)
                    zero = (sum(len(g["params"]) for g in opt.optim.param_groups),
                            len(list(module.parameters())))
        dist.all_reduce(reported)
        losses.append(reported.item())
    state = {}
    for seg, _, module, _ in segs:
        if module is not None:
            for i in range(*seg.layers):
                layer = rt["unsharded_state_dict"](full[i])
                state.update({f"{i}.{k}": v.detach().clone() for k, v in layer.items()})
    return {"losses": losses, "state": state, "dtensor_params": sharded, "zero_params": zero}


S = h.Segment
MLP = [("Linear", 6, 16), ("ReLU",), ("Linear", 16, 16), ("ReLU",), ("Linear", 16, 4)]
SCENARIOS = [
    h.Scenario("zero_ddp_whole_model_3", MLP, [S((0, 5), [0, 1, 2], sync="optimizer")]),
    h.Scenario("zero_no_overlap_then_head", MLP, loss="CrossEntropyLoss", segments=[
        S((0, 4), [1, 2], sync="optimizer_no_overlap"), S((4, 5), [0])]),
    # 16 rows over 3 ranks: uneven shards; the loss on the FSDP ranks
    h.Scenario("fsdp_whole_model_3", MLP, [S((0, 5), [1, 2, 3], sync="full")]),
    # one rank -> FSDP over 2 -> one rank: gradients in and out of a sharded segment
    h.Scenario("fsdp_between_ranks", MLP, loss="CrossEntropyLoss", segments=[
        S((0, 2), [3]), S((2, 4), [0, 1], sync="full"), S((4, 5), [2])]),
]
JOBS = [(sc.name, run_sharded, (sc,)) for sc in SCENARIOS]


@pytest.fixture(scope="module")
def results():
    return h.run_world(WORLD, JOBS)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda sc: sc.name)
def test_training_equals_one_device(results, scenario):
    h.check_scenario(scenario, results)


def test_params_and_optimizer_state_are_sharded(results):
    for sc in SCENARIOS:
        for rank, res in enumerate(results):
            fsdp = any(seg.sync == "full" and rank in seg.ranks for seg in sc.segments)
            assert res[sc.name]["dtensor_params"] == fsdp, (sc.name, rank)
        for seg in sc.segments:
            if seg.sync and seg.sync.startswith("optimizer"):  # ZeRO: each rank steps a part
                counts = [results[r][sc.name]["zero_params"] for r in seg.ranks]
                assert all(n < counts[0][1] for n, _ in counts), (sc.name, counts)
                assert sum(n for n, _ in counts) == counts[0][1], (sc.name, counts)
