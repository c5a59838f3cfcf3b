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


class Inputs(dict):
    """Several named model inputs (the spec's model.inputs), passed to forward by keyword. Every
    one has the batch in dim 0, and rows are cut from each alike: a batch of them goes where one
    input tensor goes (.to, .chunk, .narrow, .shape: the first input's)."""

    @property
    def shape(self):
        return next(iter(self.values())).shape

    def to(self, device):
        return Inputs({k: v.to(device) for k, v in self.items()})

    def chunk(self, n):
        parts = {k: v.chunk(n) for k, v in self.items()}
        return [Inputs({k: p[i] for k, p in parts.items()}) for i in range(len(next(iter(parts.values()))))]

    def narrow(self, dim, start, length):
        return Inputs({k: v.narrow(dim, start, length) for k, v in self.items()})


def run_model(model, x):
    """model(x), or model(**x) for several named inputs."""
    return model(**x) if isinstance(x, dict) else model(x)
