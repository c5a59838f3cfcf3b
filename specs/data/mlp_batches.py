"""User data for specs/mlp_user_data.yaml: a deterministic stream of batches.

placer calls `make_batches(**kwargs)` (kwargs from the spec) in `generate`d
programs and `run`, never in `validate`. It yields (input, target) pairs of
global batches; placer splits them across the devices of the first segment.
"""
import torch


def make_batches(batch_size: int = 16, features: int = 32, classes: int = 10, seed: int = 0):
    """Yield (input [batch_size, features] float32, target [batch_size] int64) forever.

    The target is a fixed function of the input (the class of a random linear
    map's largest output), so the loss falls as the model learns.
    """
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(features, classes, generator=g)
    while True:
        x = torch.randn(batch_size, features, generator=g)
        yield x, (x @ teacher).argmax(dim=1)
