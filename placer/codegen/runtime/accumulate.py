# accumulate: training.accumulate's micro-steps add their gradients up in .grad; DDP and
# FSDP2, which sum gradients over their group during backward, do so in the last only.
import contextlib

from torch.nn.parallel import DistributedDataParallel


@contextlib.contextmanager
def gradient_sync(modules, sync):
    """Within the block, DDP and FSDP2 modules sum gradients over their group only if `sync`."""
    with contextlib.ExitStack() as stack:
        for m in modules:
            if isinstance(m, DistributedDataParallel) and not sync:
                stack.enter_context(m.no_sync())
            elif hasattr(m, "set_requires_gradient_sync"):  # FSDP2 (fully_shard)
                m.set_requires_gradient_sync(sync)
        yield
