# batch: the global batch of step t, identical on every rank, and one rank's slice of it.
# Every rank draws the whole batch from a generator seeded by (seed, step): that is cheap
# for synthetic data and makes every slice exactly the rows the one-device run would see.
import torch


def step_generator(seed, step):
    # One generator per step, so any rank can make step t's batch without replaying steps 0..t-1.
    return torch.Generator().manual_seed(seed * 2**32 + step)


def make_tensor(gen, shape, dtype=torch.float32, high=None):
    # Floats are standard normal; integers (class ids, token ids) are uniform in [0, high).
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=dtype)
    return torch.randint(0, high, shape, generator=gen, dtype=dtype)


def local_slice(x, ranks, rank, dim=0):
    # The group splits dim into equal contiguous slices, one per rank, in group order.
    size = x.shape[dim] // len(ranks)
    return x.narrow(dim, ranks.index(rank) * size, size)
