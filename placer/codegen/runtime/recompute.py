# recompute: a pipeline stage with `recompute: true`. torch's schedules call the stage module
# themselves, so the module is what runs its forward under torch.utils.checkpoint: only its
# input is kept, and backward runs the forward again. In lockstep the parent's forward calls
# each placed layer: each of a recomputed segment's layers runs under checkpoint.
import functools

import torch.nn as nn
import torch.utils.checkpoint


class Recomputed(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.module, *args, use_reentrant=False)


def recompute_layers(model, names):
    """Each named layer's forward under torch.utils.checkpoint (an instance attribute, which
    nn.Module.__call__ calls, hooks and all): it keeps only its inputs, and backward runs it again."""
    for name in names:
        module = model.get_submodule(name)
        module.forward = functools.partial(torch.utils.checkpoint.checkpoint, module.forward, use_reentrant=False)
