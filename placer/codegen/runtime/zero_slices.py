# zero_slices: ZeRO-1 over the data replicas of a 2-D segment (`tensor` with
# `data: D, shard: optimizer`). The devices at one position of every replica hold the same
# slices (DTensor local tensors, or plain tensors); once their gradients are summed over the
# position's group (all_reduce_slices), each steps the optimizer on its contiguous 1/D of the
# slices' elements, so it keeps 1/D of the optimizer state, and broadcasts that part to the
# others. torch's ZeroRedundancyOptimizer shards whole parameters and broadcasts the Python
# tensors it is given, which a DTensor is not; this shards elements, so each device sends
# exactly its 1/D. The optimizers placer runs (SGD, Adam, ...) work element by element: a part
# steps as it would inside the whole parameter.
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class ZeroSlices(torch.optim.Optimizer):
    """optimizer_class(**defaults) over this device's 1/D of `params`' local elements, D the
    ranks of `group`. Its param_groups are the whole parameters' (an lr scheduler sets them and
    each step copies them into the part's optimizer); its state_dict is the part's."""

    def __init__(self, params, group, optimizer_class, **defaults):
        super().__init__(list(params), defaults)
        self.params, self.group = self.param_groups[0]["params"], group
        ranks, n = dist.get_process_group_ranks(group), sum(_local(p).numel() for p in self.params)
        d, me = len(ranks), ranks.index(dist.get_rank())
        self.roots = ranks
        self.bounds = [i * (n // d) + min(i, n % d) for i in range(d + 1)]  # part i: [bounds[i], bounds[i + 1])
        start, end = self.bounds[me], self.bounds[me + 1]
        flat = torch.cat([_local(p).detach().reshape(-1) for p in self.params])
        self.part = torch.nn.Parameter(flat[start:end].clone())
        self.inner = optimizer_class([self.part], **defaults)

    def _flat(self, grads):
        return torch.cat([_local(p.grad if grads else p).detach().reshape(-1) for p in self.params])

    @torch.no_grad()
    def step(self, closure=None):
        for key, value in self.param_groups[0].items():  # (lr_schedule's changes)
            if key != "params":
                self.inner.param_groups[0][key] = value
        me = self.roots.index(dist.get_rank())
        start, end = self.bounds[me], self.bounds[me + 1]
        flat = self._flat(False)
        self.part.copy_(flat[start:end])  # the parameters' values: a resumed run loaded them after __init__
        self.part.grad = self._flat(True)[start:end].clone()
        self.inner.step()
        flat[start:end] = self.part
        for i, root in enumerate(self.roots):  # each part from the device that stepped it
            dist.broadcast(flat[self.bounds[i]:self.bounds[i + 1]], src=root, group=self.group)
        at = 0
        for p in self.params:
            local = _local(p)
            local.copy_(flat[at:at + local.numel()].view_as(local))
            at += local.numel()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict)
        for key, value in self.inner.param_groups[0].items():
            if key != "params":
                self.param_groups[0][key] = value
