"""CPU SyncBatchNorm (runtime/syncbn.py) in data segments, for real over gloo: losses,
parameters and running statistics equal BatchNorm over the whole batch on one device."""

import pytest
import torch
import torch.nn as nn

try:
    from . import _harness as h
except ImportError:
    import _harness as h

pytestmark = pytest.mark.distributed

S = h.Segment
BN1D = [("Linear", 6, 16), ("BatchNorm1d", 16), ("ReLU",), ("Linear", 16, 4)]

SCENARIOS = [
    # (f) BatchNorm1d under DDP, the loss on both data ranks
    h.Scenario("bn1d_ddp", BN1D, [S((0, 4), [0, 1], sync="allreduce", sync_batchnorm=True)]),
    # cumulative running average (momentum None), overlap false, merge into a head
    h.Scenario("bn1d_cumulative_overlap_false", BN1D, kwargs={1: {"momentum": None}}, segments=[
        S((0, 3), [0, 1, 2], sync="allreduce", overlap=False, sync_batchnorm=True),
        S((3, 4), [3])]),
    # (N, C, L) input, no affine parameters, under a parameter server outside the group
    h.Scenario("bn1d_3d_no_affine_ps", [
        ("Linear", 6, 8), ("BatchNorm1d", 3), ("ReLU",), ("Flatten",), ("Linear", 24, 4)],
        in_shape=(3, 6), kwargs={1: {"affine": False}}, segments=[
            S((0, 4), [1, 2], sync="parameter_server", server=0, sync_batchnorm=True),
            S((4, 5), [0])]),
    # BatchNorm2d after a convolution, 4-way DDP, class-id targets
    h.Scenario("bn2d_conv_ddp4", [
        ("Conv2d", 2, 3, 3), ("BatchNorm2d", 3), ("ReLU",), ("Flatten",), ("Linear", 12, 4)],
        in_shape=(2, 4, 4), loss="CrossEntropyLoss", segments=[
            S((0, 5), [0, 1, 2, 3], sync="allreduce", sync_batchnorm=True)]),
]


# the state compared includes running_mean/var and num_batches_tracked
results = h.world_results(SCENARIOS, ["buckets", "ddp_sum", "param_server", "syncbn"])
test_training_equals_one_device = h.training_test(SCENARIOS)


def test_convert_keeps_parameters_buffers_and_state_dict_keys():
    rt = h.pasted_runtime(["syncbn"])
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Sequential(nn.BatchNorm2d(3)))
    before = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    model.eval()
    converted = rt["convert_sync_batchnorm_cpu"](model)
    assert isinstance(converted[1], rt["CPUSyncBatchNorm"])
    assert isinstance(converted[2][0], rt["CPUSyncBatchNorm"])
    assert not converted[1].training
    after = converted.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[k] is before[k] for k in before)  # the same tensors, not copies
    x = torch.randn(8, 5)  # eval mode needs no process group: running statistics
    torch.testing.assert_close(converted[1](x), nn.functional.batch_norm(
        x, before["1.running_mean"], before["1.running_var"], before["1.weight"],
        before["1.bias"], False, 0.0, 1e-5))
