# recompute: a pipeline stage with `recompute: true`. torch's schedules call the stage module
# themselves, so the module is what runs its forward under torch.utils.checkpoint: only its
# input is kept, and backward runs the forward again.
import torch.nn as nn
import torch.utils.checkpoint


class Recomputed(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.module, *args, use_reentrant=False)
