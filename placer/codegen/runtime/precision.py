# precision: `precision: bf16` in a pipeline under torch's schedules. The schedules call the
# stage modules and the loss themselves, so the module is what runs its forward under autocast
# (its output crossing float32, as between segments everywhere: exact, since the next layer
# rounds it to bfloat16 again where autocast wants that), and the loss is wrapped the same way.
import torch
import torch.nn as nn


class Autocast(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        with torch.autocast(args[0].device.type, dtype=torch.bfloat16):
            out = self.module(*args)
        return out.float() if out.is_floating_point() else out


def autocast_loss(loss_fn):
    """loss_fn under autocast, as the one-device reference computes it."""
    def loss(output, target):
        with torch.autocast(output.device.type, dtype=torch.bfloat16):
            return loss_fn(output, target)
    return loss
