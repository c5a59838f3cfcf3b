# syncbn: SyncBatchNorm that also runs on CPU with gloo (torch's nn.SyncBatchNorm refuses
# CPU tensors). Forward all-reduces per-channel (sum, sum of squares, count) so every rank
# normalizes with the statistics of the group's whole batch; backward all-reduces the two
# per-channel gradient sums. The result equals BatchNorm over the global batch, running
# statistics included.
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        # a bfloat16 input (autocast) is normalized in float32 and the output rounded back, as
        # BatchNorm does on one device: a float32 output would round differently downstream
        ctx.dtype, x = x.dtype, x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        dims = [d for d in range(x.dim()) if d != 1]  # every dim but the channel dim
        shape = [1, -1] + [1] * (x.dim() - 2)  # per-channel values broadcast over x
        c = x.shape[1]
        # float64 so that E[x^2] - E[x]^2 does not lose the digits float32 would.
        count = torch.tensor([x.numel() / c], dtype=torch.float64, device=x.device)
        stats = torch.cat([x.sum(dims, dtype=torch.float64),
                           (x * x).sum(dims, dtype=torch.float64), count])
        dist.all_reduce(stats, group=group)
        n = stats[-1].item()
        mean = stats[:c] / n
        var = (stats[c:2 * c] / n - mean * mean).clamp_min(0)  # biased: what BatchNorm divides by
        if running_mean is not None:  # like BatchNorm: the running variance is unbiased
            running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
            unbiased = var * n / max(n - 1, 1)
            running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        invstd = (var + eps).rsqrt().to(x.dtype)
        xhat = (x - mean.to(x.dtype).view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.group, ctx.n, ctx.has_bias = group, n, bias is not None
        y = xhat if weight is None else xhat * weight.view(shape)
        return (y if bias is None else y + bias.view(shape)).to(ctx.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        dy = dy.to(xhat.dtype)
        dims = [d for d in range(dy.dim()) if d != 1]
        shape = [1, -1] + [1] * (dy.dim() - 2)
        c = dy.shape[1]
        sum_dy, sum_dy_xhat = dy.sum(dims), (dy * xhat).sum(dims)
        # Local sums: the data group's gradient sync adds them up like any other gradient.
        grad_weight = None if weight is None else sum_dy_xhat.clone()
        grad_bias = sum_dy.clone() if ctx.has_bias else None
        # dx needs the two sums over the whole batch, i.e. over the group.
        sums = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(sums, group=ctx.group)
        mean_dy, mean_dy_xhat = sums[:c] / ctx.n, sums[c:] / ctx.n
        scale = invstd if weight is None else invstd * weight
        dx = (dy - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
        return dx.to(ctx.dtype), grad_weight, grad_bias, None, None, None, None, None


class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm (same parameters, buffers, state_dict keys) whose batch statistics are
    those of the whole group's batch, synced with plain collectives over process_group.
    Not a subclass of nn.SyncBatchNorm: DDP refuses that class on CPU."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group  # None: the default group

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x):
        self._check_input_dim(x)
        if not self.training:  # eval: no sync, like torch's SyncBatchNorm
            use_batch = self.running_mean is None
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                self.bias, use_batch, 0.0, self.eps)
        track = self.track_running_stats
        momentum = self.momentum
        if track:
            self.num_batches_tracked.add_(1)
            if momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        return _SyncBatchNormFn.apply(
            x, self.weight, self.bias,
            self.running_mean if track else None, self.running_var if track else None,
            self.eps, momentum, self.process_group)


def convert_sync_batchnorm_cpu(module, group=None):
    """Swap every BatchNorm1d/2d/3d in module for a CPUSyncBatchNorm over group, keeping
    the same parameter and buffer tensors. Do it before wrapping the module in DDP."""
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        new = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum,
                               module.affine, module.track_running_stats, group)
        if module.affine:
            new.weight, new.bias = module.weight, module.bias
        new.running_mean, new.running_var = module.running_mean, module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm_cpu(child, group))
    return module
